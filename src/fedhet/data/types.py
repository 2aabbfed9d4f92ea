"""Plain data types shared by the data layer: what a loader returns, what a partitioner returns, and one client's
tensors (``ClientData``), which the training loop and the algorithms read."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from fedhet.errors import FedhetError


class DataError(FedhetError, ValueError):
    """A dataset, partition or data parameter problem, with a message meant for the user.

    The message is kept to one line: line breaks (as in some library errors it quotes) become "; "."""

    def __init__(self, message: str) -> None:
        super().__init__("; ".join(part.strip() for part in str(message).splitlines() if part.strip()))


@dataclass
class ArrayDataset:
    """Raw arrays of one dataset plus the metadata the rest of fedhet needs.

    Images are float32 ``(N, C, H, W)`` scaled to [0, 1] and *not* normalised (``mean``/``std`` are applied when the
    data is moved into tensors). Tabular data is float32 ``(N, D)``; character sequences are int64 ``(N, L)``.
    Labels are int64 ``(N,)`` in ``[0, num_classes)``.

    ``groups_train`` / ``groups_test`` hold a natural client id per sample (Shakespeare role, Synthetic user) for
    datasets that come already split by user; ``None`` otherwise. A dataset with no official test set has empty
    ``x_test``/``y_test`` and ``has_test_set = False``; its global test set is then the union of the clients' local
    test splits.

    Provenance (what a run read; ``provenance()`` gives it as a small JSON-ready dict for the run folder):

    * ``source_dir``: for data read from files, the folder they were read from (absolute path; ``source_files`` are
      relative to it); otherwise a description: ``"generated (synthetic)"``, ``"scikit-learn 1.9.1 load_digits()"``;
      ``None`` for a hand-built dataset.
    * ``source_files``: the files read, relative to ``source_dir``, sorted; empty when nothing was read from files.
    * ``content_hash``: sha256 hex. For files it is the sha256 of their ``sha256sum`` listing (``<sha256>  <name>``
      lines in ``source_files`` order), so ``cd SOURCE_DIR && sha256sum FILES | sha256sum`` reproduces it; it covers
      every byte read and changes when any byte does. Otherwise it is ``array_hash()``, a sha256 of the arrays
      themselves (filled in automatically when not given).
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    input_shape: tuple[int, ...]
    task: str = "image"  # "image" | "tabular" | "sequence"
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    class_names: list[str] | None = None
    groups_train: np.ndarray | None = None
    groups_test: np.ndarray | None = None
    # a domain id per sample (writer, hospital, camera) in [0, len(domain_names)): natural feature skew
    domains_train: np.ndarray | None = None
    domains_test: np.ndarray | None = None
    domain_names: list[str] | None = None
    extra: dict = field(default_factory=dict)
    source_dir: str | None = None
    source_files: tuple[str, ...] = ()
    content_hash: str = ""

    @property
    def has_test_set(self) -> bool:
        return len(self.y_test) > 0

    def __post_init__(self) -> None:
        if len(self.x_train) != len(self.y_train) or len(self.x_test) != len(self.y_test):
            raise DataError(f"dataset {self.name!r}: inputs and labels have different lengths")
        self.check_domains()
        if not self.content_hash:
            self.content_hash = self.array_hash()

    def class_subset(self, classes: list[int] | None) -> ArrayDataset:
        """Only the samples of ``classes`` (training and test set), relabelled 0, 1, ... in the order given: class
        ``classes[i]`` becomes label ``i``. For pretraining on some classes and fine-tuning on the others, or a
        smaller task. The provenance keeps the source files and hash and records the classes."""
        if not classes:
            return self
        bad = [c for c in classes if not 0 <= c < self.num_classes]
        if bad:
            raise DataError(
                f"dataset.classes {list(classes)}: {self.name!r} has classes 0-{self.num_classes - 1}, not {bad[0]}"
            )
        new_label = np.full(self.num_classes, -1, dtype=np.int64)
        new_label[list(classes)] = np.arange(len(classes))
        train = np.flatnonzero(new_label[self.y_train] >= 0)
        test = np.flatnonzero(new_label[self.y_test] >= 0)
        if not len(train):
            raise DataError(f"dataset.classes {list(classes)}: {self.name!r} has no training sample of these classes")

        def cut(array: np.ndarray | None, keep: np.ndarray) -> np.ndarray | None:
            return None if array is None else array[keep]

        names = None if self.class_names is None else [self.class_names[c] for c in classes]
        return replace(
            self,
            x_train=self.x_train[train],
            y_train=new_label[self.y_train[train]],
            x_test=self.x_test[test],
            y_test=new_label[self.y_test[test]],
            num_classes=len(classes),
            class_names=names,
            groups_train=cut(self.groups_train, train),
            groups_test=cut(self.groups_test, test),
            domains_train=cut(self.domains_train, train),
            domains_test=cut(self.domains_test, test),
            extra={**self.extra, "classes": list(classes)},
        )

    def train_subset(self, fraction: float) -> ArrayDataset:
        """A class-stratified ``fraction`` of the training set (each class rounded, at least one sample of a class
        that has any), the same subset whatever the run seed; the test set is untouched. The provenance keeps the
        source files and hash and records the fraction."""
        if fraction >= 1.0:
            return self
        rng = np.random.default_rng(0x5B5E7)
        keep = []
        for c in np.unique(self.y_train):
            idx = np.flatnonzero(self.y_train == c)
            keep.append(rng.choice(idx, size=max(1, round(fraction * len(idx))), replace=False))
        keep = np.sort(np.concatenate(keep))
        groups = None if self.groups_train is None else self.groups_train[keep]
        domains = None if self.domains_train is None else self.domains_train[keep]
        extra = {**self.extra, "train_fraction": fraction}
        x, y = self.x_train[keep], self.y_train[keep]
        return replace(self, x_train=x, y_train=y, groups_train=groups, domains_train=domains, extra=extra)

    def check_domains(self) -> None:
        """Domain ids, where given, are one per sample in [0, len(domain_names)), for train and test alike."""
        if self.domains_train is None and self.domains_test is None:
            return
        if self.domains_train is None or self.domains_test is None or not self.domain_names:
            raise DataError(f"dataset {self.name!r}: domains need domains_train, domains_test and domain_names")
        for split, ids, y in (("train", self.domains_train, self.y_train), ("test", self.domains_test, self.y_test)):
            if len(ids) != len(y):
                raise DataError(f"dataset {self.name!r}: {len(ids)} {split} domain ids for {len(y)} samples")
            if len(ids) and (ids.min() < 0 or ids.max() >= len(self.domain_names)):
                raise DataError(
                    f"dataset {self.name!r}: {split} domain ids outside [0, {len(self.domain_names)}) "
                    f"(domain_names has {len(self.domain_names)})"
                )

    def array_hash(self) -> str:
        """sha256 over the name, dtype, shape and bytes of each array (train, test, groups), in that order."""
        arrays = {"x_train": self.x_train, "y_train": self.y_train, "x_test": self.x_test, "y_test": self.y_test}
        arrays |= {"groups_train": self.groups_train, "groups_test": self.groups_test}
        arrays |= {"domains_train": self.domains_train, "domains_test": self.domains_test}
        digest = hashlib.sha256()
        for name, array in arrays.items():
            if array is not None:
                array = np.ascontiguousarray(array)
                digest.update(f"{name} {array.dtype.str} {array.shape}\n".encode())
                digest.update(array.reshape(-1).view(np.uint8))
        return digest.hexdigest()

    def provenance(self, max_files: int = 100) -> dict:
        """Where the data came from: ``{"dataset", "source", "files", "file_count", "sha256", "sha256_of"}``.

        ``source`` is ``source_dir``; ``files`` lists ``source_files``, or when there are more than ``max_files``,
        each top-level folder once as ``"train/ (100000 files)"``; ``sha256_of`` says whether the hash covers
        ``"files"`` or ``"arrays"``."""
        return {
            "dataset": self.name,
            "source": self.source_dir,
            "files": summarise_files(self.source_files, max_files),
            "file_count": len(self.source_files),
            "sha256": self.content_hash,
            "sha256_of": "files" if self.source_files else "arrays",
            **({"classes": self.extra["classes"]} if "classes" in self.extra else {}),
            **({"train_fraction": self.extra["train_fraction"]} if "train_fraction" in self.extra else {}),
            **self.extra.get("provenance", {}),  # a loader's own facts: which split was the test set, a cache file
        }


def summarise_files(names: tuple[str, ...], limit: int) -> list[str]:
    """``names`` themselves if there are at most ``limit``, else one entry per top-level folder with its count."""
    if len(names) <= limit:
        return list(names)
    counts: dict[str, int] = {}
    for name in names:
        top, sep, _ = name.partition("/")
        key = f"{top}/" if sep else top
        counts[key] = counts.get(key, 0) + 1
    out = [f"{key} ({n} files)" if key.endswith("/") else key for key, n in counts.items()]
    return out if len(out) <= limit else [*out[: limit - 1], f"... ({len(out) - limit + 1} more)"]


@dataclass
class ClientData:
    """One client's data as tensors on the compute device (a batch is an index into them)."""

    x: torch.Tensor
    y: torch.Tensor
    num_classes: int
    x_test: torch.Tensor | None = None
    y_test: torch.Tensor | None = None
    # validation data (partition.validation_fraction): held out of the client's training share, never trained on;
    # what tuning reads (docs/tuning.md), so a tuned run never looks at its test data
    x_val: torch.Tensor | None = None
    y_val: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.y)

    def label_counts(self) -> torch.Tensor:
        return torch.bincount(self.y, minlength=self.num_classes).to(torch.float32)

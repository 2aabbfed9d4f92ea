"""Saved partitions: the clients' index sets of a config in a JSON file, and read back for a run.

``fedhet partition --save FILE`` and ``fedhet.save_partition`` write one; ``partition.name = "file"`` with
``partition.path = FILE`` trains on it (``fedhet.load_partition`` reads it). The format (docs/non-iid.md)::

    {
      "format": "fedhet-partition",
      "version": 1,
      "dataset": {"name", "sha256", "classes" (where set), "train_fraction", "merge_test", "samples",
                  "test_samples", "labels_sha256"},
      "made_by": {"partition": {...}, "dataset": {...}, "seed": 0, "fedhet": "0.1.0"},
      "clients": [{"train": [3, 17, ...], "test": [...]}, ...]
    }

``train`` indexes the samples a partitioner splits (the training set, after ``dataset.train_fraction``; training
then test set with ``partition.merge_test``); ``test``, present only when the partition dealt local test data from
the official test set (``partition.local_test`` = "matched" or "natural"), indexes that test set. A local split
(``local_test_fraction``) is not saved: a run makes it from its seed when it builds its clients. ``dataset`` is the
fingerprint a run checks: the same data (``sha256``, as in provenance.json), the same subset and the same labels in
the same order (``labels_sha256``), so every index means the sample it meant when the file was written.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fedhet.data.types import DataError

FORMAT = "fedhet-partition"
VERSION = 1
MAX_BYTES = 2**30  # far above any partition of a dataset that fits in memory
# the fingerprint keys a run compares, and how a mismatch is worded
COMPARED = {
    "name": "dataset",
    "sha256": "data (sha256)",
    "train_fraction": "dataset.train_fraction",
    "classes": "dataset.classes",
    "merge_test": "partition.merge_test",
}


def labels_hash(labels: np.ndarray) -> str:
    """sha256 of the labels as int64: the same labels in the same order."""
    return hashlib.sha256(np.ascontiguousarray(labels, np.int64).tobytes()).hexdigest()


def fingerprint(ds, labels: np.ndarray, train_fraction: float, merge_test: bool, classes: list | None = None) -> dict:
    """What a saved partition was made from: the dataset, its subset and the labels that were split (``classes``
    only where set, so files saved before the setting existed still match a run without it)."""
    return {
        "name": ds.name,
        "sha256": ds.content_hash,
        **({"classes": list(classes)} if classes else {}),
        "train_fraction": train_fraction,
        "merge_test": merge_test,
        "samples": len(labels),
        "test_samples": len(ds.y_test),
        "labels_sha256": labels_hash(labels),
    }


@dataclass
class SavedPartition:
    """The clients' index sets (``train``, and ``test`` into the official test set where the partition dealt it),
    the dataset's ``fingerprint`` and the settings they were ``made_by``."""

    train: list[np.ndarray]
    test: list[np.ndarray] | None = None
    dataset: dict = field(default_factory=dict)
    made_by: dict = field(default_factory=dict)
    path: Path | None = None  # the file it was read from

    @property
    def num_clients(self) -> int:
        return len(self.train)

    def save(self, path: str | Path) -> Path:
        """Write the file (atomically); one line of indices per client keeps a large one readable."""
        from fedhet.paths import replace_atomic

        head = {"format": FORMAT, "version": VERSION, "dataset": self.dataset, "made_by": self.made_by}
        clients = []
        for i, train in enumerate(self.train):
            client = {"train": np.asarray(train).tolist()}
            if self.test is not None:
                client["test"] = np.asarray(self.test[i]).tolist()
            clients.append("    " + json.dumps(client, separators=(", ", ": ")))
        text = json.dumps(head, indent=2)[:-2] + ',\n  "clients": [\n' + ",\n".join(clients) + "\n  ]\n}\n"
        replace_atomic(Path(path), text)
        return Path(path)

    @classmethod
    def load(cls, path: str | Path, setting: str = "partition.path") -> SavedPartition:
        """Read and check a file's structure (indices are checked against the data by ``client_parts``)."""
        from fedhet.paths import check_input_file

        path = check_input_file(path, setting, max_bytes=MAX_BYTES, noun="partition file")
        try:
            obj = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise DataError(f"{path}: not a partition file fedhet can read ({type(exc).__name__}: {exc})") from None
        if not isinstance(obj, dict) or obj.get("format") != FORMAT:
            raise DataError(
                f'{path}: not a fedhet partition file (no "format": "{FORMAT}"; write one with fedhet partition --save)'
            )
        if obj.get("version") != VERSION:
            raise DataError(f"{path}: partition file version {obj.get('version')!r}; this fedhet reads {VERSION}")
        dataset, clients = obj.get("dataset"), obj.get("clients")
        if not isinstance(dataset, dict) or not isinstance(clients, list) or not clients:
            raise DataError(f'{path}: a partition file needs a "dataset" object and a non-empty "clients" list')
        train = [index_array(path, i, c, "train") for i, c in enumerate(clients)]
        has_test = [isinstance(c, dict) and "test" in c for c in clients]
        if any(has_test) and not all(has_test):
            raise DataError(f'{path}: client {has_test.index(False)} has no "test" list and others do; all or none')
        test = [index_array(path, i, c, "test") for i, c in enumerate(clients)] if all(has_test) else None
        made_by = obj.get("made_by") if isinstance(obj.get("made_by"), dict) else {}
        return cls(train, test, dataset, made_by, path)

    def check_dataset(self, current: dict) -> None:
        """The data a run is about to split are those the file was made from; else one line saying what differs."""
        for key, what in COMPARED.items():
            saved, now = self.dataset.get(key), current.get(key)
            if saved != now:
                raise DataError(
                    f"{self.where}: made from {what} {saved!r}, and this run has {now!r}; its indices would name "
                    "other samples (save the partition again from this run's config)"
                )

    def client_parts(self, labels: np.ndarray, num_clients: int, allow_overlap: bool) -> list[np.ndarray]:
        """The training index sets, checked against the labels being split: the same labels (count and order), the
        configured number of clients, indices in range, and no sample in two clients unless ``allow_overlap``."""
        n, saved_n = len(labels), self.dataset.get("samples")
        if saved_n != n or self.dataset.get("labels_sha256") != labels_hash(labels):
            raise DataError(
                f"{self.where}: made from {saved_n} samples of dataset {self.dataset.get('name')!r} with other labels "
                f"than the {n} this run splits; its indices would name other samples (save the partition again from "
                "this run's config)"
            )
        if num_clients != self.num_clients:
            raise DataError(
                f"{self.where}: holds {self.num_clients} clients, and partition.num_clients is {num_clients}; set "
                f"partition.num_clients={self.num_clients}"
            )
        check_indices(self.where, self.train, n, "train", allow_overlap)
        return [np.sort(part) for part in self.train]

    def test_parts(self, test_samples: int, allow_overlap: bool) -> list[np.ndarray] | None:
        """The clients' local test sets in the official test set (None when the file has none), checked."""
        if self.test is None:
            return None
        check_indices(self.where, self.test, test_samples, "test", allow_overlap)
        return [np.sort(part) for part in self.test]

    @property
    def where(self) -> str:
        return f"partition file {self.path}" if self.path is not None else "saved partition"


def index_array(path: Path, i: int, client, key: str) -> np.ndarray:
    values = client.get(key) if isinstance(client, dict) else None
    if not isinstance(values, list) or not all(type(v) is int for v in values):
        raise DataError(f'{path}: client {i}: "{key}" must be a list of whole-number sample indices')
    return np.asarray(values, np.int64)


def check_indices(where: str, parts: list[np.ndarray], n: int, key: str, allow_overlap: bool) -> None:
    """Every index in [0, n); with ``allow_overlap`` off, no sample held twice (by two clients or one)."""
    for i, part in enumerate(parts):
        bad = part[(part < 0) | (part >= n)]
        if len(bad):
            raise DataError(f"{where}: client {i}'s {key} index {int(bad[0])} is outside 0 to {n - 1}")
    if allow_overlap:
        return
    owners = np.concatenate([np.full(len(p), i) for i, p in enumerate(parts)]) if parts else np.empty(0, int)
    indices = np.concatenate(parts) if parts else np.empty(0, np.int64)
    order = np.argsort(indices, kind="stable")
    twice = np.flatnonzero(np.diff(indices[order]) == 0)
    if len(twice):
        first, second = order[twice[0]], order[twice[0] + 1]
        raise DataError(
            f"{where}: {key} sample {int(indices[first])} is in client {int(owners[first])} and client "
            f"{int(owners[second])}; set partition.allow_overlap=true if clients may share samples"
        )

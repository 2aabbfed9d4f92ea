"""CIFAR-10 and CIFAR-100 (python pickle batches)."""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Literal

import numpy as np

from fedhet.data.datasets.base import DATASETS, DownloadParams, image_dataset
from fedhet.data.datasets.files import Entry, Manifest, Source, find_dir, read_file
from fedhet.data.types import ArrayDataset, DataError
from fedhet.registry import parse_params

CIFAR10 = Source(
    "cifar10",
    ("cifar10", "cifar10/cifar-10-batches-py", "cifar-10-batches-py"),
    "Download and extract https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
    ("https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",),
)
CIFAR100 = Source(
    "cifar100",
    ("cifar100", "cifar100/cifar-100-python", "cifar-100-python"),
    "Download and extract https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
    ("https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",),
)
CIFAR10_BATCHES = [f"data_batch_{i}" for i in range(1, 6)]


class Cifar100Params(DownloadParams):
    label_mode: Literal["fine", "coarse"] = "fine"


class ArrayUnpickler(pickle.Unpickler):
    """Unpickles plain containers and numpy arrays only, so a tampered batch file cannot run code."""

    NUMPY_NAMES = {"_reconstruct", "ndarray", "dtype", "scalar", "_frombuffer"}

    def find_class(self, module: str, name: str):
        numpy_ok = module.split(".")[0] == "numpy" and name in self.NUMPY_NAMES
        # Python 3 writes protocol-2 bytes as _codecs.encode(str, "latin1").
        if numpy_ok or (module, name) == ("_codecs", "encode"):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a CIFAR batch")


def read_batch(path: Path, manifest: Manifest | None = None) -> dict:
    data = read_file(path, manifest)
    try:
        batch = ArrayUnpickler(io.BytesIO(data), encoding="bytes").load()
    except Exception as exc:  # noqa: BLE001 - broken pickle bytes can raise almost anything; all mean "corrupt"
        raise DataError(f"{path}: not a CIFAR python batch ({type(exc).__name__}: {exc})") from None
    if not isinstance(batch, dict):
        raise DataError(f"{path}: not a CIFAR python batch (a {type(batch).__name__}, not a dict)")
    return {k.decode() if isinstance(k, bytes) else k: v for k, v in batch.items()}


CIFAR_ROW = 3 * 32 * 32


def cifar_arrays(
    paths: list[Path], label_key: str, manifest: Manifest, like: str = ""
) -> tuple[np.ndarray, np.ndarray]:
    """Images and labels of CIFAR batches; ``like`` names the batches these must match (for the error)."""
    xs, ys = [], []
    for path in paths:
        batch = read_batch(path, manifest)
        if "data" not in batch or label_key not in batch:
            raise DataError(f"{path}: CIFAR batch without 'data' or {label_key!r}")
        data, labels = batch["data"], batch[label_key]
        if not isinstance(data, np.ndarray) or data.dtype != np.uint8:
            kind = data.dtype if isinstance(data, np.ndarray) else type(data).__name__
            raise DataError(f"{path}: not a CIFAR python batch ('data' must be a uint8 array, not {kind})")
        try:
            labels = np.asarray(labels, np.int64)
        except (TypeError, ValueError, OverflowError) as exc:
            raise DataError(f"{path}: not a CIFAR python batch ({label_key!r} are not integers: {exc})") from None
        if data.ndim != 2 or data.shape[1] != CIFAR_ROW:
            raise DataError(
                f"{path}: rows of {data.shape[1] if data.ndim == 2 else data.shape} values, but CIFAR images are rows "
                f"of {CIFAR_ROW} (3x32x32) values{f', as in {like}' if like else ''}"
            )
        if labels.ndim != 1 or len(data) != len(labels):
            raise DataError(f"{path}: {len(data)} images but {labels.shape} {label_key}")
        xs.append(data.reshape(-1, 3, 32, 32))  # rows are R, G, B planes of 32x32, row-major
        ys.append(labels)
    return np.concatenate(xs), np.concatenate(ys)


def class_names_from(path: Path, key: str, manifest: Manifest) -> list[str] | None:
    if not os.path.lexists(path):  # optional; but one that is there must be readable
        return None
    names = read_batch(path, manifest).get(key)
    return [n.decode() if isinstance(n, bytes) else str(n) for n in names] if names else None


def load_cifar(source, data_dir, download, files, label_key, num_classes, meta) -> ArrayDataset:
    d, _ = find_dir(source, data_dir, [Entry(f, (f,)) for f in files], download)
    train_paths = [d / f for f in files[:-1]]  # the last file is the test batch
    manifest = Manifest(d)
    train = cifar_arrays(train_paths, label_key, manifest)
    test = cifar_arrays([d / files[-1]], label_key, manifest, like=f"the training batch {train_paths[0]}")
    names = class_names_from(d / meta[0], meta[1], manifest)
    return image_dataset(source.name, train, test, num_classes, names, source=d, manifest=manifest)


@DATASETS.register("cifar10", "CIFAR-10: 50k/10k 32x32 colour images, 10 classes", DownloadParams)
def load_cifar10(data_dir: str | Path | None = None, **params) -> ArrayDataset:
    p = parse_params("dataset", "cifar10", DownloadParams, params)
    meta = ("batches.meta", "label_names")
    return load_cifar(CIFAR10, data_dir, p.download, [*CIFAR10_BATCHES, "test_batch"], "labels", 10, meta)


@DATASETS.register("cifar100", "CIFAR-100: 50k/10k 32x32 colour images, 100 (or 20 coarse) classes", Cifar100Params)
def load_cifar100(data_dir: str | Path | None = None, **params) -> ArrayDataset:
    p = parse_params("dataset", "cifar100", Cifar100Params, params)
    key, classes = f"{p.label_mode}_labels", 100 if p.label_mode == "fine" else 20
    meta = ("meta", f"{p.label_mode}_label_names")
    return load_cifar(CIFAR100, data_dir, p.download, ["train", "test"], key, classes, meta)

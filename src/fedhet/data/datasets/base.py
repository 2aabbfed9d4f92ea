"""What every format module shares: the dataset registry, the parameters that take none or only ``download``,
the class names of digits, and building an image :class:`ArrayDataset` from integer arrays."""

from __future__ import annotations

import numpy as np

from fedhet.data.types import ArrayDataset, DataError
from fedhet.params import Params
from fedhet.registry import Registry

DATASETS = Registry("dataset", section="dataset")

DIGITS = [str(d) for d in range(10)]


# ----------------------------------------------------------------------------------------------------------
# Parameters


class NoParams(Params):
    """Parameters of a component that takes none (and the base of those that do)."""


class DownloadParams(NoParams):
    download: bool = False


# ----------------------------------------------------------------------------------------------------------
# Image helpers


def to_float(x_u8: np.ndarray, scale: float) -> np.ndarray:
    """A contiguous float32 copy of ``x_u8 / scale`` (any layout in, C order out)."""
    out = np.empty(x_u8.shape, np.float32)
    return np.divide(x_u8, np.float32(scale), out=out)


def channel_stats(x: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std of a float NCHW array, summed in float64 without a full-size temporary."""
    means, stds = [], []
    count = x.shape[0] * x.shape[2] * x.shape[3]
    for c in range(x.shape[1]):
        ch = x[:, c]
        mean = float(np.einsum("nhw->", ch, dtype=np.float64)) / count
        sq = float(np.einsum("nhw,nhw->", ch, ch, dtype=np.float64)) / count
        means.append(mean)
        stds.append(max(sq - mean * mean, 0.0) ** 0.5)
    return tuple(means), tuple(stds)


def image_dataset(
    name, train, test, num_classes, class_names=None, scale=255.0, source=None, files=("", ""), manifest=None
) -> ArrayDataset:
    """Build an image ArrayDataset from integer NCHW arrays ``train=(x, y)``, ``test=(x, y)``.

    ``files`` says where the training and the test images were read from, for the error when their shapes differ.
    The provenance comes from ``manifest`` (the files read), else ``source`` describes the data and the arrays are
    hashed."""
    if len(test[0]) and test[0].shape[1:] != train[0].shape[1:]:
        raise DataError(
            f"dataset {name!r}: the test images have shape {test[0].shape[1:]} (channels, height, width) in "
            f"{files[1] or source} but the training images have shape {train[0].shape[1:]} in {files[0] or source}"
        )
    x_train, x_test = to_float(train[0], scale), to_float(test[0], scale)
    y_train, y_test = np.asarray(train[1], np.int64), np.asarray(test[1], np.int64)
    for y in (y_train, y_test):
        if len(y) and (y.min() < 0 or y.max() >= num_classes):
            raise DataError(f"dataset {name!r}: labels outside [0, {num_classes}) in {source}")
    if len(y_train) == 0:
        raise DataError(f"dataset {name!r}: no training samples in {source}")
    mean, std = channel_stats(x_train)
    return ArrayDataset(
        name=name,
        x_train=x_train,
        y_train=y_train,
        x_test=x_test,
        y_test=y_test,
        num_classes=num_classes,
        input_shape=tuple(x_train.shape[1:]),
        task="image",
        mean=mean,
        std=std,
        class_names=class_names,
        **(manifest.fields() if manifest else {"source_dir": str(source) if source else None}),
    )

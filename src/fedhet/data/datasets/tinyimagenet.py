"""Tiny-ImageNet (JPEG folders)."""

from __future__ import annotations

import io
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from fedhet.data.datasets.base import DATASETS, NoParams, image_dataset
from fedhet.data.datasets.files import Entry, Manifest, Source, find_dir, os_problem, read_file, read_text
from fedhet.data.types import ArrayDataset, DataError
from fedhet.registry import parse_params

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

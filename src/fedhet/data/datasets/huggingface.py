"""Hugging Face ``datasets`` as a source (``dataset.name = "hf"``; the ``hf`` extra): a hub id or a local copy.

``dataset.path`` is a local copy (a ``save_to_disk`` folder; a parquet, arrow, csv or json file; a folder of such
files, whose names give the splits, ``train-*.parquet``, ``test.csv``; an image folder, ``class/x.png`` or
``train/class/x.png``) when it exists on disk, else a hub id (``user/name``), downloaded and cached by ``datasets``.
Where: an explicit ``dataset.data_dir`` (or ``$FEDHET_DATA``) holds the downloads in ``huggingface/`` and the prepared
tensors in ``huggingface/fedhet-prepared/``; without one, Hugging Face's own cache (``HF_HOME``,
``HF_DATASETS_CACHE``) holds both. Nothing is written into a local copy's folder.

Columns are found by name (``label_column``, ``image_column``, ``text_column``, ``feature_columns``, ``id_column``),
else by type where that is unambiguous (the one ``ClassLabel``, else the one column called label, labels, target, class
or y; the one ``Image`` column; the one string column); otherwise one error lists the columns. Images keep their
channels (grey, grey+alpha, colour, colour+alpha; mixed modes become colour if any image is, with alpha only if every
image has it, so RGBA among RGB or L images loses its alpha) and may be resized to a fixed size (the mode, size and
how many images were converted or resized are recorded in the provenance and said when a run starts); text becomes
token ids over a vocabulary of the training split (characters or words; 0 = padding, 1 = unknown), left-padded or cut
to ``seq_len`` so that the last step, which the LSTM reads, is the text's last token; tabular data are the numeric
columns, standardised with the training split's mean and std. The dataset's own test split is used where it has one,
else a seeded ``test_fraction`` of the training split (recorded in the provenance). The prepared arrays are cached
under a key of the splits' fingerprints, a local copy's file hashes and every preprocessing setting, so a second run
reads one file (``prepared.py``: checked on every read, prepared again when damaged; ``fedhet cache list | clean``).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import io
import json
import os
import re
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import Field, model_validator

from fedhet.data.datasets import prepared
from fedhet.data.datasets.base import DATASETS, NoParams, channel_stats
from fedhet.data.datasets.files import Manifest, explicit_location, os_problem, read_file
from fedhet.data.types import ArrayDataset, DataError
from fedhet.hub import hub_endpoint, hub_problem, hub_reachable, looks_like_hub_id
from fedhet.params import Seed
from fedhet.registry import parse_params

NAME = "hf"
INSTALL = "pip install 'fedhet[hf]'"
LABEL_NAMES = ("label", "labels", "target", "class", "y")
PAD, UNKNOWN = 0, 1
# LEAF's split_line: words with apostrophes, and . , ! ? ; as words of their own
WORDS = re.compile(r"[\w']+|[.,!?;]")
BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv", ".json": "json", ".jsonl": "json"}
GREY, GREY_ALPHA = {"1", "L", "I", "I;16", "I;16B", "I;16L", "F"}, {"LA", "La"}
ALPHA = {"LA", "La", "RGBA", "RGBa", "PA"}
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".gif", ".bmp", ".tif", ".tiff", ".webp", ".ppm", ".pgm"}
IMAGE_KINDS = ("Image", "string", "binary", "large_binary")  # an Image feature, or a column of paths or bytes
# the bytes a prepared image costs in memory per pixel and channel: the uint8 arrays and their float32 copy
BYTES_PER_VALUE = 1 + 4


class HFParams(NoParams):
    # a local copy (save_to_disk folder; parquet/arrow/csv/json file or folder of them; image folder) when it
    # exists on disk, else a hub id such as "ylecun/mnist"; a relative path is read from the working folder
    path: str = Field(min_length=1)
    subset: str | None = None  # the hub dataset's configuration (datasets' name=)
    revision: str | None = None  # the hub dataset's branch, tag or commit
    train_split: str = "train"  # the split the clients train on (the dataset's own name for it)
    # "auto": the split called "test" where there is one, else test_fraction of the training split; a split's
    # name; none: always test_fraction of the training split
    test_split: str | None = "auto"
    test_fraction: float = Field(0.2, gt=0.0, lt=1.0)  # held out of the training split when there is no test split
    split_seed: Seed = 0  # which samples that fraction is
    task: Literal["auto", "image", "text", "tabular"] = "auto"  # auto: from the columns' types (image, text, numbers)
    # default: the one ClassLabel column, else the one named label, labels, target, class or y
    label_column: str | None = None
    image_column: str | None = None  # default: the one Image column
    text_column: str | None = None  # default: the one string column other than the label and id columns
    feature_columns: list[str] | None = None  # tabular: default every numeric column but the label and id columns
    # a natural id per sample (writer, user, hospital, domain): partition.name = "natural" gives a client per id
    id_column: str | None = None
    # a domain per sample (hospital, scanner, camera, writer; may be id_column too): features.name = "natural"
    # scores the global test set per domain (test_acc/domain/<value>)
    domain_column: str | None = None
    # resize every image to this (an int: a square; [height, width]); None keeps the size, which must then be one
    image_size: int | tuple[int, int] | None = None
    # channels: "auto" keeps them (grey stays 1 channel, colour 3, with alpha 2 or 4); mixed modes: colour if any image
    # is colour, alpha only if every image has it (RGBA with RGB or L becomes RGB: the alpha channel is dropped)
    image_mode: Literal["auto", "L", "LA", "RGB", "RGBA"] = "auto"
    # text: a token is a character, a word (LEAF's split), or a byte-pair piece ("bpe": a vocabulary of vocab_size
    # learnt from the training split with Hugging Face tokenizers, no download)
    tokens: Literal["char", "word", "bpe"] = "char"
    seq_len: int = Field(80, ge=1)  # text: tokens per sample (the first seq_len; shorter ones left-padded with 0)
    # text: ids 0 (padding), 1 (unknown) and the vocab_size - 2 most frequent tokens of the training split; the LSTM's
    # model.vocab_size must be at least this (80: its default)
    vocab_size: int = Field(80, ge=3)
    # text: a pretrained model's own tokenizer instead (a folder with tokenizer.json or vocab files, or a hub id in
    # the Hugging Face cache; with model.pretrained and no tokenizer given, the model's when its folder has one): its
    # ids and special tokens, padded with its padding id on its side (a model without one: its end-of-text id, left)
    tokenizer: str | None = Field(None, min_length=1)
    lowercase: bool = False  # text: lower-case before tokenising
    standardize: bool = True  # tabular: subtract the training split's mean, divide by its std, per column

    @model_validator(mode="after")
    def _sizes(self) -> HFParams:
        size = self.image_size
        if size is not None and min((size,) if isinstance(size, int) else size) < 1:
            raise ValueError("image_size: must be at least 1 pixel")
        return self


# ----------------------------------------------------------------------------------------------------------
# Where things are


def hf_modules():
    try:
        import datasets
    except ImportError:
        raise DataError(f"dataset 'hf' needs Hugging Face datasets: {INSTALL}") from None
    datasets.disable_progress_bars()
    # its errors too: each one is re-raised here and said once, in fedhet's line (``hub_problem`` gives the cause)
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    return datasets


def cache_root(data_dir) -> Path | None:
    """Hugging Face's cache folder for this run: ``<data_dir or $FEDHET_DATA>/huggingface``, else None (its own)."""
    location = explicit_location(data_dir)
    return None if location is None else location.root / "huggingface"


def prepared_dir(data_dir) -> Path:
    root = cache_root(data_dir)
    if root is None:
        root = Path(hf_modules().config.HF_DATASETS_CACHE)
    return root / "fedhet-prepared"


@contextlib.contextmanager
def offline_mode(on: bool):
    """datasets and huggingface_hub in offline mode (cached copies only) while ``on``."""
    datasets = hf_modules()
    from huggingface_hub import constants

    saved = datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE
    if on:
        datasets.config.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE = saved


def is_local_copy(path: Path) -> bool:
    return os.path.lexists(path)


# ----------------------------------------------------------------------------------------------------------
# Opening the dataset


def open_local(path: Path, cache_dir: Path | None):
    """A DatasetDict from a local copy; ``datasets`` reads it (and writes its cache under ``cache_dir``)."""
    datasets = hf_modules()
    kwargs = {"cache_dir": str(cache_dir)} if cache_dir else {}
    if path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file()):
        loaded = datasets.load_from_disk(str(path))
    elif path.is_file():
        builder = BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise DataError(
                f"dataset 'hf': {path} is a {path.suffix or 'suffix-less'} file; a local copy is a save_to_disk "
                f"folder, a {', '.join(sorted(set(BUILDERS)))} file, or a folder of them (or of images)"
            )
        loaded = datasets.load_dataset(builder, data_files=str(path), **kwargs)
    elif path.is_dir():
        loaded = datasets.load_dataset(str(path), **kwargs)
    else:
        raise DataError(f"dataset 'hf': {path} {os_problem(FileNotFoundError())}")
    return loaded if isinstance(loaded, datasets.DatasetDict) else datasets.DatasetDict({"train": loaded})


def open_hub(p: HFParams, cache_dir: Path | None):
    """A DatasetDict of the hub dataset ``p.path`` (the cached copy when the hub cannot be reached)."""
    datasets = hf_modules()
    offline = bool(datasets.config.HF_HUB_OFFLINE)
    unreachable = not offline and not hub_reachable()
    where = str(cache_dir or datasets.config.HF_DATASETS_CACHE)
    kwargs = {"cache_dir": str(cache_dir)} if cache_dir else {}
    try:
        with offline_mode(unreachable):
            loaded = datasets.load_dataset(p.path, p.subset, revision=p.revision, **kwargs)
    except Exception as exc:  # datasets' errors have no common base: every one becomes one line
        if offline or unreachable:
            why = "HF_HUB_OFFLINE is set" if offline else f"{hub_endpoint()} cannot be reached from here"
            raise DataError(
                f"dataset 'hf': {p.path!r} is not a local file or folder, and no cached copy of it is in {where} "
                f"({why}); download it where there is a network (the same data_dir, or HF_HOME), or point "
                "dataset.path at a local copy"
            ) from None
        raise DataError(f"dataset 'hf': cannot load {p.path!r} from the Hugging Face Hub: {hub_problem(exc)}") from None
    return loaded if isinstance(loaded, datasets.DatasetDict) else datasets.DatasetDict({"train": loaded})


def open_dataset(p: HFParams, data_dir) -> tuple[Any, Path | None]:
    """The DatasetDict and the local copy's path (None for a hub dataset)."""
    path = Path(p.path).expanduser()
    cache_dir = cache_root(data_dir)
    if is_local_copy(path):
        try:
            return open_local(path, cache_dir), path
        except DataError:
            raise
        except Exception as exc:
            if "corresponds to no data" in str(exc):  # datasets' words for a file with a header and no rows
                raise DataError(f"dataset 'hf': the local copy {path} has no rows") from None
            empty = saved_without_rows(path)
            if empty is not None:  # load_from_disk fails on it with an IndexError
                raise DataError(f"dataset 'hf': the local copy {path} has no rows in {empty}") from None
            raise DataError(f"dataset 'hf': cannot read the local copy {path}: {hub_problem(exc)}") from None
    if not looks_like_hub_id(p.path):
        raise DataError(
            f"dataset 'hf': {path} does not exist, and {p.path!r} is not a hub id (user/name); point dataset.path "
            "at a local copy or a hub dataset"
        )
    return open_hub(p, cache_dir), None


def saved_without_rows(path: Path) -> str | None:
    """The split (``split 'train'``, or ``its one split``) of a ``save_to_disk`` folder that was saved with no
    rows, else None."""
    states = {f"split {p.parent.name!r}": p for p in sorted(path.glob("*/state.json"))} if path.is_dir() else {}
    if path.is_dir() and (path / "state.json").is_file():
        states = {"its one split": path / "state.json"}
    for name, state in states.items():
        with contextlib.suppress(OSError, ValueError, AttributeError):
            if json.loads(state.read_text()).get("_data_files") == []:
                return name
    return None


def local_manifest(path: Path) -> Manifest:
    """Every file of the local copy, hashed (the provenance, and part of the cache key)."""
    root = path if path.is_dir() else path.parent
    manifest = Manifest(root)
    files = [path] if path.is_file() else sorted(f for f in path.rglob("*") if f.is_file())
    for f in files:
        if not any(part.startswith(".") for part in f.relative_to(root).parts):
            manifest.record(f, read_file(f) if f.stat().st_size else b"")
    return manifest


def unlabelled_folder(path: Path, features, p: HFParams) -> None:
    """One line when an image folder gave no labels: datasets labels its images by their folders only when there
    are two or more, all at one depth."""
    if p.label_column is not None or not any(kind(f) == "Image" for f in features.values()):
        return
    if any(kind(f) == "ClassLabel" or n.lower() in LABEL_NAMES for n, f in features.items()):
        return
    found = [f.relative_to(path) for f in path.rglob("*") if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES]
    found = [f for f in found if not any(part.startswith(".") for part in f.parts)]
    folders = sorted({f.parent.name for f in found if len(f.parts) > 1})
    if len({len(f.parts) for f in found}) > 1:
        why = "its images lie at different depths (some in class folders, some not)"
    elif len(folders) == 1:
        why = f"its images are all in one folder, {folders[0]!r}"
    elif not folders:
        why = "its images are in no class folders"
    else:
        return
    raise DataError(
        f"dataset 'hf': the image folder {path} gives no labels: {why}; a classifier needs a folder per class, two or "
        "more, all at one depth (class/img.png, or train/class/img.png and test/class/img.png)"
    )


def splits(dd, p: HFParams) -> tuple[Any, Any, str]:
    """The training and test splits (test None: a fraction is held out) and how the test split was chosen."""
    names = list(dd)
    if p.train_split not in dd:
        raise DataError(
            f"dataset 'hf': no split {p.train_split!r} (dataset.train_split); its splits: {', '.join(names)}"
        )
    test = p.test_split
    if test == "auto":
        test = "test" if "test" in dd and p.train_split != "test" else None
    elif test is not None and test not in dd:
        raise DataError(f"dataset 'hf': no split {test!r} (dataset.test_split); its splits: {', '.join(names)}")
    if not len(dd[p.train_split]):
        raise DataError(f"dataset 'hf': the training split {p.train_split!r} has no rows")
    if test is None:
        how = f"test_fraction {p.test_fraction} of split {p.train_split!r}, split_seed {p.split_seed}"
        return dd[p.train_split], None, how
    if not len(dd[test]):
        raise DataError(
            f"dataset 'hf': the test split {test!r} has no rows; set dataset.test_split=none to hold out "
            "dataset.test_fraction of the training split instead"
        )
    return dd[p.train_split], dd[test], f"split {test!r}"


# ----------------------------------------------------------------------------------------------------------
# Columns


def kind(feature) -> str:
    """A column's type in words: ClassLabel, Image, string, int, float, bool, list, or the feature's class name."""
    name = type(feature).__name__
    if name == "Value":
        dtype = feature.dtype
        if dtype in ("string", "large_string"):
            return "string"
        if dtype == "bool":
            return "bool"
        return "int" if "int" in dtype else "float" if "float" in dtype or dtype.startswith("double") else dtype
    if name in ("List", "Sequence", "LargeList", "Array2D", "Array3D"):
        return "list"
    return name


def listing(features) -> str:
    return ", ".join(f"{name} ({kind(f)})" for name, f in features.items())


def need_column(features, key: str, name: str | None) -> str | None:
    if name is not None and name not in features:
        raise DataError(f"dataset 'hf': no column {name!r} (dataset.{key}); its columns: {listing(features)}")
    return name


def only(features, key: str, what: str, candidates: list[str]) -> str:
    if len(candidates) == 1:
        return candidates[0]
    found = f"{len(candidates)} {what} columns ({', '.join(candidates)})" if candidates else f"no {what} column"
    raise DataError(
        f"dataset 'hf': cannot tell which column to use, {found}; set dataset.{key} to one of the columns: "
        f"{listing(features)}"
    )


def label_column(features, p: HFParams) -> str:
    if p.label_column is not None:
        return need_column(features, "label_column", p.label_column)
    classes = [n for n, f in features.items() if kind(f) == "ClassLabel"]
    if classes:
        return only(features, "label_column", "ClassLabel", classes)
    named = [n for n in features if n.lower() in LABEL_NAMES]
    return only(features, "label_column", "label", named)


def columns(features, p: HFParams) -> dict[str, Any]:
    """``{"label", "id", "task", "input"}``: the columns used and the task (input: a column or a list of them)."""
    label = label_column(features, p)
    ident = need_column(features, "id_column", p.id_column)
    domain = need_column(features, "domain_column", p.domain_column)
    for key, name in (("id_column", ident), ("domain_column", domain)):
        if name == label:
            raise DataError(f"dataset 'hf': {key} and label_column are both {label!r}")
    rest = {n: f for n, f in features.items() if n not in (label, ident, domain)}
    task = p.task
    if task == "auto":
        task = guess_task(features, rest, p)
    if task == "image":
        column = need_column(features, "image_column", p.image_column)
        column = column or only(features, "image_column", "Image", [n for n, f in rest.items() if kind(f) == "Image"])
        if kind(features[column]) not in IMAGE_KINDS:
            images = [n for n, f in features.items() if kind(f) == "Image"]
            raise DataError(
                f"dataset 'hf': column {column!r} (dataset.image_column) holds {kind(features[column])} values, not "
                f"images (an Image column, or file paths or bytes); its Image columns: {', '.join(images) or 'none'}"
            )
        return {"label": label, "id": ident, "domain": domain, "task": task, "input": column}
    if task == "text":
        column = need_column(features, "text_column", p.text_column)
        column = column or only(features, "text_column", "string", [n for n, f in rest.items() if kind(f) == "string"])
        return {"label": label, "id": ident, "domain": domain, "task": task, "input": column}
    if p.feature_columns is not None:
        for name in p.feature_columns:
            need_column(features, "feature_columns", name)
        cols = list(p.feature_columns)
    else:
        cols = [n for n, f in rest.items() if kind(f) in ("int", "float", "bool", "list")]
    if not cols:
        raise DataError(f"dataset 'hf': no numeric column to use as features; its columns: {listing(features)}")
    return {"label": label, "id": ident, "domain": domain, "task": "tabular", "input": cols}


def guess_task(features, rest: dict, p: HFParams) -> str:
    if p.image_column or any(kind(f) == "Image" for f in rest.values()):
        return "image"
    strings = p.text_column or any(kind(f) == "string" for f in rest.values())
    return "text" if strings and p.feature_columns is None else "tabular"


# ----------------------------------------------------------------------------------------------------------
# Labels and natural ids


def encode_labels(train, test, column: str) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Labels as 0..K-1 and the class names: a ClassLabel's own, else the sorted distinct values of both splits."""
    feature = train.features[column]
    if kind(feature) == "list":
        raise DataError(
            f"dataset 'hf': label column {column!r} holds lists (several labels per sample); a label is one class "
            "per sample: set dataset.label_column to a column of single classes"
        )
    y_train, y_test = values(train, column), values(test, column)
    if kind(feature) == "ClassLabel":
        names = list(feature.names)
        for y in (y_train, y_test):
            bad = y[(y < 0) | (y >= len(names))] if len(y) else y
            if len(bad):
                raise DataError(
                    f"dataset 'hf': label column {column!r} holds {bad[0]}, not a class 0 to {len(names) - 1}"
                )
        return y_train.astype(np.int64), y_test.astype(np.int64), one_class_check(column, names)
    both = np.concatenate([y_train, y_test]) if len(y_test) else y_train
    if both.dtype.kind == "f" and not np.all(np.round(both) == both):
        raise DataError(f"dataset 'hf': label column {column!r} holds fractions; labels must be classes")
    if both.dtype.kind not in "iufUSOb":
        raise DataError(f"dataset 'hf': label column {column!r} holds {both.dtype} values; labels must be classes")
    classes, ids = np.unique(both, return_inverse=True)
    names = [str(c.item() if hasattr(c, "item") else c) for c in classes]
    names = one_class_check(column, names)
    return ids[: len(y_train)].astype(np.int64), ids[len(y_train) :].astype(np.int64), names


def missing_labels(column: str, labels: np.ndarray, split: str) -> None:
    """One line naming the first missing label (None, NaN: an empty cell of a CSV file) and how many there are."""
    if labels.dtype.kind == "f":
        missing = np.isnan(labels)
    elif labels.dtype.kind == "O":
        missing = np.array([v is None or (isinstance(v, float) and v != v) for v in labels], bool)
    else:
        return
    if missing.any():
        raise DataError(
            f"dataset 'hf': label column {column!r} has {int(missing.sum())} missing label(s) in the {split} split "
            f"(empty or NaN; the first in row {int(np.argmax(missing))}, counting from 0); fill them in or drop those "
            "rows first"
        )


def one_class_check(column: str, names: list[str]) -> list[str]:
    if len(names) < 2:
        raise DataError(
            f"dataset 'hf': label column {column!r} holds {len(names)} class(es) ({', '.join(names) or 'none'}); a "
            "classifier needs at least two"
        )
    return names


def values(ds, column: str) -> np.ndarray:
    if ds is None:
        return np.empty(0, np.int64)
    return np.asarray(ds.with_format("numpy")[column])


def encode_ids(train, test, column: str | None) -> tuple[np.ndarray | None, np.ndarray | None, list[str]]:
    """Each sample's natural id as 0..G-1 over both splits (sorted, as LEAF numbers its users), and the ids."""
    if column is None:
        return None, None, []
    a, b = values(train, column), values(test, column)
    both = np.concatenate([a.astype(str), b.astype(str)]) if len(b) else a.astype(str)
    names, ids = np.unique(both, return_inverse=True)
    return ids[: len(a)].astype(np.int64), (ids[len(a) :].astype(np.int64) if test is not None else None), list(names)


# ----------------------------------------------------------------------------------------------------------
# Inputs


def target_mode(modes: set[str], wanted: str) -> str:
    """``wanted``, or with "auto": colour (RGB) when any image is colour, else grey (L), with alpha (RGBA, LA)
    only when every image has alpha; images without alpha are not given an opaque one, and converting one with
    alpha to a mode without drops the alpha channel (transparent pixels keep their colour)."""
    if wanted != "auto":
        return wanted
    colour = any(m not in GREY | GREY_ALPHA for m in modes)
    alpha = bool(modes) and all(m in ALPHA for m in modes)
    return ("RGBA" if alpha else "RGB") if colour else ("LA" if alpha else "L")


def open_image(item, where: str):
    from PIL import Image

    if isinstance(item, Image.Image):
        return item
    source = item
    if isinstance(item, dict):  # an undecoded Image feature: its bytes, or its file
        source = io.BytesIO(item["bytes"]) if item.get("bytes") else item.get("path")
    try:
        return Image.open(source)
    except (OSError, ValueError, SyntaxError) as exc:
        raise DataError(f"dataset 'hf': {where}: unreadable image ({exc})") from None


def raw_images(ds, column: str) -> list:
    """The column's images undecoded (bytes or paths), so their modes can be read before any is decoded."""
    datasets = hf_modules()
    if ds is None:
        return []
    try:
        return ds.cast_column(column, datasets.Image(decode=False))[column]
    except Exception as exc:  # Arrow's cast errors have no common base
        raise DataError(
            f"dataset 'hf': column {column!r} (dataset.image_column) cannot be read as images: {hub_problem(exc)}"
        ) from None


def headers(items: list, split: str, column: str) -> list[tuple[str, tuple[int, int]]]:
    """Each image's mode and (height, width), read from its header (no pixel is decoded)."""
    out = []
    for i, item in enumerate(items):
        img = open_image(item, f"column {column!r} (dataset.image_column), {split} sample {i}")
        out.append((img.mode, (img.size[1], img.size[0])))
        img.close()
    return out


def images(items: list, mode: str, size: tuple[int, int], split: str) -> np.ndarray:
    """uint8 NCHW of the images in ``mode``, resized to ``size`` (height, width) where they differ from it."""
    from PIL import Image

    out = np.empty((len(items), len(mode), *size), np.uint8)
    for i, item in enumerate(items):
        with contextlib.ExitStack() as stack:
            img = open_image(item, f"{split} sample {i}")
            stack.callback(img.close)
            try:
                img = img.convert(mode)
                if img.size != (size[1], size[0]):
                    img = img.resize((size[1], size[0]), Image.Resampling.BILINEAR)
                array = np.asarray(img, np.uint8).reshape(size[0], size[1], len(mode))
            except (OSError, ValueError, SyntaxError) as exc:
                raise DataError(f"dataset 'hf': {split} sample {i}: unreadable image ({exc})") from None
        out[i] = array.transpose(2, 0, 1)
    return out


def one_size(found: list[tuple[str, tuple[int, int]]], n_train: int) -> tuple[int, int]:
    """The images' one size (height, width); one line naming two that differ when they do not share one."""
    size = found[0][1]
    for i, (_, other) in enumerate(found):
        if other != size:
            where = f"training sample {i}" if i < n_train else f"test sample {i - n_train}"
            raise DataError(
                f"dataset 'hf': the images differ in size ({size[0]}x{size[1]} and {other[0]}x{other[1]} at {where}, "
                "height x width); set dataset.image_size to resize them"
            )
    return size


def check_memory(count: int, channels: int, size: tuple[int, int], given: bool) -> None:
    """One line, before any image is decoded, when the arrays of ``count`` images cannot fit in memory."""
    from fedhet.machine import host_memory
    from fedhet.paths import size_text

    need = count * channels * size[0] * size[1] * BYTES_PER_VALUE
    room = host_memory()
    if room is None or need <= room[0]:
        return
    free, where = room
    how = "dataset.image_size" if given else "their own size; dataset.image_size resizes them"
    raise DataError(
        f"dataset 'hf': {count} images of {channels} x {size[0]} x {size[1]} values ({how}) need {size_text(need)} "
        f"in memory (uint8 arrays and their float32 copy), but this machine has {size_text(free)} {where}; set a "
        "smaller dataset.image_size"
    )


def image_arrays(train, test, column: str, p: HFParams) -> tuple[np.ndarray, np.ndarray, dict]:
    items_train, items_test = raw_images(train, column), raw_images(test, column)
    found = headers(items_train, "training", column) + headers(items_test, "test", column)
    modes = collections.Counter(m for m, _ in found)
    mode = target_mode(set(modes), p.image_mode)
    given = (p.image_size, p.image_size) if isinstance(p.image_size, int) else p.image_size
    size = tuple(given) if given is not None else one_size(found, len(items_train))
    check_memory(len(found), len(mode), size, given is not None)
    x_train = images(items_train, mode, size, "training")
    x_test = images(items_test, mode, size, "test")
    what = {
        "mode": mode,
        "size": list(size),
        "count": len(found),
        "source_modes": dict(sorted(modes.items())),
        "converted": sum(n for m, n in modes.items() if m != mode),
        "resized": sum(s != size for _, s in found),
    }
    return x_train, x_test, {"image_mode": mode, "source_modes": sorted(modes), "images": what}


def image_note(what: dict) -> str | None:
    """What was done to the images, in words (None when nothing was): shown when a run starts."""
    mode, (height, width), count = what["mode"], what["size"], what["count"]
    done = []
    if what["converted"]:
        others = ", ".join(f"{n} {m}" for m, n in what["source_modes"].items() if m != mode)
        dropped = any(m in ALPHA for m in what["source_modes"]) and mode not in ALPHA
        done.append(f"{what['converted']} converted to {mode} ({others}{'; alpha dropped' if dropped else ''})")
    if what["resized"]:
        done.append(f"{what['resized']} resized to {height}x{width} (height x width)")
    if not done:
        return None
    return f"dataset 'hf': of its {count} images, {' and '.join(done)}; dataset.image_mode and image_size choose"


def tokenise(text: str, p: HFParams) -> list[str]:
    text = text.lower() if p.lowercase else text
    return list(text) if p.tokens == "char" else WORDS.findall(text)


def texts(ds, column: str) -> list[str]:
    if ds is None:
        return []
    out = ds[column]
    bad = next((i for i, t in enumerate(out) if not isinstance(t, str)), None)
    if bad is not None:
        raise DataError(f"dataset 'hf': text column {column!r} holds {out[bad]!r} at sample {bad}, not a string")
    return out


def text_arrays(train, test, column: str, p: HFParams) -> tuple[np.ndarray, np.ndarray, dict]:
    """Token ids, (N, seq_len) int64: the first seq_len tokens, left-padded with 0; unknown tokens are 1."""
    if p.tokenizer is not None:
        return pretrained_token_arrays(train, test, column, p)
    if p.tokens == "bpe":
        return bpe_arrays(train, test, column, p)
    train_tokens = [tokenise(t, p) for t in texts(train, column)]
    counts = collections.Counter(tok for toks in train_tokens for tok in toks)
    vocab = sorted(counts, key=lambda t: (-counts[t], t))[: p.vocab_size - 2]
    index = {tok: i + 2 for i, tok in enumerate(vocab)}

    def encode(token_lists: list[list[str]]) -> np.ndarray:
        out = np.full((len(token_lists), p.seq_len), PAD, np.int64)
        for row, toks in zip(out, token_lists, strict=True):
            ids = [index.get(t, UNKNOWN) for t in toks[: p.seq_len]]
            if ids:
                row[p.seq_len - len(ids) :] = ids
        return out

    test_tokens = [tokenise(t, p) for t in texts(test, column)]
    return encode(train_tokens), encode(test_tokens), {"vocab": ["<pad>", "<unk>", *vocab]}


def table(ds, cols: list[str]) -> np.ndarray:
    if ds is None:
        return np.empty((0, 0), np.float32)
    parts = []
    numpy_view = ds.with_format("numpy")
    for col in cols:
        try:
            block = np.asarray(numpy_view[col], np.float64)
        except (ValueError, TypeError):
            raise DataError(
                f"dataset 'hf': feature column {col!r} is not numeric (or its lists differ in length)"
            ) from None
        parts.append(block.reshape(len(block), -1))
    x = np.concatenate(parts, axis=1)
    if not np.isfinite(x).all():
        row, c = np.argwhere(~np.isfinite(x))[0]
        raise DataError(f"dataset 'hf': missing or infinite feature value at sample {row} (feature {c}); fill it first")
    return x


def left_padded(rows: list[list[int]], p: HFParams) -> np.ndarray:
    out = np.full((len(rows), p.seq_len), PAD, np.int64)
    for row, ids in zip(out, rows, strict=True):
        ids = ids[: p.seq_len]
        if ids:
            row[p.seq_len - len(ids) :] = ids
    return out


def bpe_arrays(train, test, column: str, p: HFParams) -> tuple[np.ndarray, np.ndarray, dict]:
    """Byte-pair pieces learnt from the training split (Hugging Face ``tokenizers``; ids 0 and 1 are padding and
    unknown, as for characters and words), the first seq_len of each text, left-padded."""
    try:
        from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    except ImportError:
        raise DataError("dataset 'hf': tokens = 'bpe' needs Hugging Face tokenizers: pip install tokenizers") from None
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    if p.lowercase:
        tokenizer.normalizer = normalizers.Lowercase()
    trainer = trainers.BpeTrainer(vocab_size=p.vocab_size, special_tokens=["<pad>", "<unk>"], show_progress=False)
    tokenizer.train_from_iterator(texts(train, column), trainer)

    def encode(ds) -> np.ndarray:
        return left_padded([e.ids for e in tokenizer.encode_batch(texts(ds, column))], p)

    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return encode(train), encode(test), {"vocab": [token for token, _ in vocab]}


TOKENIZER_FILES = [
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt", "vocab.json", "merges.txt",
    "added_tokens.json", "*.model",
]  # fmt: skip


def tokenizer_folder(spec: str) -> Path:
    """The folder of ``dataset.tokenizer``: a local folder, or a hub id's snapshot in the Hugging Face cache."""
    path = Path(spec).expanduser()
    if os.path.lexists(path):
        folder = path if path.is_dir() else path.parent
        if not any((folder / name).is_file() for name in TOKENIZER_FILES if "*" not in name):
            raise DataError(
                f"dataset 'hf': tokenizer {spec!r} has no tokenizer files in {folder} (tokenizer.json, ...)"
            )
        return folder
    if not looks_like_hub_id(spec):
        raise DataError(f"dataset 'hf': tokenizer {spec!r} does not exist, and is not a hub id (user/name)")
    import huggingface_hub
    from huggingface_hub import constants

    try:
        return Path(huggingface_hub.snapshot_download(spec, local_files_only=True, allow_patterns=TOKENIZER_FILES))
    except Exception:
        raise DataError(
            f"dataset 'hf': tokenizer {spec!r} is not a local folder, and no cached copy of it is in "
            f"{constants.HF_HUB_CACHE}; download it where there is a network (hf download {spec}) or give a folder"
        ) from None


def pretrained_token_arrays(train, test, column: str, p: HFParams) -> tuple[np.ndarray, np.ndarray, dict]:
    """Ids from a pretrained tokenizer, with its special tokens ([CLS] ... [SEP]), cut to seq_len and padded with its
    padding id on its padding side; one without a padding token (GPT-2) pads with its end-of-text id, on the left,
    so that the last position, which a causal model predicts from, is the text's."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise DataError(
            "dataset 'hf': dataset.tokenizer needs transformers: pip install 'fedhet[pretrained]'"
        ) from None
    folder = tokenizer_folder(p.tokenizer)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:  # transformers' errors have no common base
        raise DataError(f"dataset 'hf': tokenizer {p.tokenizer!r} cannot be read: {hub_problem(exc)}") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token, tokenizer.padding_side = tokenizer.eos_token, "left"

    def encode(ds) -> np.ndarray:
        found = texts(ds, column)
        if not len(found):
            return np.empty((0, p.seq_len), np.int64)
        out = tokenizer(list(found), truncation=True, max_length=p.seq_len, padding="max_length")
        return np.asarray(out["input_ids"], np.int64)

    extra = {"tokenizer": p.tokenizer, "vocab_size": len(tokenizer), "pad_id": tokenizer.pad_token_id}
    return encode(train), encode(test), {**extra, "padding_side": tokenizer.padding_side}


def tokenizer_digest(spec: str | None) -> str:
    """The SHA-256 of a tokenizer's files (part of the prepared arrays' cache key); "" without one."""
    if spec is None:
        return ""
    folder = tokenizer_folder(spec)
    digest = hashlib.sha256()
    for path in sorted(f for f in folder.iterdir() if f.is_file() and f.suffix != ".safetensors"):
        digest.update(path.name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def tabular_arrays(train, test, cols: list[str], p: HFParams) -> tuple[np.ndarray, np.ndarray, dict]:
    x_train, x_test = table(train, cols), table(test, cols)
    if not len(x_test):
        x_test = np.empty((0, x_train.shape[1]))
    extra: dict = {"feature_columns": cols}
    if p.standardize:
        mean, std = x_train.mean(axis=0), x_train.std(axis=0)
        std = np.where(std > 0, std, 1.0)
        x_train, x_test = (x_train - mean) / std, (x_test - mean) / std
    return x_train.astype(np.float32), x_test.astype(np.float32), extra


# ----------------------------------------------------------------------------------------------------------
# Preparing, caching, loading


def held_out(n: int, p: HFParams) -> tuple[np.ndarray, np.ndarray]:
    """Sorted training and test indices: a seeded ``test_fraction`` (at least one sample) is held out."""
    if n < 2:
        raise DataError(f"dataset 'hf': {n} training sample(s) cannot be split into training and test samples")
    perm = np.random.default_rng([p.split_seed, 0x4F]).permutation(n)
    n_test = min(n - 1, max(1, round(p.test_fraction * n)))
    return np.sort(perm[n_test:]), np.sort(perm[:n_test])


def prepare(train, test, p: HFParams) -> dict:
    """The arrays and metadata of the dataset, as the cache stores them."""
    cols = columns(train.features, p)
    for split, ds in (("training", train), ("test", test)):  # row numbers as in the files, before any hold-out
        if ds is not None and kind(ds.features[cols["label"]]) != "list":
            missing_labels(cols["label"], values(ds, cols["label"]), split)
    if test is None:
        keep, hold = held_out(len(train), p)
        train, test = train.select(keep), train.select(hold)
    y_train, y_test, names = encode_labels(train, test, cols["label"])
    g_train, g_test, users = encode_ids(train, test, cols["id"])
    build = {"image": image_arrays, "text": text_arrays, "tabular": tabular_arrays}[cols["task"]]
    x_train, x_test, extra = build(train, test, cols["input"], p)
    arrays = {"x_train": x_train, "y_train": y_train, "x_test": x_test, "y_test": y_test}
    if g_train is not None:
        arrays |= {"groups_train": g_train, "groups_test": g_test}
    d_train, d_test, domains = encode_ids(train, test, cols["domain"])
    if d_train is not None:
        arrays |= {"domains_train": d_train, "domains_test": d_test}
    extra |= {"columns": {k: cols[k] for k in ("label", "id", "domain", "input")}} | ({"users": users} if users else {})
    meta = {"task": cols["task"], "class_names": names, "extra": extra}
    return {"arrays": arrays, "meta": meta | ({"domain_names": domains} if domains else {})}


def cache_key(train, test, p: HFParams, content: str) -> str:
    settings = p.model_dump(mode="json")
    fingerprints = [getattr(train, "_fingerprint", None), getattr(test, "_fingerprint", None) if test else None]
    blob = json.dumps([prepared.CACHE_VERSION, settings, fingerprints, content], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def to_dataset(arrays: dict, provenance: dict, notes: list[str]) -> ArrayDataset:
    a, meta = arrays["arrays"], arrays["meta"]
    task, names = meta["task"], meta["class_names"]
    mean = std = None
    x_train, x_test = a["x_train"], a["x_test"]
    if task == "image":
        x_train = np.divide(x_train, np.float32(255), dtype=np.float32)
        x_test = np.divide(x_test, np.float32(255), dtype=np.float32)
        mean, std = channel_stats(x_train)
        std = tuple(s if s > 0 else 1.0 for s in std)
    return ArrayDataset(
        name=NAME,
        x_train=x_train,
        y_train=a["y_train"],
        x_test=x_test,
        y_test=a["y_test"],
        num_classes=len(names),
        input_shape=tuple(x_train.shape[1:]),
        task="sequence" if task == "text" else task,
        mean=mean,
        std=std,
        class_names=names,
        groups_train=a.get("groups_train"),
        groups_test=a.get("groups_test"),
        domains_train=a.get("domains_train"),
        domains_test=a.get("domains_test"),
        domain_names=meta.get("domain_names"),
        extra={**meta["extra"], "provenance": provenance["extra"], "notes": notes},
        **provenance["fields"],
    )


@DATASETS.register(
    "hf", "Hugging Face datasets: a hub id or a local copy (images, text, tables); needs fedhet[hf]", HFParams
)
def load_hf(data_dir: str | Path | None = None, **params) -> ArrayDataset:
    p = parse_params("dataset", NAME, HFParams, params)
    dd, local = open_dataset(p, data_dir)
    train, test, how = splits(dd, p)
    if local is not None and local.is_dir():
        unlabelled_folder(local, train.features, p)
    if local is not None:
        fields = local_manifest(local).fields()
        content = fields["content_hash"]
    else:
        fields, content = {"source_dir": f"Hugging Face Hub: {p.path}"}, ""
    # another tokenizer in the same folder prepares the text again; the files' own hash stays what `cache clean
    # --stale` compares with the local copy
    keyed = content + tokenizer_digest(p.tokenizer)
    folder = prepared_dir(data_dir)
    prepared.remove_leftovers(folder)
    path = folder / f"{cache_key(train, test, p, keyed)}.npz"
    arrays, damaged = prepared.read(path)
    notes = (
        [] if damaged is None else [f"dataset 'hf': the prepared file {path} was damaged ({damaged}); prepared again"]
    )
    if arrays is None:
        arrays = prepare(train, test, p)
        prepared.write(path, arrays, about(p, local, content))
    hub = {"subset": p.subset, "revision": p.revision} if local is None else {}
    extra = {"test_split": how, "prepared": str(path), **{k: v for k, v in hub.items() if v}}
    images = arrays["meta"]["extra"].get("images")
    if images is not None:
        extra["images"] = images
        notes += [note for note in [image_note(images)] if note]
    return to_dataset(arrays, {"fields": fields, "extra": extra}, notes)


def about(p: HFParams, local: Path | None, content: str) -> dict:
    """What a prepared file was prepared from, for ``fedhet cache list`` and ``clean``."""
    settings = p.model_dump(mode="json", exclude_defaults=True)
    for key in ("path", "subset", "revision"):
        settings.pop(key, None)
    if local is None:
        return {"kind": "hub", "source": p.path, "subset": p.subset, "revision": p.revision, "settings": settings}
    return {"kind": "local", "source": str(local.resolve()), "content_hash": content, "settings": settings}

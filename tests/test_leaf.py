"""LEAF's on-disk format: FEMNIST, CelebA and Sent140 read from small files written in LEAF's layout, with their
natural users, end to end, and every malformed file as one error line naming it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import fedhet
from fedhet.data.datasets import files as datafiles
from fedhet.data.datasets import leaf, load_dataset
from fedhet.data.types import DataError
from fedhet.engine.training import build_federation
from fedhet.models.fit import dataset_input, default_model

SMILE_WORDS = ["love", "great", "happy", "fun", "good"]
FROWN_WORDS = ["hate", "awful", "sad", "bad", "boring"]


@pytest.fixture(autouse=True)
def isolated_search(monkeypatch, tmp_path):
    """Tests see only the data they write: no FEDHET_DATA and an empty system folder."""
    monkeypatch.delenv("FEDHET_DATA", raising=False)
    monkeypatch.setattr(datafiles, "SYSTEM_DATA_DIR", tmp_path / "system")


# ----------------------------------------------------------------------------------------------------------
# Writers of LEAF's files


def write_leaf(folder: Path, users: dict[str, tuple[list, list]], name="all_data_0.json", **extra) -> Path:
    """One LEAF JSON file: users, num_samples, user_data {user: {x, y}} (and ``extra`` keys, e.g. hierarchies)."""
    folder.mkdir(parents=True, exist_ok=True)
    obj = {
        "users": list(users),
        "num_samples": [len(y) for _, y in users.values()],
        "user_data": {u: {"x": x, "y": y} for u, (x, y) in users.items()},
        **extra,
    }
    path = folder / name
    path.write_text(json.dumps(obj))
    return path


def digit_writers(num_users=6, per_user=50, test_share=0.2) -> tuple[dict, dict]:
    """FEMNIST-like writers made of scikit-learn's digits: each 8x8 digit scaled to 24x24 inside a 28x28 frame, in
    [0, 1]; each writer's last test_share of samples is its test data (LEAF's -t sample split)."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = np.pad(np.kron(bunch.images / 16.0, np.ones((3, 3))), ((0, 0), (2, 2), (2, 2)))
    train, test = {}, {}
    for u in range(num_users):
        idx = np.arange(u * per_user, (u + 1) * per_user)
        x = [images[i].reshape(-1).round(4).tolist() for i in idx]
        y = [int(bunch.target[i]) for i in idx]
        cut = int(per_user * (1 - test_share))
        train[f"f{u:04d}_{u % 3}"] = (x[:cut], y[:cut])
        test[f"f{u:04d}_{u % 3}"] = (x[cut:], y[cut:])
    return train, test


def write_femnist(root: Path, **kwargs) -> tuple[dict, dict]:
    train, test = digit_writers(**kwargs)
    users = list(train)
    write_leaf(root / "train", {u: train[u] for u in users[:3]}, "all_data_0_niid_1_keep_0_train_9.json")
    write_leaf(root / "train", {u: train[u] for u in users[3:]}, "all_data_1_niid_1_keep_0_train_9.json")
    write_leaf(root / "test", test, "all_data_0_niid_1_keep_0_test_9.json")
    return train, test


def face(smiling: bool, rng: np.random.Generator, fmt: str) -> Image.Image:
    """A tiny 'face' whose lower half is bright when it smiles; noise and odd sizes, as raw photos come."""
    h, w = int(rng.integers(10, 16)), int(rng.integers(8, 14))
    pixels = rng.integers(0, 80, (h, w, 3))
    pixels[h // 2 :] += 150 if smiling else 0
    img = Image.fromarray(pixels.clip(0, 255).astype(np.uint8))
    return img.convert("L") if fmt == "png" else img  # a grey PNG too: LEAF converts every image to RGB


def write_celeba(root: Path, num_users=4, per_user=12, seed=0) -> dict:
    rng = np.random.default_rng(seed)
    folder = root / "raw" / "img_align_celeba"
    folder.mkdir(parents=True)
    train, test = {}, {}
    n = 0
    for u in range(num_users):
        names, labels = [], []
        for _ in range(per_user):
            n += 1
            fmt = "png" if n % 5 == 0 else "jpg"
            smiling = bool(rng.random() < 0.5)
            face(smiling, rng, fmt).save(folder / f"{n:06d}.{fmt}")
            names.append(f"{n:06d}.{fmt}")
            labels.append(float(smiling))  # LEAF writes (attribute + 1) / 2: 0.0 or 1.0
        cut = per_user * 3 // 4
        train[str(1000 + u)] = (names[:cut], labels[:cut])
        test[str(1000 + u)] = (names[cut:], labels[cut:])
    write_leaf(root / "train", train, "all_data_niid_1_keep_5_train_9.json")
    write_leaf(root / "test", test, "all_data_niid_1_keep_5_test_9.json")
    return train


def tweet(i: int, user: str, text: str) -> list[str]:
    """A LEAF Sent140 record: [id, date, query, user, text]."""
    return [str(1000 + i), "Sat May 16 23:58:44 UTC 2009", "NO_QUERY", user, text]


def write_sent140(root: Path, num_users=6, per_user=30, seed=0) -> None:
    rng = np.random.default_rng(seed)
    train, test = {}, {}
    for u in range(num_users):
        user = f"user{u}"
        x, y = [], []
        for i in range(per_user):
            label = int(rng.random() < 0.5)
            words = (
                rng.choice(SMILE_WORDS if label else FROWN_WORDS, 2).tolist() + rng.choice(["the", "day"], 2).tolist()
            )
            x.append(tweet(i, user, " ".join(words).capitalize() + "!"))
            y.append(label)
        cut = per_user * 4 // 5
        train[user], test[user] = (x[:cut], y[:cut]), (x[cut:], y[cut:])
    write_leaf(root / "train", train, "all_data_niid_1_keep_0_train_9.json")
    write_leaf(root / "test", test, "all_data_niid_1_keep_0_test_9.json")


# ----------------------------------------------------------------------------------------------------------
# Reading: users, samples and groups


def test_femnist_reads_users_sorted_with_their_samples_and_groups(tmp_path):
    train, test = write_femnist(tmp_path)
    ds = load_dataset("leaf_femnist", tmp_path)
    users = sorted(train)
    assert ds.extra["users"] == users and ds.num_classes == 62 and ds.input_shape == (1, 28, 28)
    assert ds.class_names[:11] == [*"0123456789", "A"] and ds.class_names[-1] == "z"
    expected = np.array([s for u in users for s in train[u][0]], np.float32).reshape(-1, 1, 28, 28)
    np.testing.assert_array_equal(ds.x_train, expected)  # users in sorted order, samples in file order
    np.testing.assert_array_equal(ds.y_train, [c for u in users for c in train[u][1]])
    np.testing.assert_array_equal(ds.groups_train, np.repeat(np.arange(6), 40))
    np.testing.assert_array_equal(ds.groups_test, np.repeat(np.arange(6), 10))
    np.testing.assert_array_equal(ds.y_test, [c for u in users for c in test[u][1]])
    record = ds.provenance()
    assert record["source"] == str(tmp_path) and record["sha256_of"] == "files"
    assert record["files"] == [
        "test/all_data_0_niid_1_keep_0_test_9.json",
        "train/all_data_0_niid_1_keep_0_train_9.json",
        "train/all_data_1_niid_1_keep_0_train_9.json",
    ]


def test_all_data_has_no_test_set_and_split_picks_the_folder(tmp_path):
    train, _ = write_femnist(tmp_path / "femnist" / "data")  # LEAF's own tree: leaf/data/femnist/data/
    write_leaf(tmp_path / "femnist" / "data" / "all_data", train, hierarchies=[f"h{i % 2}" for i in range(6)])
    auto = load_dataset("leaf_femnist", tmp_path)
    assert auto.has_test_set and "hierarchies" not in auto.extra
    whole = load_dataset("leaf_femnist", tmp_path, split="all_data")
    assert not whole.has_test_set and whole.groups_test is None and len(whole.y_train) == 240
    assert whole.extra["hierarchies"] == {u: f"h{i % 2}" for i, u in enumerate(train)}


def test_users_only_in_test_get_their_own_group(tmp_path):
    """LEAF's -t user split: the test users are other users; each keeps a group of its own."""
    train, test = digit_writers(num_users=4, per_user=5)
    users = sorted(train)
    write_leaf(tmp_path / "train", {u: train[u] for u in users[:3]})
    write_leaf(tmp_path / "test", {users[3]: test[users[3]]})
    ds = load_dataset("leaf_femnist", tmp_path)
    assert ds.extra["users"] == users
    assert set(ds.groups_train) == {0, 1, 2} and set(ds.groups_test) == {3}


def test_celeba_images_are_resized_as_leaf_does(tmp_path):
    train = write_celeba(tmp_path)
    ds = load_dataset("leaf_celeba", tmp_path)
    assert ds.input_shape == (3, 84, 84) and ds.num_classes == 2 and ds.class_names == ["not smiling", "smiling"]
    first_user = sorted(train)[0]
    name = train[first_user][0][4]  # a PNG, grey
    with Image.open(tmp_path / "raw" / "img_align_celeba" / name) as img:
        expected = np.asarray(img.resize((84, 84), Image.Resampling.BICUBIC).convert("RGB"), np.float32) / 255
    np.testing.assert_allclose(ds.x_train[4], expected.transpose(2, 0, 1), rtol=0, atol=1e-7)
    np.testing.assert_array_equal(ds.y_train[:9], np.array(train[first_user][1], np.int64))
    small = load_dataset("leaf_celeba", tmp_path, image_size=16)
    assert small.x_train.shape == (36, 3, 16, 16) and small.x_test.shape == (12, 3, 16, 16)
    assert len(small.source_files) == 2 + 48  # the two JSON files and every image read
    assert dataset_input("leaf_celeba", {"image_size": 16}) == ("image", (3, 16, 16))


def test_sent140_bags_of_words_over_the_training_vocabulary():
    texts = ["I love it, I love it!", "Hate it.", "love?"]
    vocab = leaf.vocabulary(texts, 4, lowercase=True)
    # counts: i 2, love 3, it 3, "," 1, "!" 1, hate 1, "." 1, "?" 1; ties in alphabetical order
    assert vocab == {"it": 0, "love": 1, "i": 2, "!": 3}
    bags = leaf.bags(["Love love it", "unknown words", "i!"], vocab, 5, lowercase=True)
    np.testing.assert_array_equal(bags, [[1, 2, 0, 0, 0], [0, 0, 0, 0, 0], [0, 0, 1, 1, 0]])
    assert leaf.tokens("Don't stop, OK?", lowercase=False) == ["Don't", "stop", ",", "OK", "?"]  # LEAF's split_line


def test_sent140_reads_field_4_and_builds_the_vocabulary_from_training_tweets_only(tmp_path):
    write_leaf(tmp_path / "train", {"ann": ([tweet(0, "ann", "Good day"), tweet(1, "ann", "good")], [1, 1])})
    write_leaf(tmp_path / "test", {"ann": ([tweet(2, "ann", "unseen good")], [0.0])})
    ds = load_dataset("leaf_sent140", tmp_path, vocab_size=3)
    assert ds.extra["vocab"] == ["good", "day"] and ds.input_shape == (3,) and ds.task == "tabular"
    np.testing.assert_array_equal(ds.x_train, [[1, 1, 0], [1, 0, 0]])
    np.testing.assert_array_equal(ds.x_test, [[1, 0, 0]])
    np.testing.assert_array_equal(ds.y_test, [0])
    assert default_model("leaf_sent140") == "logreg" and dataset_input("leaf_sent140") == ("tabular", (5000,))


# ----------------------------------------------------------------------------------------------------------
# Runs with the natural users


def leaf_run(tmp_path, which: str, rounds: int, name="run", **sections):
    raw = {
        "run": {"rounds": rounds, "out_dir": str(tmp_path / "runs"), "progress": False, "workers": 1, "name": name},
        "dataset": {"name": which, "data_dir": str(tmp_path / "data")},
        "partition": {"name": "natural", "num_clients": 6, "local_test": "natural"},
        "train": {"local_epochs": 2, "batch_size": 8, "lr": 0.1},
    }
    for key, values in sections.items():
        raw[key] = {**raw.get(key, {}), **values}
    return raw


def test_femnist_run_with_one_client_per_writer_learns(tmp_path):
    write_femnist(tmp_path / "data")
    result = fedhet.run(leaf_run(tmp_path, "leaf_femnist", 8, model={"name": "mlp", "hidden": [32]}))
    assert result.final["test_acc"] > 0.6, result.final  # 10 digit classes: chance is 0.1
    fed = build_federation(fedhet.make_config(result.config))
    assert [len(c.y) for c in fed.clients] == [40] * 6 and [len(c.y_test) for c in fed.clients] == [10] * 6


def test_celeba_run_learns_smiles(tmp_path):
    write_celeba(tmp_path / "data", num_users=6, per_user=16)
    raw = leaf_run(tmp_path, "leaf_celeba", 6, dataset={"image_size": 16}, model={"name": "mlp", "hidden": [16]})
    result = fedhet.run(raw)
    assert result.final["test_acc"] >= 0.8, result.final


def test_sent140_run_with_the_default_model_learns(tmp_path):
    write_sent140(tmp_path / "data")
    result = fedhet.run(leaf_run(tmp_path, "leaf_sent140", 5, dataset={"vocab_size": 50}))
    assert result.config["model"]["name"] == "logreg"
    assert result.final["test_acc"] > 0.9, result.final


def test_a_killed_leaf_run_resumes_bit_exact(tmp_path, kill_and_resume):
    write_femnist(tmp_path / "data")

    def make(name):
        raw = leaf_run(tmp_path, "leaf_femnist", 4, name, model={"name": "mlp", "hidden": [16]})
        return fedhet.make_config(raw, {"train.participation": 0.5})

    full, resumed = kill_and_resume(make)
    lines = [(s.run_dir / "metrics.jsonl").read_text().splitlines() for s in (full, resumed)]
    strip = [[{k: v for k, v in json.loads(r).items() if k != "elapsed_s"} for r in rows] for rows in lines]
    assert strip[0] == strip[1] and len(strip[0]) == 4


# ----------------------------------------------------------------------------------------------------------
# Missing data and malformed files: one line that names the file and the problem


def test_missing_data_says_where_it_looked_and_how_to_make_it(tmp_path):
    with pytest.raises(DataError) as info:
        load_dataset("leaf_celeba", tmp_path / "nothing")
    message = str(info.value)
    assert "\n" not in message and str(tmp_path / "nothing") in message
    assert "./preprocess.sh -s niid --sf 1.0 -k 5 -t sample" in message and "raw/img_align_celeba/" in message


def test_train_without_test_is_named(tmp_path):
    write_femnist(tmp_path)
    for f in (tmp_path / "test").iterdir():
        f.unlink()
    (tmp_path / "test").rmdir()
    with pytest.raises(DataError, match="has train/ but no test/ folder.*split='all_data'"):
        load_dataset("leaf_femnist", tmp_path)
    (tmp_path / "test").mkdir()
    for f in (tmp_path / "train").iterdir():
        f.rename(tmp_path / "test" / f.name)
    with pytest.raises(DataError, match=rf"^{tmp_path / 'train'}: no \.json files"):
        load_dataset("leaf_femnist", tmp_path)


def spoil(obj: dict, how: str) -> str:
    """The text of a LEAF file of users 'a' (2 samples) and 'b' (1 sample), spoilt one way."""
    if how in ("not json", "a list", "nested too deeply"):
        return {"not json": '{"users": [', "a list": "[1, 2]", "nested too deeply": "[" * 100_000}[how]
    data = obj["user_data"]
    changes = {
        "no num_samples": lambda: obj.pop("num_samples"),
        "short num_samples": lambda: obj.update(num_samples=[2]),
        "count disagrees": lambda: obj.update(num_samples=[3, 1]),
        "count not whole": lambda: obj.update(num_samples=[2.5, 1]),
        "user without data": lambda: data.pop("b"),
        "data without user": lambda: obj.update(users=["a"], num_samples=[2]),
        "user twice": lambda: obj.update(users=["a", "a"]),
        "entry without y": lambda: data["b"].pop("y"),
        "text pixel": lambda: data["a"]["x"][1].__setitem__(5, "0.5"),
        "short sample": lambda: data["a"]["x"][1].pop(),
        "pixel above one": lambda: data["a"]["x"][0].__setitem__(0, 255),
        "label out of range": lambda: data["b"]["y"].__setitem__(0, 62),
        "label not whole": lambda: data["b"]["y"].__setitem__(0, 1.5),
        "label text": lambda: data["b"]["y"].__setitem__(0, "3"),
        "bad hierarchies": lambda: obj.update(hierarchies=["h"]),
    }
    changes[how]()
    return json.dumps(obj)


MALFORMED = {
    "not json": "not valid JSON (Expecting value at line 1 column 12)",
    "a list": "a list where LEAF writes an object with keys users, num_samples, user_data",
    "nested too deeply": "brackets nested too deeply to read",
    "no num_samples": "missing key 'num_samples' (a LEAF file has the keys users, num_samples, user_data)",
    "short num_samples": "'num_samples' must be a list of one count per user (2 users)",
    "count disagrees": "user 'a': num_samples says 3 but 'x' holds 2 samples",
    "count not whole": "user 'a': num_samples 2.5 is not a whole number",
    "user without data": "user 'b' is in 'users' but not in 'user_data'",
    "data without user": "user 'b' is in 'user_data' but not in 'users'",
    "user twice": "user 'a' is listed twice in 'users'",
    "entry without y": "user 'b': its user_data entry must be an object with the lists 'x' and 'y'",
    "text pixel": "user 'a': pixel value '0.5' is not a number",
    "short sample": "user 'a': sample 1 has 783 values where FEMNIST has 784",
    "pixel above one": "user 'a': pixel values outside [0, 1]",
    "label out of range": "user 'b': label 62 is not a class 0 to 61",
    "label not whole": "user 'b': label 1.5 is not a class 0 to 61",
    "label text": "user 'b': label '3' is not a number",
    "bad hierarchies": "'hierarchies' must be a list of one entry per user (2 users)",
}


@pytest.mark.parametrize("how", list(MALFORMED))
def test_a_malformed_file_is_one_line_naming_it(tmp_path, how):
    pixels = [[0.5] * 784, [0.25] * 784, [1.0] * 784]
    good = write_leaf(tmp_path / "all_data", {"c": ([pixels[0]], [1])}, "all_data_0.json")
    obj = {"users": ["a", "b"], "num_samples": [2, 1]}
    obj["user_data"] = {"a": {"x": pixels[:2], "y": [0, 1]}, "b": {"x": pixels[2:], "y": [61]}}
    path = tmp_path / "all_data" / "all_data_1.json"
    path.write_text(spoil(obj, how))
    with pytest.raises(DataError) as info:
        load_dataset("leaf_femnist", tmp_path)
    assert str(info.value).startswith(f"{path}: {MALFORMED[how]}")
    assert "\n" not in str(info.value)
    assert good.is_file()  # the reader changes nothing


@pytest.mark.parametrize("which", ["leaf_femnist", "leaf_celeba", "leaf_sent140"])
def test_files_without_training_samples_are_named(tmp_path, which):
    (tmp_path / "raw" / "img_align_celeba").mkdir(parents=True)
    write_leaf(tmp_path / "all_data", {})
    with pytest.raises(DataError, match=f"^dataset '{which}': no training samples in {tmp_path}$"):
        load_dataset(which, tmp_path)


def test_a_user_in_two_files_names_both(tmp_path):
    pixels = [[0.5] * 784]
    first = write_leaf(tmp_path / "all_data", {"a": (pixels, [1])}, "all_data_0.json")
    second = write_leaf(tmp_path / "all_data", {"a": (pixels, [2])}, "all_data_1.json")
    with pytest.raises(DataError, match=f"^{second}: user 'a' is also in {first}; each user belongs in one file$"):
        load_dataset("leaf_femnist", tmp_path)


@pytest.mark.parametrize(
    "name, problem",
    [("../secret.jpg", "is not an image file name under raw/img_align_celeba/"), ("gone.jpg", "does not exist")],
)
def test_celeba_image_names_stay_in_the_image_folder_and_must_exist(tmp_path, name, problem):
    write_celeba(tmp_path, num_users=1, per_user=4)
    path = write_leaf(tmp_path / "test", {"9": ([name], [1.0])}, "all_data_niid_1_keep_5_test_9.json")
    with pytest.raises(DataError) as info:
        load_dataset("leaf_celeba", tmp_path)
    where = str(path) if name.startswith("..") else str(tmp_path / "raw" / "img_align_celeba" / name)
    assert str(info.value).startswith(where) and problem in str(info.value)


def test_celeba_unreadable_image_is_named(tmp_path):
    write_celeba(tmp_path, num_users=1, per_user=4)
    broken = tmp_path / "raw" / "img_align_celeba" / "000002.jpg"
    broken.write_bytes(b"not a jpeg")
    with pytest.raises(DataError, match=f"^{broken}: unreadable image"):
        load_dataset("leaf_celeba", tmp_path)


def test_sent140_record_without_text_is_named(tmp_path):
    path = write_leaf(tmp_path / "all_data", {"ann": ([["1", "date", "NO_QUERY", "ann"]], [1])})
    with pytest.raises(DataError, match=rf"^{path}: user 'ann': sample 0 is not a tweet record .* in field 4$"):
        load_dataset("leaf_sent140", tmp_path)


@pytest.mark.slow
def test_the_cli_reports_a_malformed_leaf_file_in_one_line(tmp_path):
    path = write_leaf(tmp_path / "all_data", {"ann": ([[0.5] * 784], [1])})
    path.write_text(path.read_text().replace('"num_samples"', '"count"'))
    proc = subprocess.run(
        [sys.executable, "-m", "fedhet.cli", "run", "-d", "leaf_femnist", "--data-dir", str(tmp_path), "-p", "natural"]
        + ["-n", "1", "-r", "1", "-o", str(tmp_path / "runs"), "-s", "run.progress=false"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip() == f"error: {path}: missing key 'num_samples' (a LEAF file has the keys users, " + (
        "num_samples, user_data)"
    )

"""Hugging Face datasets as a source (dataset.name = "hf"): small datasets built here, no network."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

datasets = pytest.importorskip("datasets")

from PIL import Image  # noqa: E402

import fedhet  # noqa: E402
from fedhet.data.datasets import huggingface, load_dataset  # noqa: E402
from fedhet.data.types import DataError  # noqa: E402
from fedhet.engine.training import build_federation  # noqa: E402
from fedhet.errors import ConfigError  # noqa: E402


def shape_image(label: int, i: int, size: int = 12, mode: str = "L") -> Image.Image:
    """A bright bar (label 0: horizontal, 1: vertical, 2: a square) on a dark, slightly noisy background."""
    rng = np.random.default_rng(i)
    a = rng.integers(0, 40, (size, size)).astype(np.uint8)
    if label == 0:
        a[size // 2 - 1 : size // 2 + 1, :] = 250
    elif label == 1:
        a[:, size // 2 - 1 : size // 2 + 1] = 250
    else:
        a[3:-3, 3:-3] = 250
    return Image.fromarray(a).convert(mode)


def image_dataset(n: int = 90, writers: int = 6):
    labels = [i % 3 for i in range(n)]
    features = datasets.Features(
        {
            "image": datasets.Image(),
            "label": datasets.ClassLabel(names=["bar", "pole", "box"]),
            "writer": datasets.Value("string"),
        }
    )
    columns = {"image": [shape_image(y, i) for i, y in enumerate(labels)], "label": labels}
    columns["writer"] = [f"w{i % writers}" for i in range(n)]
    return datasets.Dataset.from_dict(columns, features=features)


@pytest.fixture
def saved_images(tmp_path):
    """A DatasetDict (train 90, test 30) saved with save_to_disk."""
    path = tmp_path / "shapes"
    datasets.DatasetDict({"train": image_dataset(90), "test": image_dataset(30, writers=3)}).save_to_disk(str(path))
    return path


TEXTS = {"pos": "good great fine nice happy", "neg": "bad awful poor sad grim"}


@pytest.fixture
def text_parquet(tmp_path):
    rng = np.random.default_rng(0)
    moods = rng.choice(["pos", "neg"], 200)
    texts = [" ".join(rng.choice(TEXTS[m].split(), 4)) for m in moods]
    path = tmp_path / "reviews.parquet"
    datasets.Dataset.from_dict({"review": texts, "mood": moods.tolist()}).to_parquet(str(path))
    return path


def load(path, tmp_path, **params):
    return load_dataset("hf", tmp_path / "cache", path=str(path), **params)


# ----------------------------------------------------------------------------------------------------------
# Images


def test_saved_images_keep_splits_labels_ids_and_the_training_split_statistics(saved_images, tmp_path):
    ds = load(saved_images, tmp_path, id_column="writer")
    assert ds.task == "image" and ds.x_train.shape == (90, 1, 12, 12) and ds.x_test.shape == (30, 1, 12, 12)
    assert ds.class_names == ["bar", "pole", "box"] and ds.y_train.tolist() == [i % 3 for i in range(90)]
    first = np.asarray(shape_image(0, 0), np.float32) / 255
    assert np.array_equal(ds.x_train[0, 0], first)
    assert ds.mean == pytest.approx((float(ds.x_train.astype(np.float64).mean()),))
    assert ds.std == pytest.approx((float(ds.x_train.astype(np.float64).std()),))
    # ids sorted over both splits: w0..w5; the test split's w0..w2 keep the same numbers
    assert ds.extra["users"] == [f"w{i}" for i in range(6)]
    assert ds.groups_train.tolist() == [i % 6 for i in range(90)] and ds.groups_test.tolist() == [
        i % 3 for i in range(30)
    ]
    prov = ds.provenance()
    assert prov["source"] == str(saved_images) and "dataset_dict.json" in prov["files"]
    assert prov["sha256_of"] == "files" and prov["test_split"] == "split 'test'"
    assert str(tmp_path / "cache" / "huggingface" / "fedhet-prepared") in prov["prepared"]


def test_colour_and_grey_images_of_any_size_become_one_colour_size(tmp_path):
    images = [shape_image(0, 0, 10, "RGB"), shape_image(1, 1, 14, "L"), shape_image(2, 2, 9, "RGBA")]
    path = tmp_path / "mixed"
    datasets.Dataset.from_dict({"image": images * 4, "label": [0, 1, 2] * 4}).cast_column(
        "image", datasets.Image()
    ).save_to_disk(str(path))
    ds = load(path, tmp_path, image_size=[6, 8])
    assert ds.x_train.shape[1:] == (3, 6, 8) and ds.extra["image_mode"] == "RGB" and len(ds.mean) == 3
    grey = load(path, tmp_path, image_size=5, image_mode="L")
    assert grey.x_train.shape[1:] == (1, 5, 5)
    with pytest.raises(DataError, match=r"the images differ in size \(.*\); set dataset.image_size to resize them$"):
        load(path, tmp_path)


def test_an_image_folder_takes_its_labels_from_the_folder_names(tmp_path):
    for split, count in (("train", 6), ("test", 2)):
        for label, name in enumerate(("bar", "pole")):
            folder = tmp_path / "folder" / split / name
            folder.mkdir(parents=True)
            for i in range(count):
                shape_image(label, i).save(folder / f"{i}.png")
    ds = load(tmp_path / "folder", tmp_path)
    assert ds.class_names == ["bar", "pole"] and len(ds.y_train) == 12 and len(ds.y_test) == 4
    assert sorted(ds.y_train.tolist()) == [0] * 6 + [1] * 6
    assert len(ds.provenance()["files"]) == 16  # every image hashed


# ----------------------------------------------------------------------------------------------------------
# Text and tables


def test_text_becomes_left_padded_ids_over_the_training_vocabulary(tmp_path):
    path = tmp_path / "t.parquet"
    datasets.Dataset.from_dict({"text": ["abca", "bb", "zzzzzz"], "label": [0, 1, 1]}).to_parquet(str(path))
    ds = load(path, tmp_path, test_split=None, test_fraction=0.34, split_seed=3, vocab_size=4, seq_len=4)
    assert ds.task == "sequence" and ds.x_train.dtype == np.int64
    # ids: 0 padding, 1 unknown, then the 2 most frequent training characters (ties alphabetical)
    train_texts = {0: "abca", 1: "bb", 2: "zzzzzz"}
    kept, held = huggingface.held_out(3, huggingface.HFParams(path="x", test_fraction=0.34, split_seed=3))
    counts = {}
    for i in kept:
        for ch in train_texts[i]:
            counts[ch] = counts.get(ch, 0) + 1
    vocab = sorted(counts, key=lambda c: (-counts[c], c))[:2]
    assert ds.extra["vocab"] == ["<pad>", "<unk>", *vocab]

    def encode(text):
        ids = [vocab.index(c) + 2 if c in vocab else 1 for c in text[:4]]
        return [0] * (4 - len(ids)) + ids

    assert ds.x_train.tolist() == [encode(train_texts[i]) for i in kept]
    assert ds.x_test.tolist() == [encode(train_texts[i]) for i in held]
    assert ds.provenance()["test_split"] == "test_fraction 0.34 of split 'train', split_seed 3"


def test_words_and_string_labels(text_parquet, tmp_path):
    ds = load(text_parquet, tmp_path, label_column="mood", tokens="word", seq_len=4, vocab_size=12)
    assert ds.class_names == ["neg", "pos"] and ds.x_train.shape == (160, 4) and len(ds.y_test) == 40
    assert set(ds.extra["vocab"][2:]) == set(TEXTS["pos"].split()) | set(TEXTS["neg"].split())
    assert (ds.x_train > 1).all()  # four known words each, no padding


def test_numeric_columns_are_standardised_with_the_training_split(tmp_path):
    path = tmp_path / "table.csv"
    path.write_text("a,b,name,y\n1,10,x,0\n2,10,y,1\n3,10,z,0\n4,10,w,1\n5,10,v,1\n")
    ds = load(path, tmp_path, task="tabular", test_fraction=0.2)
    kept, held = huggingface.held_out(5, huggingface.HFParams(path="x", test_fraction=0.2))
    a = np.arange(1, 6, dtype=float)
    mean, std = a[kept].mean(), a[kept].std()
    assert ds.x_train[:, 0] == pytest.approx((a[kept] - mean) / std)
    assert ds.x_test[:, 0] == pytest.approx((a[held] - mean) / std)
    assert (ds.x_train[:, 1] == 0).all()  # a constant column: divided by 1, not 0
    assert ds.extra["feature_columns"] == ["a", "b"] and ds.input_shape == (2,)


# ----------------------------------------------------------------------------------------------------------
# Columns and missing data: one line with what is valid


def test_column_problems_are_one_line_listing_the_columns(tmp_path, saved_images, text_parquet):
    with pytest.raises(DataError) as info:
        load(saved_images, tmp_path, label_column="digit")
    assert str(info.value) == (
        "dataset 'hf': no column 'digit' (dataset.label_column); its columns: image (Image), label (ClassLabel), "
        "writer (string)"
    )
    with pytest.raises(DataError, match=r"no label column; set dataset.label_column to one of the columns: review "):
        load(text_parquet, tmp_path)
    two = tmp_path / "two.parquet"
    datasets.Dataset.from_dict({"s": ["a", "b"], "t": ["c", "d"], "label": [0, 1]}).to_parquet(str(two))
    with pytest.raises(DataError, match=r"2 string columns \(s, t\); set dataset.text_column to one of the columns"):
        load(two, tmp_path)
    with pytest.raises(DataError, match=r"no split 'valid' \(dataset.test_split\); its splits: train, test$"):
        load(saved_images, tmp_path, test_split="valid")


def test_a_path_that_is_neither_a_file_nor_a_hub_id_is_named(tmp_path):
    with pytest.raises(DataError, match=r"does not exist, and '\./nowhere/x' is not a hub id"):
        load("./nowhere/x", tmp_path)


def test_a_hub_dataset_without_a_network_or_a_cached_copy_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(huggingface, "hub_reachable", lambda timeout=5.0: False)
    with pytest.raises(DataError) as info:
        load("someone/not-cached", tmp_path)
    message = str(info.value)
    assert message.startswith("dataset 'hf': 'someone/not-cached' is not a local file or folder, and no cached copy")
    assert str(tmp_path / "cache" / "huggingface") in message and "cannot be reached from here" in message


@pytest.mark.slow
def test_offline_without_a_cached_copy_the_cli_says_where_it_looked(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "home")}
    env.pop("FEDHET_DATA", None)
    proc = subprocess.run(
        [sys.executable, "-m", "fedhet.cli", "run", "-d", "hf", "-s", "dataset.path=someone/not-cached"]
        + ["-n", "2", "-r", "1", "-o", str(tmp_path / "runs")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert f"no cached copy of it is in {tmp_path / 'home'}" in proc.stderr and "HF_HUB_OFFLINE is set" in proc.stderr


# ----------------------------------------------------------------------------------------------------------
# The cache


def test_the_prepared_arrays_are_cached_by_content_and_settings(saved_images, tmp_path, monkeypatch):
    first = load(saved_images, tmp_path, id_column="writer")
    monkeypatch.setattr(huggingface, "prepare", lambda *a: pytest.fail("prepared again"))
    again = load(saved_images, tmp_path, id_column="writer")
    assert np.array_equal(first.x_train, again.x_train) and again.provenance() == first.provenance()
    assert again.extra["users"] == first.extra["users"]
    with pytest.raises(pytest.fail.Exception):
        load(saved_images, tmp_path, image_size=6)  # another setting: another key
    before = os.listdir(saved_images)
    assert os.listdir(saved_images) == before  # nothing was written into the user's copy


# ----------------------------------------------------------------------------------------------------------
# Runs


def hf_run(tmp_path, path, name="run", **sections) -> dict:
    raw = {
        "run": {"rounds": 6, "out_dir": str(tmp_path / "runs"), "progress": False, "workers": 1, "name": name},
        "dataset": {"name": "hf", "path": str(path), "data_dir": str(tmp_path / "cache")},
        "partition": {"name": "iid", "num_clients": 3},
        "train": {"local_epochs": 2, "batch_size": 8, "lr": 0.1},
    }
    for key, values in sections.items():
        raw[key] = {**raw.get(key, {}), **values}
    return raw


def test_an_image_run_with_a_client_per_writer_learns(saved_images, tmp_path):
    raw = hf_run(
        tmp_path, saved_images, dataset={"id_column": "writer"}, partition={"name": "natural", "num_clients": 6}
    )
    result = fedhet.run({**raw, "model": {"name": "mlp", "hidden": [32]}})
    assert result.final["test_acc"] > 0.8, result.final  # 3 classes: chance is 1/3
    fed = build_federation(fedhet.make_config(result.config))
    assert [len(c.y) for c in fed.clients] == [15] * 6


def test_a_domain_column_gives_natural_domains_scored_per_domain(saved_images, tmp_path):
    # each writer is a domain here (a hospital, a camera): one client per writer, the test set scored per writer
    dataset = {"id_column": "writer", "domain_column": "writer"}
    raw = hf_run(tmp_path, saved_images, dataset=dataset, partition={"name": "natural", "num_clients": 6})
    raw["features"] = {"name": "natural"}
    result = fedhet.run({**raw, "model": {"name": "mlp", "hidden": [32]}})
    ds = load(saved_images, tmp_path, domain_column="writer")
    assert ds.domain_names == [f"w{i}" for i in range(6)]
    assert np.array_equal(ds.domains_train, np.arange(90) % 6) and ds.groups_train is None
    per_domain = {k: result.final[k] for k in (f"test_acc/domain/w{i}" for i in range(6)) if k in result.final}
    assert len(per_domain) == 3  # the test split has writers w0-w2 only; a domain without test samples is left out
    assert result.final["test_acc/domain/worst"] == min(per_domain.values())
    counts = np.bincount(ds.domains_test, minlength=6)  # test_acc is the domains' accuracies weighted by their sizes
    expected = sum(per_domain[f"test_acc/domain/w{k}"] * counts[k] for k in range(3)) / counts.sum()
    assert result.final["test_acc"] == pytest.approx(expected)


def test_a_domain_column_that_is_the_label_is_refused(saved_images, tmp_path):
    with pytest.raises(DataError, match="domain_column and label_column are both 'label'"):
        load(saved_images, tmp_path, domain_column="label")


def test_a_parquet_text_run_gets_the_lstm_and_learns(text_parquet, tmp_path):
    dataset = {"task": "text", "label_column": "mood", "tokens": "word", "seq_len": 4, "vocab_size": 12}
    raw = hf_run(tmp_path, text_parquet, dataset=dataset, model={"embed_dim": 8, "hidden": 16, "layers": 1})
    raw["model"]["vocab_size"] = 12
    raw["run"]["rounds"] = 10
    result = fedhet.run(raw)
    assert result.config["model"]["name"] == "lstm"
    assert result.final["test_acc"] > 0.9, result.final  # 2 classes: chance is 0.5


def test_a_vocabulary_larger_than_the_lstm_embedding_is_refused_with_the_config(text_parquet, tmp_path):
    raw = hf_run(tmp_path, text_parquet, dataset={"task": "text", "vocab_size": 500})
    with pytest.raises(ConfigError, match=r"set model.vocab_size=500"):
        fedhet.make_config(raw)


@pytest.mark.slow
def test_the_cli_runs_a_saved_image_dataset(saved_images, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "fedhet.cli", "run", "-d", "hf", "-s", f"dataset.path={saved_images}"]
        + ["--data-dir", str(tmp_path / "cache"), "-p", "flwr.iid", "-n", "3", "-r", "3", "-m", "mlp"]
        + ["-o", str(tmp_path / "runs"), "--name", "cli", "-s", "run.progress=false", "-s", "train.lr=0.1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "runs" / "cli" / "summary.json").read_text())
    assert summary["final"]["test_acc"] > 0.5, summary
    data = json.loads((tmp_path / "runs" / "cli" / "provenance.json").read_text())["data"]
    assert data["dataset"] == "hf" and data["test_split"] == "split 'test'"


def test_a_killed_hf_run_resumes_bit_exact(saved_images, tmp_path, kill_and_resume):
    def make(name):
        raw = hf_run(tmp_path, saved_images, name, model={"name": "mlp", "hidden": [16]}, run={"rounds": 4})
        return fedhet.make_config(raw, {"train.participation": 0.67})

    full, resumed = kill_and_resume(make)
    lines = [(s.run_dir / "metrics.jsonl").read_text().splitlines() for s in (full, resumed)]
    strip = [[{k: v for k, v in json.loads(r).items() if k != "elapsed_s"} for r in rows] for rows in lines]
    assert strip[0] == strip[1] and len(strip[0]) == 4


# ----------------------------------------------------------------------------------------------------------
# Issue 44: a damaged prepared file is prepared again; fedhet cache list | clean


def prepared_file(tmp_path):
    (found,) = (tmp_path / "cache" / "huggingface" / "fedhet-prepared").glob("*.npz")
    return found


def damage(path, how):
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "emptied":
        path.write_bytes(b"")
    elif how == "bit-flipped data":  # a byte inside the pixels of x_train: zip's CRC-32 catches it
        with np.load(path) as npz:
            at = data.index(npz["x_train"].tobytes()[1000:1016]) + 3
        path.write_bytes(data[:at] + bytes([data[at] ^ 0x04]) + data[at + 1 :])
    elif how == "bit-flipped header":
        # x_train's shape (90, 1, 12, 12) becomes (10, 1, 12, 12): numpy reads 10 images and stops before the end
        # of the member, where zip checks its CRC-32; only the sha256 of the arrays catches it
        at = data.index(b"'shape': (90, 1, 12, 12)") + len(b"'shape': (")
        path.write_bytes(data[:at] + bytes([data[at] ^ 0x08]) + data[at + 1 :])
    else:  # incomplete: a member missing (and the checksum recorded for all of them)
        with np.load(path) as npz:
            kept = {k: npz[k] for k in npz.files if k != "x_test"}
        with open(path, "wb") as f:
            np.savez(f, **kept)


@pytest.mark.parametrize("how", ["truncated", "emptied", "bit-flipped data", "bit-flipped header", "incomplete"])
def test_a_damaged_prepared_file_is_prepared_again_and_replaced(saved_images, tmp_path, monkeypatch, how):
    first = load(saved_images, tmp_path)
    path = prepared_file(tmp_path)
    damage(path, how)
    calls = []
    prepare = huggingface.prepare
    monkeypatch.setattr(huggingface, "prepare", lambda *a: calls.append(1) or prepare(*a))
    again = load(saved_images, tmp_path)
    assert calls == [1] and np.array_equal(again.x_train, first.x_train) and np.array_equal(again.y_test, first.y_test)
    assert again.extra["notes"][0].startswith(f"dataset 'hf': the prepared file {path} was damaged (")
    assert again.extra["notes"][0].endswith("); prepared again")
    third = load(saved_images, tmp_path)  # the replacement is whole: read, not prepared
    assert calls == [1] and third.extra["notes"] == [] and np.array_equal(third.x_train, first.x_train)


def test_a_killed_writes_leftovers_are_removed_and_nothing_else(saved_images, tmp_path):
    folder = tmp_path / "cache" / "huggingface" / "fedhet-prepared"
    folder.mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    key = "0123456789abcdef" * 2
    killed = folder / f".{key}.npz.{int(dead.stdout)}.tmp"
    writing = folder / f".{key}.npz.{os.getppid()}.tmp"  # a process still running: its write goes on
    theirs = [folder / "notes.txt", folder / f".{key}.npz.tmp", folder / "x.npz"]
    for path in [killed, writing, *theirs]:
        path.write_bytes(b"partial")
    load(saved_images, tmp_path)
    assert not killed.exists() and writing.exists() and all(p.exists() for p in theirs)


def invoke_cache(*args, input=None):
    from typer.testing import CliRunner

    from fedhet.cli import app
    from fedhet.cli_shared import console

    # fedhet's console is 200 columns wide off a terminal (COLUMNS is not read): a row of the long paths of pytest's
    # temporary folders (longer under xdist) would wrap, so the table is read at 400
    width, console.width = console.width, 400
    try:
        return CliRunner().invoke(app, ["cache", *args], input=input)
    finally:
        console.width = width


def test_cache_list_names_each_files_dataset_settings_size_and_last_use(saved_images, text_parquet, tmp_path):
    load(saved_images, tmp_path, image_size=6, id_column="writer")
    load(text_parquet, tmp_path, label_column="mood")
    cache = str(tmp_path / "cache")
    result = invoke_cache("list", "--data-dir", cache)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    images = next(line for line in lines if str(saved_images) in line)
    assert "id_column=writer, image_size=6" in images and " kB " in images and "(today)" in images
    assert "label_column=mood" in next(line for line in lines if str(text_parquet) in line)
    assert lines[-1].startswith("2 file(s), ")
    assert invoke_cache("list", "--data-dir", str(tmp_path / "empty")).output.startswith("no prepared files in ")


def test_cache_clean_removes_what_is_asked_and_only_fedhets_files(saved_images, text_parquet, tmp_path):
    load(saved_images, tmp_path)
    old = prepared_file(tmp_path)
    os.utime(old, (old.stat().st_atime, old.stat().st_mtime - 40 * 86400))  # last used 40 days ago
    load(text_parquet, tmp_path, label_column="mood")
    folder, cache = old.parent, str(tmp_path / "cache")
    (folder / "mine.txt").write_text("not fedhet's")
    result = invoke_cache("clean", "--data-dir", cache)
    assert result.exit_code != 0 and "--all, or --unused-days N and/or --stale" in str(result.exception)
    result = invoke_cache("clean", "--unused-days", "30", "--data-dir", cache, input="n\n")
    assert result.exit_code == 1 and "nothing removed" in result.output and old.exists()
    result = invoke_cache("clean", "--unused-days", "30", "--data-dir", cache, input="y\n")
    assert result.exit_code == 0 and not old.exists() and len(list(folder.glob("*.npz"))) == 1
    assert f"removed {old.name} ({saved_images}, " in result.output and "freed " in result.output
    # --stale: a local copy whose files changed can never use its file again
    text_parquet.write_bytes(text_parquet.read_bytes() + b"\n")
    result = invoke_cache("clean", "--stale", "--yes", "--data-dir", cache)
    assert result.exit_code == 0 and not list(folder.glob("*.npz")) and str(text_parquet) in result.output
    load(saved_images, tmp_path)
    result = invoke_cache("clean", "--all", "--yes", "--data-dir", cache)
    assert result.exit_code == 0 and not list(folder.glob("*.npz")) and (folder / "mine.txt").exists()


def test_stale_keeps_what_a_current_dataset_uses(saved_images, tmp_path):
    load(saved_images, tmp_path)
    result = invoke_cache("clean", "--stale", "--yes", "--data-dir", str(tmp_path / "cache"))
    assert result.exit_code == 0 and "nothing to remove" in result.output and prepared_file(tmp_path).exists()


# ----------------------------------------------------------------------------------------------------------
# Issue 44: what was done to the data is said; bad input is one line in fedhet's words


def mixed_images(tmp_path):
    images = [shape_image(0, 0, 10, "RGB"), shape_image(1, 1, 14, "L"), shape_image(2, 2, 10, "RGBA")]
    path = tmp_path / "mixed"
    datasets.Dataset.from_dict({"image": images * 4, "label": [0, 1, 2] * 4}).cast_column(
        "image", datasets.Image()
    ).save_to_disk(str(path))
    return path


def test_mixed_modes_become_rgb_and_the_conversion_is_said_and_recorded(tmp_path):
    ds = load(mixed_images(tmp_path), tmp_path, image_size=10)
    assert ds.x_train.shape[1:] == (3, 10, 10)
    what = ds.provenance()["images"]
    assert what == {
        "mode": "RGB",
        "size": [10, 10],
        "count": 12,
        "source_modes": {"L": 4, "RGB": 4, "RGBA": 4},
        "converted": 8,
        "resized": 4,
    }
    assert ds.extra["notes"] == [
        "dataset 'hf': of its 12 images, 8 converted to RGB (4 L, 4 RGBA; alpha dropped) and 4 resized to 10x10 "
        "(height x width); dataset.image_mode and image_size choose"
    ]
    alpha = load(mixed_images(tmp_path), tmp_path, image_size=10, image_mode="RGBA")
    assert alpha.x_train.shape[1] == 4 and "alpha dropped" not in alpha.extra["notes"][0]
    same = load(saved_images_path(tmp_path), tmp_path)
    assert same.extra["notes"] == [] and same.provenance()["images"]["converted"] == 0


def saved_images_path(tmp_path):
    path = tmp_path / "plain"
    if not path.exists():
        datasets.DatasetDict({"train": image_dataset(12), "test": image_dataset(6)}).save_to_disk(str(path))
    return path


def test_a_run_says_what_was_done_to_the_images_and_records_it(tmp_path):
    raw = hf_run(tmp_path, mixed_images(tmp_path), dataset={"image_size": 10}, model={"name": "mlp", "hidden": [8]})
    raw["run"]["rounds"] = 1
    result = fedhet.run(raw)
    assert any("8 converted to RGB" in w for w in result.summary["warnings"]), result.summary
    data = json.loads((result.run_dir / "provenance.json").read_text())["data"]
    assert data["images"]["mode"] == "RGB" and data["images"]["resized"] == 4


def test_a_table_with_the_default_model_names_the_fix(tmp_path):
    path = tmp_path / "table.csv"
    path.write_text("a,b,label\n" + "".join(f"{i},{i % 7},{i % 2}\n" for i in range(40)))
    cfg = fedhet.make_config(hf_run(tmp_path, path))
    assert cfg.model.name == "cnn"  # task "auto": the kind is known only once the data are read
    with pytest.raises(ConfigError) as info:
        build_federation(cfg)
    assert str(info.value).startswith("model 'cnn' cannot take the inputs of dataset 'hf' (tabular, shape (2,)): ")
    assert "; set -s dataset.task=tabular (its default model is 'mlp') or -m mlp (models that fit: " in str(info.value)


def test_a_readers_error_is_said_once_in_fedhets_line(tmp_path, capfd):
    path = tmp_path / "bad.csv"
    path.write_text("a,label\n1,0\n2,1,5,6\n")
    with pytest.raises(DataError) as info:
        load(path, tmp_path)
    assert str(info.value) == (
        f"dataset 'hf': cannot read the local copy {path}: Error tokenizing data. C error: Expected 2 fields in "
        "line 3, saw 4"
    )
    assert "Failed to read" not in capfd.readouterr().err  # datasets' own logger line is silenced


def test_no_rows_missing_labels_and_one_class_folders_are_said_in_fedhets_words(tmp_path):
    header_only = tmp_path / "empty.csv"
    header_only.write_text("a,label\n")
    datasets.Dataset.from_dict({"a": [1.0], "label": [0]}).select([]).to_parquet(str(tmp_path / "empty.parquet"))
    with pytest.raises(DataError, match=rf"^dataset 'hf': the local copy {header_only} has no rows$"):
        load(header_only, tmp_path)
    with pytest.raises(DataError, match=r"^dataset 'hf': the local copy .*empty.parquet has no rows$"):
        load(tmp_path / "empty.parquet", tmp_path)
    rows = datasets.Dataset.from_dict({"a": [1.0, 2.0, 3.0], "label": [0, 1, 0]})
    datasets.DatasetDict({"train": rows.select([]), "test": rows}).save_to_disk(str(tmp_path / "no_train"))
    with pytest.raises(DataError, match=r"^dataset 'hf': the local copy .*no_train has no rows in split 'train'$"):
        load(tmp_path / "no_train", tmp_path)
    datasets.DatasetDict({"train": rows, "test": rows.select([])}).save_to_disk(str(tmp_path / "no_test"))
    with pytest.raises(DataError, match=r"^dataset 'hf': the local copy .*no_test has no rows in split 'test'$"):
        load(tmp_path / "no_test", tmp_path)
    in_memory = datasets.DatasetDict({"train": rows, "test": rows.select([])})  # a hub dataset's empty split
    with pytest.raises(DataError, match=r"the test split 'test' has no rows; set dataset.test_split=none to hold out"):
        huggingface.splits(in_memory, huggingface.HFParams(path="x"))
    nan = tmp_path / "nan.csv"
    nan.write_text("a,label\n1,0\n2,\n3,1\n4,\n5,1\n")
    with pytest.raises(DataError) as info:
        load(nan, tmp_path)
    assert str(info.value) == (
        "dataset 'hf': label column 'label' has 2 missing label(s) in the training split (empty or NaN; the first in "
        "row 1, counting from 0); fill them in or drop those rows first"
    )
    folder = tmp_path / "cats" / "cat"
    folder.mkdir(parents=True)
    for i in range(4):
        shape_image(0, i).save(folder / f"{i}.png")
    with pytest.raises(DataError, match=r"gives no labels: its images are all in one folder, 'cat'; a classifier "):
        load(tmp_path / "cats", tmp_path)
    one = tmp_path / "one.csv"
    one.write_text("a,label\n1,3\n2,3\n3,3\n")
    with pytest.raises(DataError, match=r"label column 'label' holds 1 class\(es\) \(3\); a classifier needs at least"):
        load(one, tmp_path)


def test_an_image_column_that_holds_no_images_is_one_line(saved_images, tmp_path):
    with pytest.raises(DataError) as info:
        load(saved_images, tmp_path, image_column="label")
    assert str(info.value) == (
        "dataset 'hf': column 'label' (dataset.image_column) holds ClassLabel values, not images (an Image column, "
        "or file paths or bytes); its Image columns: image"
    )
    with pytest.raises(DataError, match=r"column 'writer' \(dataset.image_column\), training sample 0: unreadable"):
        load(saved_images, tmp_path, image_column="writer", label_column="label")


def test_a_label_column_of_lists_is_refused_naming_it(tmp_path):
    path = tmp_path / "lists.parquet"
    datasets.Dataset.from_dict({"a": [1.0, 2, 3, 4], "tags": [[0], [1], [0, 1], [1]]}).to_parquet(str(path))
    with pytest.raises(DataError, match=r"^dataset 'hf': label column 'tags' holds lists \(several labels per sample"):
        load(path, tmp_path, label_column="tags")


def test_images_too_large_for_memory_are_refused_before_any_is_decoded(saved_images, tmp_path, monkeypatch):
    monkeypatch.setattr(huggingface, "images", lambda *a: pytest.fail("decoded"))
    with pytest.raises(DataError) as info:
        load(saved_images, tmp_path, image_size=100000)  # 120 images of 10^10 pixels: 6 TB
    message = str(info.value)
    assert message.startswith("dataset 'hf': 120 images of 1 x 100000 x 100000 values (dataset.image_size) need 6 TB")
    assert "; set a smaller dataset.image_size" in message
    from fedhet import machine

    monkeypatch.setattr(machine, "host_memory", lambda: (10**9, "available (a test)"))
    with pytest.raises(DataError, match=r"need 2.4 GB in memory \(uint8 arrays and their float32 copy\), but this "):
        load(saved_images, tmp_path, image_size=2000)

"""Saved partitions (data/partition_file.py): `fedhet partition --save`, fedhet.save_partition / load_partition, and
partition.name = "file", checked against the data a run splits."""

from __future__ import annotations

import json
import re
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch

import fedhet
from fedhet.data.partition import partition
from fedhet.data.partition_file import FORMAT, SavedPartition
from fedhet.data.types import DataError
from fedhet.engine.training import build_federation
from fedhet.errors import ConfigError

DIGITS = {"dataset": {"name": "digits"}, "partition": {"name": "dirichlet", "num_clients": 4, "min_size": 20}}


def config(**partition):
    return fedhet.make_config({**DIGITS, "partition": {**DIGITS["partition"], **partition}})


def from_file(path, **partition):
    return fedhet.make_config(
        {**DIGITS, "partition": {"name": "file", "path": str(path), "num_clients": 4, **partition}}
    )


def same_clients(a, b) -> bool:
    pairs = zip(a.clients, b.clients, strict=True)
    return all(torch.equal(x.y, y.y) and torch.equal(x.x, y.x) for x, y in pairs)


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "clients.json"
    return path, fedhet.save_partition(DIGITS, path, seed=3)


def test_the_file_holds_each_clients_indices_the_fingerprint_and_the_settings(saved):
    path, made = saved
    obj = json.loads(path.read_text())
    assert obj["format"] == FORMAT and obj["version"] == 1
    assert obj["dataset"]["name"] == "digits" and obj["dataset"]["samples"] == 1347
    assert obj["made_by"]["partition"]["alpha"] == 0.5 and obj["made_by"]["seed"] == 3  # defaults are written out
    assert [c["train"] for c in obj["clients"]] == [p.tolist() for p in made.train]
    assert "test" not in obj["clients"][0]  # local_test 'split' deals nothing from the test set
    again = fedhet.load_partition(path)
    assert all(np.array_equal(a, b) for a, b in zip(again.train, made.train, strict=True))
    assert again.dataset == made.dataset and again.made_by == made.made_by


def test_a_run_on_the_file_gets_the_clients_it_was_saved_from(saved):
    path, _ = saved
    original = build_federation(fedhet.make_config(DIGITS, seed=3))
    assert same_clients(build_federation(from_file(path)), original)
    assert same_clients(build_federation(from_file(path, seed=9)), original)  # the seed no longer moves samples


def test_matched_local_test_sets_are_saved_and_used(tmp_path):
    path = tmp_path / "matched.json"
    made = fedhet.save_partition(config(local_test="matched"), path)
    assert made.test is not None and all(len(t) for t in made.test)
    fed = build_federation(from_file(path))
    original = build_federation(config(local_test="matched"))
    assert all(torch.equal(a.y_test, b.y_test) for a, b in zip(fed.clients, original.clients, strict=True))
    with pytest.raises(ConfigError, match=r"holds each client's local test samples .*local_test_fraction=0"):
        build_federation(from_file(path, local_test_fraction=0.2))


def test_a_fedhet_run_trains_on_a_saved_partition(saved, tmp_path):
    path, made = saved
    raw = {**DIGITS, "partition": {"name": "file", "path": str(path), "num_clients": 4}}
    result = fedhet.run(
        raw, {"run.progress": False, "run.workers": 1}, rounds=1, out=str(tmp_path / "runs"), model="mlp"
    )
    assert result.config["partition"]["path"] == str(path)
    assert result.final["test_acc"] > 0


def rewrite(path, change) -> None:
    obj = json.loads(path.read_text())
    change(obj)
    path.write_text(json.dumps(obj))


@pytest.mark.parametrize(
    "change, settings, message",
    [
        (None, {"num_clients": 5}, r"holds 4 clients, and partition.num_clients is 5; set partition.num_clients=4$"),
        (lambda o: o["clients"][1]["train"].append(1347), {}, r"client 1's train index 1347 is outside 0 to 1346$"),
        (lambda o: o["clients"][2]["train"].append(-1), {}, r"client 2's train index -1 is outside 0 to 1346$"),
        (
            lambda o: o["clients"][3]["train"].append(o["clients"][0]["train"][0]),
            {},
            r"train sample \d+ is in client 0 and client 3; set partition.allow_overlap=true if clients may share",
        ),
        (None, {"train_fraction": 0.5}, r"made from dataset.train_fraction 1.0, and this run has 0.5; its indices"),
        (None, {"classes": [0, 1]}, r"made from dataset.classes None, and this run has \[0, 1\]; its indices"),
        (lambda o: o["dataset"].update(sha256="0" * 64), {}, r"made from data \(sha256\) '0000.*and this run has"),
        (lambda o: o["clients"][0]["train"].append(2.5), {}, r"client 0: \"train\" must be a list of whole-number"),
        (lambda o: o.update(version=2), {}, r"partition file version 2; this fedhet reads 1$"),
        (lambda o: o.pop("format"), {}, r"not a fedhet partition file \(no \"format\": \"fedhet-partition\""),
    ],
)
def test_a_file_that_does_not_fit_the_run_is_one_line(saved, change, settings, message):
    path, _ = saved
    if change is not None:
        rewrite(path, change)
    dataset = {f"dataset.{k}": settings.pop(k) for k in ("train_fraction", "classes") if k in settings}
    cfg = from_file(path, **settings)
    if dataset:
        cfg = fedhet.make_config(cfg, dataset)
    with pytest.raises((DataError, ConfigError)) as info:
        build_federation(cfg)
    assert "\n" not in str(info.value)
    assert re.search(message, str(info.value)), str(info.value)


def test_overlap_is_accepted_when_allowed(saved):
    path, made = saved
    rewrite(path, lambda o: o["clients"][3]["train"].extend(o["clients"][0]["train"][:5]))
    fed = build_federation(from_file(path, allow_overlap=True))
    assert len(fed.clients[3].y) == len(made.train[3]) + 5


def test_other_labels_are_refused_by_the_partitioner_itself(saved):
    path, made = saved
    labels = np.zeros(1347, np.int64)
    with pytest.raises(DataError, match=r"made from 1347 samples of dataset 'digits' with other labels than the 1347"):
        partition("file", labels, 4, 0, path=str(path))


@pytest.mark.parametrize(
    "text, message",
    [
        ("{", r"not a partition file fedhet can read \(JSONDecodeError"),
        ("[" * 100_000, r"not a partition file fedhet can read \(RecursionError"),
        ("[]", r"not a fedhet partition file"),
    ],
)
def test_an_unreadable_file_is_one_line_naming_it(tmp_path, text, message):
    path = tmp_path / "p.json"
    path.write_text(text)
    with pytest.raises(DataError, match=rf"^{path}: {message}"):
        SavedPartition.load(path)


def test_a_missing_file_names_the_setting(tmp_path):
    with pytest.raises(ConfigError, match=r"partition.path.*does not exist"):
        build_federation(from_file(tmp_path / "nope.json"))


# ---------------------------------------------------------------------------------------------------------- the CLI


def fedhet_cli(monkeypatch, capsys, *args) -> tuple[int, str, str]:
    from fedhet.cli import main

    monkeypatch.setattr(sys, "argv", ["fedhet", *map(str, args)])
    with pytest.raises(SystemExit) as info:
        main()
    out = capsys.readouterr()
    return info.value.code, out.out, out.err


def test_partition_save_writes_a_file_a_second_command_reads(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "200")
    path, plot = tmp_path / "split.json", tmp_path / "p.png"
    common = ["partition", "-d", "digits", "-n", "4", "--plot", plot]
    code, first, err = fedhet_cli(monkeypatch, capsys, *common, "-s", "partition.min_size=20", "--save", path)
    assert code == 0, err
    assert f"partition: {path}" in first
    assert len(fedhet.load_partition(path).train) == 4
    code, second, err = fedhet_cli(monkeypatch, capsys, *common, "-p", "file", "-s", f"partition.path={path}")
    assert code == 0, err
    table = [line for line in first.splitlines() if line.startswith("│")]
    assert table == [line for line in second.splitlines() if line.startswith("│")]


def test_partition_save_refuses_a_folder(tmp_path, monkeypatch, capsys):
    code, _, err = fedhet_cli(monkeypatch, capsys, "partition", "-d", "digits", "--save", tmp_path)
    assert code == 2 and err.startswith("error: --save") and "is a folder" in err


def test_the_table_heads_class_columns_with_the_class_names(tmp_path, monkeypatch, capsys):
    from fedhet.engine import training

    real = training.load_data
    names = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    monkeypatch.setattr(training, "load_data", lambda cfg: replace(real(cfg), class_names=names))
    monkeypatch.setenv("COLUMNS", "250")
    args = ["partition", "-d", "digits", "-n", "3", "-s", "partition.min_size=20", "--plot", tmp_path / "p.png"]
    code, out, err = fedhet_cli(monkeypatch, capsys, *args)
    assert code == 0, err
    header = next(line for line in out.splitlines() if "client" in line)
    assert all(name in header for name in names)

"""Flower Datasets' partitioners by name (partition.name = "flwr.<name>"): the same clients as flwr-datasets itself,
validated parameters, one-line errors, and runs on any dataset fedhet loads."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

pytest.importorskip("flwr_datasets")

import fedhet  # noqa: E402
from fedhet.data import flwr_partition  # noqa: E402
from fedhet.data.partition import PARTITIONERS, partition  # noqa: E402
from fedhet.data.types import DataError  # noqa: E402
from fedhet.errors import ConfigError, FedhetWarning  # noqa: E402

SEED = 7
# 600 samples of 6 classes (uneven sizes), 10 natural ids (uneven sizes)
LABELS = np.random.default_rng(1).choice(6, size=600, p=[0.3, 0.2, 0.15, 0.15, 0.1, 0.1])
GROUPS = np.random.default_rng(2).choice(10, size=600)

# every included partitioner: (fedhet's parameters, the number of clients, flwr-datasets' own constructor call)
CASES = {
    "iid": ({}, 5, lambda p: p.IidPartitioner(num_partitions=5)),
    "dirichlet": (
        {"alpha": 0.3, "min_partition_size": 5, "self_balancing": True},
        5,
        lambda p: p.DirichletPartitioner(
            num_partitions=5, partition_by="label", alpha=0.3, min_partition_size=5, self_balancing=True, seed=SEED
        ),
    ),
    "inner_dirichlet": (
        {"alpha": 0.5},
        4,
        lambda p: p.InnerDirichletPartitioner(
            partition_sizes=[150, 150, 150, 150], partition_by="label", alpha=0.5, seed=SEED
        ),
    ),
    "shard": (
        {"num_shards_per_partition": 3},
        5,
        lambda p: p.ShardPartitioner(num_partitions=5, partition_by="label", num_shards_per_partition=3, seed=SEED),
    ),
    "pathological": (
        {"num_classes_per_partition": 2, "class_assignment_mode": "first-deterministic"},
        6,
        lambda p: p.PathologicalPartitioner(
            num_partitions=6,
            partition_by="label",
            num_classes_per_partition=2,
            class_assignment_mode="first-deterministic",
            seed=SEED,
        ),
    ),
    "distribution": (
        {"distribution_array": [[1, 2]] * 6, "num_unique_labels_per_partition": 2},
        6,
        lambda p: p.DistributionPartitioner(
            distribution_array=np.array([[1, 2]] * 6, float),
            num_partitions=6,
            num_unique_labels_per_partition=2,
            partition_by="label",
            preassigned_num_samples_per_label=0,
            seed=SEED,
        ),
    ),
    "linear": ({}, 4, lambda p: p.LinearPartitioner(num_partitions=4)),
    "square": ({}, 4, lambda p: p.SquarePartitioner(num_partitions=4)),
    "exponential": ({}, 3, lambda p: p.ExponentialPartitioner(num_partitions=3)),
    "size": ({"partition_sizes": [100, 200, 250]}, 3, lambda p: p.SizePartitioner(partition_sizes=[100, 200, 250])),
    "natural_id": ({}, 10, lambda p: p.NaturalIdPartitioner(partition_by="natural_id")),
    "grouped_natural_id": (
        {"group_size": 3, "sort_unique_ids": True},
        4,
        lambda p: p.GroupedNaturalIdPartitioner(partition_by="natural_id", group_size=3, sort_unique_ids=True),
    ),
}


def test_every_case_is_a_registered_partitioner_and_back():
    assert sorted(CASES) == sorted(s.name for s in flwr_partition.SCHEMES)
    assert {f"flwr.{name}" for name in CASES} <= set(PARTITIONERS.names())


def flwr_own_split(make, tmp_path) -> list[list[int]]:
    """The clients' sample positions as a flwr-datasets user gets them: FederatedDataset over a parquet file of the
    labels, natural ids and positions, with the same seed."""
    import datasets
    from flwr_datasets import FederatedDataset
    from flwr_datasets import partitioner as module

    path = tmp_path / "data.parquet"
    columns = {"label": LABELS, "index": np.arange(len(LABELS)), "natural_id": GROUPS}
    datasets.Dataset.from_dict(columns).to_parquet(str(path))
    p = make(module)
    fds = FederatedDataset(
        dataset="parquet",
        data_files={"train": str(path)},
        partitioners={"train": p},
        seed=SEED,
        cache_dir=str(tmp_path),
    )
    first = sorted(fds.load_partition(0)["index"])  # the partitioner gets its data here
    return [first] + [sorted(fds.load_partition(i)["index"]) for i in range(1, p.num_partitions)]


@pytest.mark.parametrize("name", sorted(CASES))
def test_clients_equal_flower_datasets_own_split(name, tmp_path):
    params, clients, make = CASES[name]
    ours = partition(f"flwr.{name}", LABELS, clients, SEED, groups=GROUPS, **params)
    theirs = flwr_own_split(make, tmp_path)
    assert [part.tolist() for part in ours] == theirs
    assert all(part.dtype == np.int64 for part in ours)


def test_size_partitioners_follow_their_shapes_by_hand():
    # linear: shares 1:2:3:4 of 600 = 60, 120, 180, 240; square 1:4:9:16 of 600 = 20, 80, 180, 320
    assert [len(p) for p in partition("flwr.linear", LABELS, 4, SEED)] == [60, 120, 180, 240]
    assert [len(p) for p in partition("flwr.square", LABELS, 4, SEED)] == [20, 80, 180, 320]
    parts = partition("flwr.iid", LABELS, 4, SEED)
    assert sorted(np.concatenate(parts).tolist()) == list(range(600)) and [len(p) for p in parts] == [150] * 4


def test_the_partition_seed_and_the_shuffle_change_the_clients():
    a, b = (partition("flwr.iid", LABELS, 3, s) for s in (0, 1))
    assert any(not np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    unshuffled = partition("flwr.iid", LABELS, 3, 0, shuffle=False)
    assert [p.tolist() for p in unshuffled] == [list(range(0, 200)), list(range(200, 400)), list(range(400, 600))]


@pytest.mark.parametrize(
    "name, params, clients, message",
    [
        ("flwr.dirichlet", {"alpha": 0}, 5, r"^partitioner 'flwr.dirichlet': alpha: .*greater than 0"),
        ("flwr.dirichlet", {"alpa": 0.1}, 5, r"unknown key 'partition.alpa'.*did you mean 'partition.alpha'"),
        ("flwr.dirichlet", {"alpha": [0.5, 0.5]}, 5, r"alpha holds 2 values; give one per client \(5\)"),
        ("flwr.shard", {"num_shards_per_partition": 0}, 5, r"num_shards_per_partition: .*greater than or equal to 1"),
        ("flwr.shard", {"num_shards_per_partition": None}, 5, r"set num_shards_per_partition or shard_size"),
        ("flwr.size", {"partition_sizes": [10, 10]}, 3, r"partition_sizes holds 2 sizes; give one per client \(3\)"),
        ("flwr.size", {"partition_sizes": [10, 0, 10]}, 3, r"every size must be at least 1"),
        ("flwr.size", {}, 3, r"partition_sizes: .*required"),
        ("flwr.size", {"partition_sizes": [500, 500, 1]}, 3, r"sum to 1001, more than the 600 samples"),
        ("flwr.pathological", {"class_assignment_mode": "rand"}, 3, r"class_assignment_mode: .*'random'"),
        (
            "flwr.pathological",
            {"num_classes_per_partition": 7},
            3,
            r"`num_classes_per_partition`=7 is greater than the number of unique classes in the given dataset=6",
        ),
        ("flwr.natural_id", {}, 4, r"makes 10 clients from this dataset.*set partition.num_clients=10"),
        ("flwr.distribution", {"distribution_array": [[1, 2]] * 6}, 5, r"num_clients=5 must be a multiple of the 6"),
        (
            "flwr.distribution",
            {"distribution_array": [[1, 2]] * 5},
            6,
            r"must be 6 x 2 \(one row per class.*not 5 x 2$",
        ),
        ("flwr.distribution", {"distribution_array": [[1, -2]]}, 5, r"values must be finite and 0 or more"),
        ("flwr.exponential", {}, 12, r"partitions sizes that are not greater than 0"),
        (
            "flwr.iid",
            {},
            601,
            r"^partitioner 'flwr.iid': 601 clients but only 600 samples to split \(fewer samples than clients\); use "
            r"at most 600 clients$",
        ),
        (
            "flwr.shard",
            {"num_shards_per_partition": 200},
            5,
            r"^partitioner 'flwr.shard': 5 clients x num_shards_per_partition=200 = 1000 shards, more than the 600 "
            r"samples \(a shard holds at least one\)",
        ),
        (
            "flwr.shard",
            {"num_shards_per_partition": None, "shard_size": 200},
            5,
            r"^partitioner 'flwr.shard': shard_size=200 cuts the 600 samples into 3 shards, fewer than the 5 clients; "
            r"use a shard_size of at most 120 or at most 3 clients$",
        ),
        (
            "flwr.shard",
            {"shard_size": 100},
            5,
            r"^partitioner 'flwr.shard': 5 clients x num_shards_per_partition=2 x shard_size=100 = 1000 samples, more "
            r"than the 600",
        ),
        (
            "flwr.dirichlet",
            {"min_partition_size": 200},
            5,
            r"^partitioner 'flwr.dirichlet': 5 clients x min_partition_size=200 = 1000 samples, more than the 600 "
            r"there are; use fewer clients or a min_partition_size of at most 120$",
        ),
        (
            "flwr.dirichlet",
            {"alpha": 0.05, "min_partition_size": 110},
            5,
            r"^partitioner 'flwr.dirichlet': none of flwr-datasets' 11 draws at alpha=0.05 gave each of the 5 clients "
            r"min_partition_size=110 samples; use a larger alpha",
        ),
    ],
)
def test_bad_parameters_are_one_line_naming_what_is_valid(name, params, clients, message):
    with pytest.raises((ConfigError, DataError), match=message) as info:
        partition(name, LABELS, clients, SEED, groups=GROUPS, **params)
    assert "\n" not in str(info.value)


def test_natural_ids_are_needed_by_the_natural_id_partitioners():
    with pytest.raises(DataError, match=r"'flwr.natural_id' needs a dataset with natural ids"):
        partition("flwr.natural_id", LABELS, 10, SEED)


def test_a_missing_class_is_refused_by_inner_dirichlet():
    with pytest.raises(DataError, match=r"needs every class 0 to 1 present.*\[0, 2\]"):
        partition("flwr.inner_dirichlet", np.array([0, 2] * 50), 2, SEED)


def test_flwr_warnings_reach_the_user_once_with_the_name():
    with pytest.warns(UserWarning, match=r"^partitioner 'flwr.size': The sum of partition sizes is 300"):
        partition("flwr.size", LABELS, 3, SEED, partition_sizes=[100, 100, 100])


@pytest.mark.parametrize(
    "clients, hint",
    [
        (2, "with partition.num_clients of at least 6 (the classes), partition.class_assignment_mode="),
        (8, "partition.class_assignment_mode="),
    ],
)
def test_unused_classes_are_one_warning_naming_fedhets_setting(clients, hint):
    labels = np.repeat(np.arange(6), 100)
    with pytest.warns(FedhetWarning) as caught:
        parts = partition("flwr.pathological", labels, clients, 3, num_classes_per_partition=1)
    unused = sorted(set(range(6)) - set(np.concatenate([labels[p] for p in parts]).tolist()))
    assert len(caught) == 1 and unused
    used = 6 - len(unused)
    assert str(caught[0].message) == (
        f"partitioner 'flwr.pathological': classes {', '.join(map(str, unused))} go to no client ({used} of the 6 "
        f"classes are used); {hint}'first-deterministic' uses every class"
    )


def test_the_cli_prints_a_flwr_warning_as_one_line(tmp_config_dir, monkeypatch, capsys):
    import sys

    from fedhet.cli import main

    args = ["partition", "-d", "digits", "-p", "flwr.pathological", "-n", "2", "--plot", "p.png"]
    monkeypatch.setattr(sys, "argv", ["fedhet", *args])
    with pytest.raises(SystemExit) as info:
        main()
    err = capsys.readouterr().err
    assert info.value.code == 0, err
    assert len(err.strip().splitlines()) == 1, err  # no file name, no source line
    assert err.startswith("warning: partitioner 'flwr.pathological': classes ")
    assert "first_class_deterministic_assignment" not in err and "class_assignment_mode=" in err


def test_more_clients_than_samples_on_digits_is_one_line(tmp_config_dir, monkeypatch, capsys):
    import sys

    from fedhet.cli import main

    monkeypatch.setattr(sys, "argv", ["fedhet", "partition", "-d", "digits", "-p", "flwr.iid", "-n", "2000"])
    with pytest.raises(SystemExit) as info:
        main()
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert err.strip() == (
        "error: partitioner 'flwr.iid': 2000 clients but only 1347 samples to split (fewer samples than clients); "
        "use at most 1347 clients"
    )


def test_without_flower_datasets_a_flwr_name_is_one_line_saying_what_to_install(tmp_config_dir, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flwr_datasets" else real(name))
    with pytest.raises(ConfigError) as info:
        fedhet.make_config({"dataset": {"name": "digits"}, "partition": {"name": "flwr.iid"}})
    assert str(info.value) == (
        "partitioner 'flwr.iid': the partitioners flwr.* need Flower Datasets (flwr-datasets): pip install 'fedhet[hf]'"
    )


@pytest.fixture
def tmp_config_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_a_run_on_digits_with_a_flower_partitioner_learns_and_keeps_its_clients(tmp_config_dir):
    raw = {
        "run": {"rounds": 5, "out_dir": "runs", "progress": False, "workers": 1},
        "dataset": {"name": "digits"},
        "partition": {"name": "flwr.pathological", "num_clients": 5, "num_classes_per_partition": 4},
        "model": {"name": "mlp", "hidden": [32]},
        "train": {"local_epochs": 2, "batch_size": 16, "lr": 0.1},
    }
    result = fedhet.run(raw)
    assert result.final["test_acc"] > 0.6, result.final  # 10 classes: chance is 0.1
    from fedhet.data.datasets import load_dataset
    from fedhet.engine.training import build_federation

    fed = build_federation(fedhet.make_config(result.config))
    y = load_dataset("digits").y_train
    expect = partition("flwr.pathological", y, 5, 0, num_classes_per_partition=4)
    assert [len(c.y) for c in fed.clients] == [len(p) for p in expect]
    assert all(len(np.unique(c.y.numpy())) == 4 for c in fed.clients)


def test_fedhet_list_shows_the_flower_partitioners(tmp_config_dir):
    from typer.testing import CliRunner

    from fedhet.cli import app

    out = CliRunner().invoke(app, ["list", "partitioners"], env={"COLUMNS": "250"}).output
    for name in CASES:
        assert f"flwr.{name}" in out
    assert "partition_sizes (required)" in out

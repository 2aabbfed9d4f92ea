"""Results as data (issue 27): the API's DataFrame tells a grid's cells apart, report groups ignore display and
location keys, what clients put in Reply.metrics reaches metrics.jsonl (and client_metrics.jsonl when asked), the
pandas extra exists, and MLflow reads fedhet's store as it is."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from pathlib import Path

import pytest

import fedhet
from fedhet.config import build_config
from fedhet.engine.simulation import RESUMABLE_CHANGES, Simulation, config_changes
from fedhet.results import MetricsLog, group_runs, load_runs, read_json, read_metrics, write_json_atomic
from fedhet.results.report import partition_note

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).parents[1]


def make_run(root, rel, algorithm="fedavg", seed=0, accs=(0.5, 0.6), alpha=0.1, server="sgd", run=None, **algo):
    """A run folder as fedhet writes it (config.json, metrics.jsonl, summary.json), without training."""
    folder = root / rel
    folder.mkdir(parents=True)
    config = {
        "run": {"name": folder.name, "seed": seed, "rounds": len(accs), "out_dir": str(folder.parent), **(run or {})},
        "dataset": {"name": "digits"},
        "partition": {"name": "dirichlet", "alpha": alpha, "num_clients": 10, "seed": None},
        "train": {"lr": 0.05},
        "algorithm": {"name": algorithm, **algo},
        "server": {"name": server},
    }
    write_json_atomic(folder / "config.json", config)
    log = MetricsLog(folder / "metrics.jsonl")
    for rnd, acc in enumerate(accs, start=1):
        log.append({"round": rnd, "test_acc": acc})
    write_json_atomic(folder / "summary.json", {"status": "finished", "rounds_done": len(accs)})
    return folder


# ---- records_dataframe: a grid's cells never merge ----


def test_the_dataframe_names_algorithm_server_seed_every_grid_key_and_the_run_path(tmp_path):
    pytest.importorskip("pandas")
    root = tmp_path / "cmp"
    for alpha in (0.1, 1.0):
        for seed in (0, 1):
            make_run(root, f"alpha{alpha:g}/fedavg-s{seed}", seed=seed, alpha=alpha, accs=(0.5, 0.6 + alpha / 10))
            make_run(root, f"alpha{alpha:g}/fedprox-s{seed}", "fedprox", seed, alpha=alpha, mu=0.01)
        make_run(root, f"alpha{alpha:g}/fedavg+fedadam-s0", server="fedadam", alpha=alpha)
    frame = fedhet.records_dataframe(fedhet.load_runs(root))
    head = ["run", "path", "group", "algorithm", "server", "seed"]
    assert list(frame.columns[:6]) == head
    assert {"partition.alpha", "algorithm.mu"} <= set(frame.columns)
    assert "run.seed" not in frame.columns and "run.name" not in frame.columns  # seed has its column; name is run
    # the cells of the grid share a folder name but not a path, and a groupby keeps the settings apart
    assert frame[frame["run"] == "fedavg-s0"]["path"].nunique() == 2
    finals = frame[frame["round"] == 2].groupby(["algorithm", "server", "partition.alpha"])["test_acc"].agg("count")
    assert finals[("fedavg", "sgd", 0.1)] == 2 and finals[("fedavg", "sgd", 1.0)] == 2
    assert finals[("fedavg", "fedadam", 0.1)] == 1
    assert set(frame[frame["algorithm"] == "fedprox"]["algorithm.mu"]) == {0.01}
    assert frame[frame["algorithm"] == "fedavg"]["algorithm.mu"].isna().all()
    assert sorted(frame["seed"].unique()) == [0, 1]
    # the group column is the row label fedhet report gives: grouping by it gives the report's rows
    labels = [row.label for row in fedhet.report(root)]
    assert sorted(frame["group"].unique()) == sorted(labels) and len(labels) == 6


def test_a_single_runs_dataframe_still_has_the_identifying_columns(tmp_path):
    pytest.importorskip("pandas")
    folder = make_run(tmp_path, "only")
    frame = fedhet.load_run(folder).to_dataframe()
    assert list(frame.columns) == ["run", "path", "group", "algorithm", "server", "seed", "round", "test_acc"]
    assert list(frame["path"]) == [str(folder)] * 2 and set(frame["algorithm"]) == {"fedavg"}


def test_pandas_comes_with_an_extra_that_the_error_names():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert any(req.startswith("pandas") for req in extras["pandas"])
    assert not any(req.startswith("pandas") for req in project["dependencies"])  # fedhet itself runs without it
    assert any(req.startswith("pandas") for req in extras["test"])  # the tests read DataFrames
    # the SQLite MLflow store needs what mlflow-skinny leaves out
    assert {"sqlalchemy", "alembic"} <= {req.split(">")[0].split("<")[0].split("!")[0] for req in extras["trackers"]}


def test_without_pandas_the_error_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pandas", None)  # import pandas raises ImportError
    with pytest.raises(ImportError, match=r"fedhet\[pandas\]"):
        fedhet.records_dataframe([fedhet.load_run(make_run(tmp_path, "r"))])


# ---- fedhet report: display and location keys never define a group ----


@pytest.mark.parametrize(
    "key, value",
    [
        ("progress", False),
        ("workers", 4),
        ("executor", "batched"),
        ("checkpoint_every", 5),
        ("max_empty_rounds", 9),
        ("client_metrics", True),
        ("out_dir", "/elsewhere"),
        ("plugins", ["/x/my_method.py"]),
    ],
)
def test_a_run_that_differs_only_in_a_display_or_location_key_joins_its_group(tmp_path, key, value):
    for seed in (0, 1):
        make_run(tmp_path / "cmp", f"fedavg-s{seed}", seed=seed)
    make_run(tmp_path / "by-hand", "fedavg-s2", seed=2, run={key: value})
    groups = group_runs(load_runs([tmp_path]))
    assert [len(g.runs) for g in groups] == [3] and groups[0].label == "fedavg"
    assert "Repeated seeds" not in (partition_note(groups) or "")


def test_a_seed_run_twice_in_one_group_is_named_under_the_table(tmp_path):
    make_run(tmp_path, "fedavg-s0", seed=0)
    make_run(tmp_path, "fedavg-s1", seed=1)
    make_run(tmp_path, "fedavg-s0-batched", seed=0, run={"executor": "batched"})
    groups = group_runs(load_runs([tmp_path]))
    assert [len(g.runs) for g in groups] == [3]
    note = partition_note(groups)
    assert "Repeated seeds: fedavg (seed 0)" in note and "run.executor" in note


def test_settings_that_change_numbers_still_split_groups(tmp_path):
    make_run(tmp_path, "a", accs=(0.5, 0.6))
    make_run(tmp_path, "b", accs=(0.5, 0.6, 0.7))  # run.rounds
    make_run(tmp_path, "c", run={"device": "cuda"})
    assert len(group_runs(load_runs([tmp_path]))) == 3


# ---- Reply.metrics per round ----


@pytest.fixture
def reported():
    """after_local for FedAvg's clients that also report a value of their own in Reply.metrics, as a plug-in does."""
    from fedhet.algorithms.fedavg import FedAvg

    original = FedAvg.after_local

    def after_local(self, ctx):
        reply = original(self, ctx)
        reply.metrics["grad_norm"] = float(ctx.cid) + 0.5
        return reply

    return after_local


def test_client_metrics_reach_metrics_jsonl_as_mean_min_max_and_weighted_mean(tiny_config, monkeypatch, reported):
    from fedhet.algorithms.fedavg import FedAvg

    monkeypatch.setattr(FedAvg, "after_local", reported)
    sim = Simulation(tiny_config(run={"client_metrics": True}))
    sim.run()
    records = read_metrics(sim.run_dir / "metrics.jsonl")
    lines = read_metrics(sim.run_dir / "client_metrics.jsonl")
    assert [r["round"] for r in records] == [1, 2, 3]
    for record in records:
        mine = [line for line in lines if line["round"] == record["round"]]
        assert len(mine) == record["clients"] == 3 and {line["phase"] for line in mine} == {"train"}
        assert list(mine[0])[:4] == ["round", "phase", "client", "num_examples"]
        norms = [line["grad_norm"] for line in mine]
        assert norms == [line["client"] + 0.5 for line in mine]
        assert record["clients/grad_norm/mean"] == pytest.approx(sum(norms) / 3)
        assert record["clients/grad_norm/min"] == min(norms) and record["clients/grad_norm/max"] == max(norms)
        weights = [line["num_examples"] for line in mine]
        weighted = sum(n * w for n, w in zip(norms, weights, strict=True)) / sum(weights)
        assert record["clients/grad_norm/weighted_mean"] == pytest.approx(weighted)
        # the engine's own train_loss is the example-weighted mean of the same replies
        assert record["clients/train_loss/weighted_mean"] == pytest.approx(record["train_loss"], rel=1e-12)
        # the keys that were there before come first, unchanged: records only gained keys
        assert list(record)[:7] == ["round", "elapsed_s", "lr", "train_loss", "clients", "dropped", "test_acc"]
        assert [k for k in record if k.startswith("clients/")] == list(record)[-12:]


def test_client_metrics_jsonl_is_written_only_when_asked_and_the_setting_may_change_on_resume(tiny_config):
    sim = Simulation(tiny_config())
    sim.run()
    assert not (sim.run_dir / "client_metrics.jsonl").exists()
    assert "clients/train_loss/mean" in read_metrics(sim.run_dir / "metrics.jsonl")[-1]
    assert "run.client_metrics" in RESUMABLE_CHANGES
    old = build_config({}).model_dump(mode="json")
    new = build_config({"run": {"client_metrics": True}}).model_dump(mode="json")
    assert config_changes(old, new) == []
    del old["run"]["client_metrics"]  # a run saved before the setting existed
    assert config_changes(old, new) == []


def test_a_resumed_run_drops_the_client_lines_a_killed_run_wrote_after_its_checkpoint(tiny_config):
    def make(name):
        cfg = tiny_config(run={"client_metrics": True, "rounds": 4})
        cfg.run.name = name
        return cfg

    full = Simulation(make("full"))
    full.run()
    Simulation(make("cut")).run(stop_after=2)
    path = full.run_dir.parent / "cut" / "client_metrics.jsonl"
    MetricsLog(path).append({"round": 3, "phase": "train", "client": 0, "num_examples": 1, "train_loss": -1.0})
    Simulation(make("cut")).run(resume=True)  # the round-3 line above was written after round 2's checkpoint

    def strip(records):
        return [{k: v for k, v in r.items() if k != "elapsed_s"} for r in records]

    assert strip(read_metrics(full.run_dir / "metrics.jsonl")) == strip(read_metrics(path.parent / "metrics.jsonl"))
    assert read_metrics(path) == read_metrics(full.run_dir / "client_metrics.jsonl")


def test_client_metric_stats_name_the_phase_and_never_average_a_nan_away(tiny_config):
    sim = Simulation(tiny_config())
    sim.evaluator.client_reports = {
        "train": {0: (10, {"loss": 1.0, "flag": True, "note": "x"}), 1: (30, {"loss": 3.0})},
        "posterior": {0: (10, {"disc_loss": float("nan")}), 1: (30, {"disc_loss": 2.0})},
    }
    stats = sim.evaluator.client_metric_stats()
    assert stats["clients/loss/mean"] == 2.0 and stats["clients/loss/weighted_mean"] == 2.5
    assert stats["clients/loss/min"] == 1.0 and stats["clients/loss/max"] == 3.0
    assert stats["clients/flag/mean"] == 1.0  # a flag counts as 0 or 1, as over Flower
    assert not any("note" in k for k in stats)  # text is not a measurement
    assert all(math.isnan(stats[f"clients/posterior/disc_loss/{s}"]) for s in ("mean", "min", "max", "weighted_mean"))


# ---- MLflow: a store MLflow reads without extra environment ----


@pytest.fixture
def with_mlflow():
    if importlib.util.find_spec("mlflow") is None:
        (pytest.fail if os.environ.get("CI") else pytest.skip)(
            "needs the trackers extra: pip install 'fedhet[trackers]'"
        )


@pytest.mark.slow
def test_mlflow_reads_the_run_back_from_fedhets_default_store_without_extra_environment(
    with_mlflow, tiny_config, tmp_path, monkeypatch
):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)  # a store's artifacts must not land in the working folder
    cfg = tiny_config(tracking={"mlflow": True})
    cfg.run.name = "tracked"
    sim = Simulation(cfg)
    sim.run()
    assert "MLFLOW_ALLOW_FILE_STORE" not in os.environ
    out = Path(cfg.run.out_dir)
    ids = read_json(sim.run_dir / "trackers.json")
    uri = "sqlite:///" + str((out / "mlflow.db").resolve())
    assert ids["mlflow_uri"] == uri and not (tmp_path / "mlruns").exists()

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(ids["mlflow"])
    assert run.info.run_name == "tracked" and run.info.status == "FINISHED"
    records = read_metrics(sim.run_dir / "metrics.jsonl")
    history = [(m.step, m.value) for m in client.get_metric_history(ids["mlflow"], "test_acc")]
    assert history == [(r["round"], r["test_acc"]) for r in records]
    losses = [(m.step, m.value) for m in client.get_metric_history(ids["mlflow"], "clients/train_loss/mean")]
    assert losses == [(r["round"], r["clients/train_loss/mean"]) for r in records]
    with open(client.download_artifacts(ids["mlflow"], "summary.json", str(tmp_path))) as f:
        assert json.load(f)["status"] == "finished"
    assert run.info.artifact_uri.startswith((out / "mlartifacts").resolve().as_uri())


def test_a_resumed_run_finds_its_mlflow_run_in_the_store_it_was_made_in(tmp_path):
    from fedhet.results.trackers import Trackers, default_mlflow_uri

    trackers = Trackers(build_config({}).tracking, tmp_path / "run", tmp_path, "run", print)
    assert trackers.saved_mlflow_uri({}) is None  # a new run: the default store
    assert default_mlflow_uri(tmp_path) == "sqlite:///" + str((tmp_path / "mlflow.db").resolve())
    assert trackers.saved_mlflow_uri({"mlflow": "a1", "mlflow_uri": "sqlite:////x/m.db"}) == "sqlite:////x/m.db"
    # a run tracked before fedhet wrote SQLite stores: its run is in the file store it wrote then
    assert trackers.saved_mlflow_uri({"mlflow": "a1"}) == (tmp_path / "mlruns").resolve().as_uri()

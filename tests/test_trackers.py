"""Experiment trackers (issue 16): each receives the run and the test reads back what it wrote.

Needs the ``trackers`` extra (``make setup`` installs it); the config-error tests run without it.
"""

import importlib.util
import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from fedhet.config import build_config
from fedhet.engine.simulation import Simulation, config_changes
from fedhet.errors import ConfigError
from fedhet.results import read_json, read_metrics
from fedhet.results.trackers import Trackers, preserved_rng, scalars

ALL_ON = {"tensorboard": True, "mlflow": True, "wandb": True}


def without_time(records):
    return [{k: v for k, v in r.items() if k != "elapsed_s"} for r in records]


# ---- config ----


@pytest.mark.parametrize("flag, package", [("tensorboard", "tensorboard"), ("mlflow", "mlflow"), ("wandb", "wandb")])
def test_a_switched_on_tracker_without_its_package_is_a_one_line_config_error(monkeypatch, flag, package):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == package else real(name, *a))
    with pytest.raises(ConfigError) as err:
        build_config({"tracking": {flag: True}})
    message = str(err.value)
    assert f"tracking.{flag}" in message and "fedhet[trackers]" in message and "\n" not in message
    build_config({"tracking": {flag: True}}, runs_here=False)  # checked where a Flower app runs, not here
    build_config({"tracking": {flag: False}})


def test_trackers_are_off_by_default_and_unknown_keys_name_the_valid_ones():
    assert not any(build_config({}).tracking.model_dump()[flag] for flag in ALL_ON)
    with pytest.raises(ConfigError, match=r"unknown key 'tracking.tensorbord'.*valid keys in \[tracking\]"):
        build_config({"tracking": {"tensorbord": True}})


def test_tracking_settings_never_block_a_resume_and_old_runs_without_them_resume():
    old = build_config({}).model_dump(mode="json")
    new = build_config({"tracking": {"mlflow_uri": "file:///elsewhere"}}).model_dump(mode="json")
    assert config_changes(old, new) == []
    del old["tracking"]  # a run saved before [tracking] existed
    assert config_changes(old, new) == []


# ---- never changing a run ----


def test_tracker_calls_leave_the_random_states_as_they_were():
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    expected = random.random(), np.random.rand(), torch.rand(1).item()
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    with preserved_rng():
        random.random(), np.random.rand(3), torch.rand(5)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_scalars_keeps_finite_numbers_only():
    record = {"round": 3, "test_acc": 0.5, "clients": 4, "loss": float("nan"), "x": None, "ok": True, "s": "a"}
    assert scalars(record) == {"test_acc": 0.5, "clients": 4.0}


def test_a_failing_tracker_warns_once_and_the_run_goes_on(tiny_config, tmp_path):
    class Broken:
        name = "broken"

        def log(self, record):
            raise OSError("disk full")

    warnings = []
    trackers = Trackers(build_config({}).tracking, tmp_path, tmp_path, "run", warnings.append)
    trackers.active = [Broken()]
    trackers.log({"round": 1, "test_acc": 0.5})
    trackers.log({"round": 2, "test_acc": 0.6})
    assert trackers.active == [] and len(warnings) == 1 and "disk full" in warnings[0]


# ---- the three trackers receive a run ----


@pytest.fixture
def tracked(tiny_config, tmp_path, monkeypatch):
    missing = [m for m in ("tensorboard", "mlflow", "wandb") if importlib.util.find_spec(m) is None]
    if missing:
        # CI installs the extra (make setup): there a missing tracker is a failure, not a silent skip
        (pytest.fail if os.environ.get("CI") else pytest.skip)(
            f"needs the trackers extra ({', '.join(missing)} missing): pip install 'fedhet[trackers]'"
        )
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))

    def make(name, **tracking):
        cfg = tiny_config(tracking={**ALL_ON, **tracking})
        cfg.run.name = name
        return cfg

    return make


def tensorboard_scalars(run_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)], events


def mlflow_run(out_dir, run_id):
    from mlflow.tracking import MlflowClient

    # fedhet's default store: MLflow's SQLite backend in run.out_dir, which MLflow reads without extra environment
    client = MlflowClient(tracking_uri="sqlite:///" + str((out_dir / "mlflow.db").resolve()))
    return client, client.get_run(run_id)


def wandb_records(out_dir, run_id):
    """(history rows, config, summary) from every offline W&B folder of a run id, read from the .wandb files."""
    from wandb.proto import wandb_internal_pb2

    history, config, summary = [], {}, {}
    files = wandb_files(out_dir, run_id)
    assert files, f"no offline W&B run {run_id} under {out_dir / 'wandb'}"
    for path in files:
        for data in leveldb_log(path.read_bytes()):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            kind = record.WhichOneof("record_type")
            if kind == "history":
                history.append(items(record.history.item))
            elif kind == "config":
                config.update(items(record.config.update))
            elif kind == "summary":
                summary.update(items(record.summary.update))
    return history, config, summary


def wandb_files(out_dir, run_id):
    # offline-run-<time>-<id>, with -1, -2... added when two processes start within the same second
    return sorted((out_dir / "wandb").glob(f"offline-run-*-{run_id}*/run-{run_id}.wandb"))


def items(entries):
    return {entry.key or "/".join(entry.nested_key): json.loads(entry.value_json) for entry in entries}


def leveldb_log(data, block=32768):
    """The records of a .wandb file: a 7-byte ':W&B' header, then LevelDB log records (crc32c, length, type)
    in 32 KiB blocks, a record split over blocks as FIRST, MIDDLE..., LAST pieces."""
    assert data[:4] == b":W&B"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:  # zero padding up to the end of a block
            pos += -pos % block
        elif kind == 1:
            yield chunk
        elif kind in (2, 3):
            pending = (pending if kind == 3 else b"") + chunk
        elif kind == 4:
            yield pending + chunk


@pytest.mark.slow
def test_the_three_trackers_receive_config_metrics_and_summary_and_change_no_number(tracked, tiny_config):
    plain = Simulation(tiny_config())
    plain.run()
    sim = Simulation(tracked("tracked"))
    sim.run()
    records = read_metrics(sim.run_dir / "metrics.jsonl")
    assert without_time(records) == without_time(read_metrics(plain.run_dir / "metrics.jsonl"))
    accs = [(r["round"], r["test_acc"]) for r in records]
    ids = read_json(sim.run_dir / "trackers.json")
    out = sim.run_dir.parent

    tb, events = tensorboard_scalars(sim.run_dir, "test_acc")
    assert [s for s, _ in tb] == [1, 2, 3] and np.allclose([v for _, v in tb], [a for _, a in accs])
    assert {"config/text_summary", "summary/text_summary"} <= set(events.Tags()["tensors"])

    client, run = mlflow_run(out, ids["mlflow"])
    assert run.info.run_name == "tracked" and run.info.status == "FINISHED"
    assert run.data.params["algorithm.name"] == "fedavg" and run.data.params["run.rounds"] == "3"
    history = [(m.step, m.value) for m in client.get_metric_history(ids["mlflow"], "test_acc")]
    assert history == accs
    with open(client.download_artifacts(ids["mlflow"], "summary.json")) as f:
        summary = json.load(f)
    assert summary["status"] == "finished" and summary["final"]["test_acc"] == accs[-1][1]

    rows, config, wsummary = wandb_records(out, ids["wandb"])
    assert [(r["round"], r["test_acc"]) for r in rows] == accs
    assert config["algorithm"]["name"] == "fedavg"
    assert wsummary["status"] == "finished" and wsummary["final/test_acc"] == accs[-1][1]


def test_a_resumed_run_continues_the_same_tracker_runs(tracked, kill_and_resume):
    full, resumed = kill_and_resume(tracked)
    expected = [(r["round"], r["test_acc"]) for r in read_metrics(full.run_dir / "metrics.jsonl")]
    assert expected == [(r["round"], r["test_acc"]) for r in read_metrics(resumed.run_dir / "metrics.jsonl")]
    ids = read_json(resumed.run_dir / "trackers.json")
    out = resumed.run_dir.parent

    tb, _ = tensorboard_scalars(resumed.run_dir, "test_acc")
    assert [s for s, _ in tb] == [1, 2, 3] and np.allclose([v for _, v in tb], [a for _, a in expected])

    client, run = mlflow_run(out, ids["mlflow"])
    assert run.info.status == "FINISHED" and run.info.run_name == "cut"
    assert sorted({(m.step, m.value) for m in client.get_metric_history(ids["mlflow"], "test_acc")}) == expected
    runs = client.search_runs([run.info.experiment_id], filter_string="attributes.run_name = 'cut'")
    assert len(runs) == 1  # one MLflow run for the killed and the resumed process

    rows, _, wsummary = wandb_records(out, ids["wandb"])
    assert len(wandb_files(out, ids["wandb"])) == 2  # one folder per process
    assert sorted({(r["round"], r["test_acc"]) for r in rows}) == expected
    assert wsummary["rounds_done"] == 3


def test_a_flower_run_logs_to_the_trackers_too(tracked):
    pytest.importorskip("flwr")
    from fedhet.flower.app import RunOptions, run_server
    from fedhet.flower.client import make_client_app
    from fedhet.flower.loopback import LoopbackGrid

    cfg = tracked("flower", tensorboard=True, mlflow=False, wandb=False)
    cfg.partition.num_clients = 4
    grid = LoopbackGrid(make_client_app(lambda _: cfg), {101: {"partition-ids": "0,1"}, 202: {"partition-ids": "2-3"}})
    run_server(grid, cfg, RunOptions())
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    expected = [(r["round"], r["test_acc"]) for r in read_metrics(run_dir / "metrics.jsonl")]
    tb, _ = tensorboard_scalars(run_dir, "test_acc")
    assert [s for s, _ in tb] == [1, 2, 3] and np.allclose([v for _, v in tb], [a for _, a in expected])

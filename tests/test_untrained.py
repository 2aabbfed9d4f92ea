"""A run that did not train never ends "finished", and the run folder's records are checked at resume (issue 26)."""

from __future__ import annotations

import errno
import json
import subprocess
import sys

import pytest
import torch

from fedhet.engine import runfolder, simulation
from fedhet.engine.simulation import Simulation
from fedhet.errors import DiskFull, RunFailed
from fedhet.results import store
from fedhet.results.report import load_runs, summary_table, table_cells
from fedhet.results.store import read_metrics


def summary_of(sim: Simulation) -> dict:
    return json.loads((sim.run_dir / "summary.json").read_text())


# ------------------------------------------------------------------ runs that did not train
@pytest.mark.slow
def test_a_run_shorter_than_the_empty_limit_whose_every_round_is_empty_fails(tmp_path):
    """The issue's command: two rounds, every client dropped, max_empty_rounds (3) never reached."""
    args = ["run", "-d", "digits", "-m", "mlp", "-p", "iid", "-n", "4", "-r", "2", "-o", str(tmp_path)]
    args += ["-s", "train.lr=10000", "-s", "run.progress=false"]
    proc = subprocess.run([sys.executable, "-m", "fedhet.cli", *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("failed: no client finished any of the run's 2 round(s), so nothing trained")
    (path,) = tmp_path.glob("fedavg-digits-iid-s0*/summary.json")  # the name may carry a hash of the settings
    summary = json.loads(path.read_text())
    assert summary["status"] == "failed" and summary["empty_rounds"] == 2
    assert "2 of 2 round(s) had no client finish" in summary["warnings"][0]


def test_a_run_with_some_empty_rounds_finishes_and_says_how_many(tiny_config, monkeypatch):
    cfg = tiny_config(run={"name": "gaps", "rounds": 4, "max_empty_rounds": 3})
    sim = Simulation(cfg)
    real = sim.executor.run_phase

    def run_phase(rnd, phase_idx, phase, msgs):
        replies, failures = real(rnd, phase_idx, phase, msgs)
        return ({}, failures) if rnd in (2, 4) else (replies, failures)  # rounds 2 and 4 lose every client

    monkeypatch.setattr(sim.executor, "run_phase", run_phase)
    summary = sim.run()
    assert summary["status"] == "finished" and summary["empty_rounds"] == 2
    assert summary["warnings"] == [
        "2 of 4 round(s) had no client finish (a phase lost every client); the model did not change in those rounds"
    ]
    rows = summary_table([group for group in _groups(sim)])
    header, cells = table_cells(rows)
    assert cells[0][header.index("empty rounds")] == "2" and "failed" not in header


def _groups(sim):
    from fedhet.results.report import group_runs

    return group_runs(load_runs([sim.run_dir]))


def test_a_phase_of_a_two_phase_method_that_loses_every_client_makes_the_round_empty(tiny_config, monkeypatch):
    cfg = tiny_config(run={"name": "ufo", "rounds": 2}, algorithm={"name": "fedufo", "disc_epochs": 0})
    sim = Simulation(cfg)
    assert sim.algo.phases == ("prior", "posterior")
    real = sim.executor.run_phase

    def run_phase(rnd, phase_idx, phase, msgs):
        replies, failures = real(rnd, phase_idx, phase, msgs)
        return ({}, failures) if phase == "posterior" else (replies, failures)

    monkeypatch.setattr(sim.executor, "run_phase", run_phase)
    with pytest.raises(RunFailed, match=r"any of the run's 2 round\(s\) \(phase posterior lost every client\)"):
        sim.run()
    assert summary_of(sim)["status"] == "failed"


def test_a_run_on_almost_no_data_says_so_in_its_summary(tiny_config, capsys):
    cfg = tiny_config(
        run={"name": "tiny", "rounds": 1}, dataset={"train_fraction": 1e-9}, partition={"name": "iid", "num_clients": 4}
    )
    summary = Simulation(cfg).run()
    assert summary["status"] == "finished"
    (note,) = summary["warnings"]
    assert "hold 10 training samples in all (dataset.train_fraction=1e-09)" in note and "almost nothing" in note
    assert "almost nothing" in capsys.readouterr().err


def test_many_small_clients_are_not_called_almost_no_data(tiny_config):
    """200 digits clients hold about 7 samples each, under one batch of 16: each trains on a short batch, and the
    federation as a whole trains on all 1,347 samples (such a central-DP run reaches 72 %), so no warning."""
    cfg = tiny_config(partition={"name": "iid", "num_clients": 200}, train={"participation": 0.5, "batch_size": 16})
    sim = Simulation(cfg)
    assert sum(len(c.y) for c in sim.fed.clients) < 200 * 16
    assert sim.health.start_notes() == []


def test_a_personalised_run_says_how_many_clients_never_trained(tiny_config):
    cfg = tiny_config(
        run={"name": "per", "rounds": 1},
        partition={"local_test_fraction": 0.2},
        train={"clients_per_round": 2},
        algorithm={"name": "fedper"},
    )
    summary = Simulation(cfg).run()
    assert summary["warnings"] == [
        "4 of 6 clients never trained: they have no personalised model and are not in the personalised accuracy"
    ]


def test_a_client_without_training_samples_is_dropped_not_hung():
    from fedhet.toolkit.local import batch_indices

    with pytest.raises(ValueError, match="no training samples"):
        next(batch_indices(0, 16, 1, torch.Generator()))


def test_compare_counts_a_cell_that_did_not_train_as_failed(tmp_path):
    import fedhet

    base = {
        "run": {"rounds": 2, "out_dir": str(tmp_path), "progress": False, "workers": 1},
        "dataset": {"name": "digits"},
        "partition": {"name": "iid", "num_clients": 4},
        "model": {"name": "mlp"},
    }
    with pytest.raises(RunFailed, match="1 of 2 runs failed"):
        fedhet.compare(base, variants=["fedavg"], grid={"train.lr": [10000, 0.05]}, jobs=1)


# ------------------------------------------------------------------ metrics.jsonl and provenance.json at resume
@pytest.mark.parametrize("how", ["deleted", "emptied", "one record missing", "edited"])
def test_a_damaged_metrics_log_is_rebuilt_from_the_checkpoint(tiny_config, capsys, how):
    full = Simulation(tiny_config(run={"name": "full", "rounds": 4}))
    full.run()
    Simulation(tiny_config(run={"name": "cut", "rounds": 4})).run(stop_after=3)
    path = full.run_dir.parent / "cut" / "metrics.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    if how == "deleted":
        path.unlink()
    elif how == "emptied":
        path.write_text("")
    elif how == "one record missing":
        path.write_text("".join(lines[:1] + lines[2:]))
    else:
        path.write_text(lines[0].replace('"round": 1', '"round": 1, "test_acc": 0.99, "x": 0') + "".join(lines[1:]))
    capsys.readouterr()
    resumed = Simulation(tiny_config(run={"name": "cut", "rounds": 4}))
    resumed.run(resume=True)
    assert "rebuilt from the checkpoint's 3 record(s) up to round 3" in capsys.readouterr().err
    assert read_metrics(path) == [
        {**r, "elapsed_s": r2["elapsed_s"]}
        for r, r2 in zip(read_metrics(full.run_dir / "metrics.jsonl"), read_metrics(path), strict=True)
    ]
    assert summary_of(resumed)["best_test_acc"] == summary_of(full)["best_test_acc"]


def test_an_intact_metrics_log_resumes_without_a_word(tiny_config, capsys):
    Simulation(tiny_config(run={"name": "cut", "rounds": 4})).run(stop_after=2)
    capsys.readouterr()
    Simulation(tiny_config(run={"name": "cut", "rounds": 4})).run(resume=True)
    assert "warning" not in capsys.readouterr().err


@pytest.mark.parametrize("content", ["{x", "[]", '{"resumes": 3}', None])
def test_a_damaged_provenance_file_is_rewritten_with_a_warning(tiny_config, capsys, content):
    sim = Simulation(tiny_config(run={"name": "cut", "rounds": 3}))
    sim.run(stop_after=2)
    path = sim.run_dir / "provenance.json"
    if content is None:
        path.unlink()
    else:
        path.write_text(content)
    capsys.readouterr()
    summary = Simulation(tiny_config(run={"name": "cut", "rounds": 3})).run(resume=True)
    assert summary["status"] == "finished"
    err = capsys.readouterr().err
    assert "provenance.json" in err and "rewritten" in err and "Traceback" not in err
    info = json.loads(path.read_text())
    assert info["rewritten_at_round"] == 2 and info["resumes"] == []


# ------------------------------------------------------------------ a full disk
def enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device", kwargs.get("filename"))


@pytest.mark.parametrize("where", ["metrics", "checkpoint", "summary"])
def test_a_full_disk_stops_the_run_in_one_line_and_resume_ends_bit_exact(tiny_config, monkeypatch, where):
    full = Simulation(tiny_config(run={"name": "full", "rounds": 4}))
    full.run()
    sim = Simulation(tiny_config(run={"name": "cut", "rounds": 4}))
    target = sim.run_dir / {"metrics": "metrics.jsonl", "checkpoint": "checkpoints", "summary": "summary.json"}[where]
    real_append, real_write, real_json = (
        store.MetricsLog.append,
        simulation.write_checkpoint,
        runfolder.write_json_atomic,
    )

    def append(self, record):
        if where == "metrics" and record["round"] == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_append(self, record)

    def write(folder, state, rotate=True):
        if where == "checkpoint" and state["round"] == 3:
            raise OSError(errno.ENOSPC, "No space left on device", str(folder / "last.pt"))
        return real_write(folder, state, rotate)

    def write_json(path, obj):
        if where == "summary" and path.name == "summary.json":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_json(path, obj)

    monkeypatch.setattr(store.MetricsLog, "append", append)
    monkeypatch.setattr(simulation, "write_checkpoint", write)
    monkeypatch.setattr(runfolder, "write_json_atomic", write_json)
    with pytest.raises(DiskFull) as caught:
        sim.run()
    message = str(caught.value)
    assert message.startswith("No space left on device") and "\n" not in message
    assert f"fedhet resume {sim.run_dir}" in message
    kept = 4 if where == "summary" else 2
    assert f"round {kept} is safely checkpointed" in message
    if where == "checkpoint":
        assert str(target / "last.pt") in message
    monkeypatch.undo()
    resumed = Simulation(tiny_config(run={"name": "cut", "rounds": 4}))
    resumed.run(resume=True)
    assert summary_of(resumed)["status"] == "finished"
    torch.testing.assert_close(resumed.algo.global_params, full.algo.global_params, rtol=0, atol=0)
    stable = ("round", "test_acc", "test_loss", "train_loss")
    assert [{k: r[k] for k in stable} for r in read_metrics(resumed.run_dir / "metrics.jsonl")] == [
        {k: r[k] for k in stable} for r in read_metrics(full.run_dir / "metrics.jsonl")
    ]


def test_a_full_disk_while_writing_a_client_state_stops_the_run_and_resume_ends_bit_exact(tiny_config, monkeypatch):
    from fedhet.engine import state as state_module

    def make(name):
        return tiny_config(
            run={"name": name, "rounds": 4, "client_state": "disk"},
            partition={"name": "iid", "num_clients": 8},
            model={"name": "logreg"},
            train={"clients_per_round": 4, "batch_size": 8},
            algorithm={"name": "scaffold"},
        )

    full = Simulation(make("full"))
    full.run()
    sim = Simulation(make("cut"))
    real = state_module.write_sealed
    calls = []

    def write(path, obj, magic, **kwargs):
        calls.append(path)
        if len(calls) == 10:  # a client's state in round 3
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, obj, magic, **kwargs)

    monkeypatch.setattr(state_module, "write_sealed", write)
    with pytest.raises(DiskFull, match=r"No space left on device under .*cut in round 3: the run stopped; round 2"):
        sim.run()
    assert summary_of(sim)["status"] == "failed"
    monkeypatch.undo()
    resumed = Simulation(make("cut"))
    resumed.run(resume=True)
    torch.testing.assert_close(resumed.algo.global_params, full.algo.global_params, rtol=0, atol=0)

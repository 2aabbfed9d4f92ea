"""Nothing lost, nothing silently wrong: run folders, client state, checkpoints, failed runs, resuming (issue 10)."""

from __future__ import annotations

import importlib.metadata
import io
import json
import math
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

import fedhet
from fedhet.cli import app
from fedhet.config import saved_run_config
from fedhet.engine import checkpoint, rundir, simulation
from fedhet.engine.checkpoint import CheckpointError, read_checkpoint
from fedhet.engine.simulation import Simulation
from fedhet.errors import ConfigError, RunFailed
from fedhet.results.store import read_metrics

STABLE = ("round", "test_acc", "test_loss", "train_loss", "client_dist_acc")


def stable(sim):
    return [{k: r[k] for k in STABLE} for r in read_metrics(sim.run_dir / "metrics.jsonl")]


def same_run(a: Simulation, b: Simulation) -> None:
    assert stable(a) == stable(b)
    torch.testing.assert_close(a.algo.global_params, b.algo.global_params, rtol=0, atol=0)


def kill_at(sim: Simulation, rnd: int | None, where: str, monkeypatch) -> None:
    """Make ``sim`` die (KeyboardInterrupt, as kill -9 would stop it) inside round ``rnd``'s checkpoint step (None:
    the first checkpoint it writes).

    where: "snapshot" (client states snapshotted, nothing written), "rotate" (prev.pt replaced, last.pt not yet),
    "written" (last.pt written, old snapshots not freed yet)."""
    real_write, real_retain = checkpoint.write_checkpoint, sim.executor.retain
    armed = []

    def write(folder, state, rotate=True):
        if rnd is not None and state["round"] != rnd:
            return real_write(folder, state, rotate)
        armed.append(where == "written")
        if where == "snapshot":
            raise KeyboardInterrupt
        if where == "rotate":
            calls = []
            real_replace = os.replace

            def replace(src, dst):
                calls.append(dst)
                if str(dst).endswith("last.pt"):
                    raise KeyboardInterrupt
                real_replace(src, dst)

            monkeypatch.setattr(checkpoint.os, "replace", replace)
            try:
                return real_write(folder, state, rotate)
            finally:
                monkeypatch.setattr(checkpoint.os, "replace", real_replace)
        return real_write(folder, state, rotate)

    def retain(states):
        if any(armed):
            raise KeyboardInterrupt
        real_retain(states)

    monkeypatch.setattr(simulation, "write_checkpoint", write)
    sim.executor.retain = retain


def disk_scaffold(tiny_config, name, **run):
    return tiny_config(
        run={"name": name, "rounds": 5, "client_state": "disk", **run},
        partition={"name": "iid", "num_clients": 12},
        model={"name": "logreg"},
        train={"clients_per_round": 4, "batch_size": 8},
        algorithm={"name": "scaffold"},
    )


# ------------------------------------------------------------------ 1. run names and --overwrite
@pytest.mark.parametrize("name", ["../x", "/tmp/elsewhere", ".", "..", "a/b", "", " x"])
def test_a_run_name_must_be_a_plain_folder_name(tmp_path, name):
    victim = tmp_path / "x"
    victim.mkdir()
    (victim / "precious.txt").write_text("mine")
    out = tmp_path / "runs"
    result = CliRunner().invoke(
        app, ["run", "-d", "digits", "-o", str(out), "--name", name, "--overwrite", "-s", "run.progress=false"]
    )
    assert isinstance(result.exception, ConfigError), result.output
    assert "run.name" in str(result.exception) and "plain folder name" in str(result.exception)
    assert (victim / "precious.txt").read_text() == "mine" and not out.exists()


def test_overwrite_and_resume_together_is_an_error(tiny_config):
    sim = Simulation(tiny_config(run={"name": "both"}))
    with pytest.raises(ConfigError, match="not both"):
        sim.run(resume=True, overwrite=True)
    assert not sim.run_dir.exists()


def test_overwrite_never_deletes_a_folder_that_is_not_a_run(tiny_config, tmp_path):
    cfg = tiny_config(run={"name": "mine"})
    folder = tmp_path / "runs" / "mine"
    folder.mkdir(parents=True)
    (folder / "thesis.tex").write_text("years of work")
    with pytest.raises(ConfigError, match="not a fedhet run folder"):
        Simulation(cfg).run(overwrite=True)
    assert (folder / "thesis.tex").exists()


def hold_lock(path):
    """Another process holding ``path``'s file lock until its stdin closes (or it is killed)."""
    code = (
        "import sys; from filelock import FileLock; lock = FileLock(sys.argv[1]); lock.acquire(); "
        "print('held', flush=True); sys.stdin.read()"
    )
    holder = subprocess.Popen([sys.executable, "-c", code, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert holder.stdout.readline() == b"held\n"
    return holder


def test_a_run_folder_another_process_is_training_is_refused_untouched(tiny_config):
    cfg = tiny_config(run={"name": "busy", "rounds": 2, "checkpoint_every": 1})
    Simulation(cfg).run(stop_after=1)  # ended: its lock is free again
    folder = Simulation(cfg).run_dir
    before = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    holder = hold_lock(folder / rundir.LOCK_FILE)  # e.g. the same command started twice
    try:
        for flags in ({"resume": True}, {"overwrite": True}, {}):
            with pytest.raises(ConfigError, match="is in use: another fedhet process is training this run"):
                Simulation(cfg).run(**flags)
        assert {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()} == before
    finally:
        holder.kill()  # a killed holder frees the lock: nothing to clean up by hand
        holder.wait()
    assert Simulation(cfg).run(resume=True)["rounds_done"] == 2


def test_a_fresh_run_folder_is_locked_while_it_trains(tiny_config):
    cfg = tiny_config(run={"name": "claimed", "rounds": 2})
    sim = Simulation(cfg)
    seen = []

    def second_start(rnd, _record):  # another process (here: another Simulation) starting the same run meanwhile
        if rnd == 1:
            with pytest.raises(ConfigError, match="is in use"):
                Simulation(cfg).run(resume=True)
            seen.append(rnd)

    sim.on_round = second_start
    sim.run()
    assert seen == [1]
    assert read_metrics(sim.run_dir / "metrics.jsonl")[-1]["round"] == 2


@pytest.mark.parametrize("kind", ["file", "file parent"])
def test_an_output_folder_that_is_a_file_is_a_config_error(tiny_config, tmp_path, kind):
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    out = blocker if kind == "file" else blocker / "runs"
    with pytest.raises(ConfigError, match="cannot be used as the output folder"):
        Simulation(tiny_config(run={"out_dir": str(out)})).run()


# ------------------------------------------------------------------ 2. stale client state before the first checkpoint
def test_a_run_killed_before_its_first_checkpoint_restarts_from_empty_client_states(tiny_config, monkeypatch):
    reference = Simulation(disk_scaffold(tiny_config, "ref"))
    reference.run()
    killed = Simulation(disk_scaffold(tiny_config, "cut", checkpoint_every=3))
    kill_at(killed, 3, "snapshot", monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        killed.run()
    assert len(killed.executor.store) > 0 and not killed.checkpoint_path.exists()  # states of rounds 1-2 left
    monkeypatch.undo()
    again = Simulation(disk_scaffold(tiny_config, "cut", checkpoint_every=3))
    again.run(resume=True)
    same_run(reference, again)


def test_a_fresh_run_ignores_client_states_a_crash_left_in_its_folder(tiny_config):
    reference = Simulation(disk_scaffold(tiny_config, "ref"))
    reference.run()
    stale = Simulation(disk_scaffold(tiny_config, "x"))
    stale.executor.store.put(0, {"c_i": torch.full_like(reference.algo.global_params, 5.0)})
    stale.run()  # no metrics, no checkpoint: a fresh run in a folder a crash left states in
    same_run(reference, stale)


# ------------------------------------------------------------------ 3. kills inside the checkpoint step
@pytest.mark.parametrize("first", ["snapshot", "rotate", "written"])
@pytest.mark.parametrize("second", ["snapshot", "rotate", "written"])
def test_two_kills_in_a_row_inside_the_checkpoint_step_resume_bit_exact(tiny_config, monkeypatch, first, second):
    reference = Simulation(disk_scaffold(tiny_config, "ref"))
    reference.run()
    for rnd, where in ((3, first), (None, second)):  # the second attempt dies in the first checkpoint it writes
        sim = Simulation(disk_scaffold(tiny_config, "cut"))
        kill_at(sim, rnd, where, monkeypatch)
        with pytest.raises(KeyboardInterrupt):
            sim.run(resume=True)
        monkeypatch.undo()
    resumed = Simulation(disk_scaffold(tiny_config, "cut"))
    resumed.run(resume=True)
    same_run(reference, resumed)
    for cid, state in reference.executor.store.items():
        torch.testing.assert_close(state["c_i"], resumed.executor.store.get(cid)["c_i"], rtol=0, atol=0)
    left = list((resumed.run_dir / "client_state" / "snapshots").iterdir())
    assert len(left) <= 2  # last.pt's and prev.pt's: the rest were freed


def test_a_checkpoint_whose_client_states_are_gone_is_not_resumed(tiny_config, capsys):
    Simulation(disk_scaffold(tiny_config, "cut")).run(stop_after=3)
    sim = Simulation(disk_scaffold(tiny_config, "cut"))
    snapshots = sim.run_dir / "client_state" / "snapshots"
    newest = read_checkpoint(sim.checkpoint_path)["executor"]["clients"]["snapshot"]
    shutil.rmtree(snapshots / newest)
    assert sim.run(resume=True)["rounds_done"] == 5  # prev.pt (round 2) still has its states: resumed from it
    assert "are missing" in capsys.readouterr().err
    reference = Simulation(disk_scaffold(tiny_config, "ref"))
    reference.run()
    same_run(reference, sim)
    for snap in snapshots.iterdir():
        shutil.rmtree(snap)
    with pytest.raises(CheckpointError, match="no usable checkpoint.*are missing"):
        Simulation(disk_scaffold(tiny_config, "cut", rounds=6)).run(resume=True)


# ------------------------------------------------------------------ 4. corrupt, missing and hostile checkpoints
def damage(path, how):
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(bytes(data[: len(data) // 2]))
    elif how == "random":
        path.write_bytes(os.urandom(len(data)))
    elif how == "flipped":
        for i in range(64):
            data[len(data) // 2 + 7 * i] ^= 0xFF
        path.write_bytes(bytes(data))
    elif how == "empty":
        path.write_bytes(b"")


@pytest.mark.parametrize("how", ["truncated", "random", "flipped", "empty"])
def test_a_corrupt_checkpoint_falls_back_to_the_previous_one(tiny_config, capsys, how):
    make = lambda name, rounds=4: tiny_config(run={"name": name, "rounds": rounds})  # noqa: E731
    Simulation(make("cut")).run(stop_after=3)
    sim = Simulation(make("cut"))
    damage(sim.checkpoint_path, how)
    with pytest.raises(CheckpointError):
        read_checkpoint(sim.checkpoint_path)
    sim.run(resume=True)
    err = capsys.readouterr().err
    assert "resuming from the previous checkpoint, round 2" in err and "last.pt" in err
    reference = Simulation(make("ref"))
    reference.run()
    same_run(reference, sim)
    damage(sim.checkpoint_path, how)
    damage(sim.checkpoint_dir / "prev.pt", how)
    with pytest.raises(CheckpointError, match="no usable checkpoint"):
        Simulation(make("cut", rounds=5)).run(resume=True)
    assert [r["round"] for r in read_metrics(sim.run_dir / "metrics.jsonl")] == [1, 2, 3, 4]  # nothing lost


def test_deleted_checkpoints_with_metrics_refuse_to_restart(tiny_config):
    cfg = tiny_config(run={"name": "gone", "rounds": 4})
    Simulation(cfg).run(stop_after=3)
    shutil.rmtree(Simulation(cfg).checkpoint_dir)
    with pytest.raises(CheckpointError, match="goes to round 3 but checkpoints/ holds no checkpoint"):
        Simulation(cfg).run(resume=True)
    assert len(read_metrics(Simulation(cfg).run_dir / "metrics.jsonl")) == 3


class Payload:
    def __reduce__(self):
        return (os.system, ("touch /tmp/fedhet-pwned",))


def test_a_checkpoint_cannot_run_code_when_loaded(tmp_path):
    buffer = io.BytesIO()
    torch.save({"round": 1, "x": Payload()}, buffer, pickle_module=pickle)
    payload = buffer.getvalue()
    import hashlib

    path = tmp_path / "last.pt"
    path.write_bytes(checkpoint.MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload)
    if os.path.exists("/tmp/fedhet-pwned"):
        os.remove("/tmp/fedhet-pwned")
    with pytest.raises(CheckpointError, match="unreadable payload"):
        read_checkpoint(path)
    assert not os.path.exists("/tmp/fedhet-pwned")


@pytest.mark.parametrize("algorithm", ["fedbc", "feddyn", "moon", "scaffold", "fedavg"])
def test_every_checkpoint_loads_without_unpickling_objects(tiny_config, algorithm):
    sim = Simulation(tiny_config(run={"name": algorithm, "rounds": 1}, algorithm={"name": algorithm}))
    sim.run()
    assert read_checkpoint(sim.checkpoint_path)["round"] == 1  # weights_only=True


def test_leftover_temporary_checkpoint_files_are_removed_on_resume(tiny_config):
    cfg = tiny_config(run={"name": "tmp", "rounds": 3})
    sim = Simulation(cfg)
    sim.run(stop_after=1)
    (sim.checkpoint_dir / ".ckpt-abc.tmp").write_bytes(b"half a checkpoint")
    (sim.run_dir / ".metrics.jsonl.x1y2.tmp").write_text("half a file")
    Simulation(cfg).run(resume=True)
    assert sorted(p.name for p in sim.checkpoint_dir.iterdir()) == ["last.pt", "prev.pt"]
    assert not list(sim.run_dir.glob(".*.tmp"))


@pytest.mark.slow
def test_a_failed_run_exits_1_with_one_line_and_no_traceback(tmp_path):
    args = ["run", "-d", "digits", "-m", "mlp", "-n", "4", "-r", "3", "-o", str(tmp_path), "-s", "run.progress=false"]
    args += ["-s", "partition.min_size=20", "-s", "train.lr=1e10", "-s", "run.max_empty_rounds=1"]
    proc = subprocess.run([sys.executable, "-m", "fedhet.cli", *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "dropped 4 of 4 clients" in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("failed: no client finished round 1")


# ------------------------------------------------------------------ 5. failed clients and non-finite models
def strict_json(path):
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def test_a_run_whose_every_client_fails_stops_with_an_error(tiny_config, capsys):
    cfg = tiny_config(run={"name": "boom", "rounds": 6, "max_empty_rounds": 2}, train={"lr": 1e10})
    sim = Simulation(cfg)
    with pytest.raises(
        RunFailed, match=r"no client finished round 2 or the 1 before it.*checkpoint \(round 1\) is kept"
    ):
        sim.run()
    assert "dropped 3 of 3 clients" in capsys.readouterr().err
    summary = json.loads((sim.run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and "no client finished" in summary["error"]
    assert all(f["client"] is not None for f in strict_json(sim.run_dir / "failures.jsonl"))
    assert torch.isfinite(sim.algo.global_params).all()


def test_a_non_finite_global_model_stops_the_run_and_keeps_the_last_finite_checkpoint(tiny_config):
    cfg = tiny_config(run={"name": "nan", "rounds": 5})
    sim = Simulation(cfg)
    aggregate = sim.algo.aggregate

    def diverge(rnd, replies, phase):
        aggregate(rnd, replies, phase)
        if rnd == 3:
            sim.algo.global_params[0] = math.inf

    sim.algo.aggregate = diverge
    with pytest.raises(RunFailed, match=r"round 3 \(train\): the global model became non-finite.*round 2\) is kept"):
        sim.run()
    saved = read_checkpoint(sim.checkpoint_path)
    assert saved["round"] == 2 and torch.isfinite(saved["algo"]["global_params"]).all()
    assert [r["round"] for r in strict_json(sim.run_dir / "metrics.jsonl")] == [1, 2]
    assert json.loads((sim.run_dir / "summary.json").read_text())["status"] == "failed"


def test_metrics_are_strict_json_even_when_values_are_not_finite(tmp_path):
    from fedhet.results.store import MetricsLog, write_json_atomic

    log = MetricsLog(tmp_path / "m.jsonl")
    log.append({"round": 1, "test_loss": math.inf, "x": [math.nan, 1.0], "y": torch.tensor(float("nan"))})
    write_json_atomic(tmp_path / "s.json", {"best": float("-inf")})
    assert strict_json(tmp_path / "m.jsonl") == [{"round": 1, "test_loss": None, "x": [None, 1.0], "y": None}]
    assert json.loads((tmp_path / "s.json").read_text(), parse_constant=float) == {"best": None}


# ------------------------------------------------------------------ 7. resuming with fewer rounds
def test_resuming_a_finished_run_with_fewer_rounds_is_refused(tiny_config):
    Simulation(tiny_config(run={"name": "r", "rounds": 4})).run()
    shorter = Simulation(tiny_config(run={"name": "r", "rounds": 2}))
    with pytest.raises(ConfigError, match="already trained 4 rounds; a run can be extended, not shortened"):
        shorter.run(resume=True)
    assert json.loads((shorter.run_dir / "config.json").read_text())["run"]["rounds"] == 4
    assert json.loads((shorter.run_dir / "summary.json").read_text())["rounds_done"] == 4
    assert len(read_metrics(shorter.run_dir / "metrics.jsonl")) == 4


# ------------------------------------------------------------------ resuming as users do it
def test_resume_from_the_run_folder_alone_even_after_moving_it(tiny_config, tmp_path):
    make = lambda name: disk_scaffold(tiny_config, name)  # noqa: E731
    reference = Simulation(make("ref"))
    reference.run()
    Simulation(make("cut")).run(stop_after=2)
    moved = tmp_path / "elsewhere" / "moved-run"
    moved.parent.mkdir()
    shutil.move(str(tmp_path / "runs" / "cut"), moved)
    result = CliRunner().invoke(app, ["resume", str(moved), "-s", "run.progress=false"])
    assert result.exit_code == 0, result.output
    summary = json.loads((moved / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["rounds_done"] == 5
    resumed = Simulation(saved_run_config(moved))
    assert stable(resumed) == stable(reference)


def test_resume_of_a_folder_that_is_not_a_run_is_a_one_line_error(tmp_path):
    result = CliRunner().invoke(app, ["resume", str(tmp_path)])
    assert isinstance(result.exception, ConfigError) and "has no config.json" in str(result.exception)


def test_thread_count_is_recorded_and_a_change_warned_about(tiny_config, capsys):
    cfg = tiny_config(run={"name": "threads", "rounds": 2})
    sim = Simulation(cfg)
    sim.run(stop_after=1)
    assert json.loads((sim.run_dir / "provenance.json").read_text())["torch_threads"] == 1
    torch.set_num_threads(2)
    Simulation(cfg).run(resume=True)
    assert "trained with 1 torch thread(s) and now train with 2" in capsys.readouterr().err
    resumes = json.loads((sim.run_dir / "provenance.json").read_text())["resumes"]
    assert [(r["round"], r["torch_threads"]) for r in resumes] == [(1, 2)]


def test_personalised_method_without_local_test_splits_says_so(tiny_config, capsys):
    Simulation(tiny_config(run={"name": "p", "rounds": 1}, algorithm={"name": "pfedme"})).run()
    assert "partition.local_test_fraction" in capsys.readouterr().err


@pytest.mark.slow
def test_printed_errors_keep_their_brackets():
    """Rich read '[train]' in 'valid keys in [train]' as markup and printed 'valid keys in :'."""
    proc = subprocess.run(
        [sys.executable, "-m", "fedhet.cli", "run", "-s", "train.lrr=1"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and "valid keys in [train]: participation" in proc.stderr, proc.stderr


def test_the_run_folder_records_where_the_data_came_from(tiny_config):
    sim = Simulation(tiny_config(run={"name": "prov", "rounds": 1}))
    sim.run()
    info = json.loads((sim.run_dir / "provenance.json").read_text())
    assert info["data"]["dataset"] == "digits" and "load_digits" in info["data"]["source"]
    assert len(info["data"]["sha256"]) == 64 and info["data"]["sha256"] == sim.fed.provenance["sha256"]
    assert info["torch"] == torch.__version__ and info["resumes"] == []
    # from fedhet itself, not the install's metadata (a source checkout on PYTHONPATH has none), which pyproject.toml
    # reads from the same place
    assert info["fedhet"] == fedhet.__version__ == importlib.metadata.version("fedhet")


def test_the_processor_is_recorded_and_a_resume_elsewhere_warned_about(tiny_config, capsys, monkeypatch):
    cfg = tiny_config(run={"name": "cpu", "rounds": 2})
    sim = Simulation(cfg)
    sim.run(stop_after=1)
    first = json.loads((sim.run_dir / "provenance.json").read_text())
    assert first["cpu"] and first["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    real = rundir.environment
    monkeypatch.setattr(simulation, "environment", lambda: {**real(), "cpu_capability": "ELSEWHERE"})
    Simulation(cfg).run(resume=True)
    err = capsys.readouterr().err
    assert f"it continues on cpu_capability: {first['cpu_capability']} -> ELSEWHERE: floats round differently" in err
    resumes = json.loads((sim.run_dir / "provenance.json").read_text())["resumes"]
    assert [(r["round"], r["cpu_capability"]) for r in resumes] == [(1, "ELSEWHERE")]


def test_a_resume_on_the_same_machine_warns_of_nothing(tiny_config, capsys):
    cfg = tiny_config(run={"name": "same", "rounds": 2})
    Simulation(cfg).run(stop_after=1)
    Simulation(cfg).run(resume=True)
    assert "another machine" not in capsys.readouterr().err

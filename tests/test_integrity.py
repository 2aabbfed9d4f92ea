"""Persisted client state is sealed like a checkpoint, and checkpoint rotation survives a kill anywhere (issue 26).

Every client-state file (the disk store's files and snapshots, a Flower node's version files) carries a SHA-256 that
is checked when it is read; a damaged snapshot makes a resume fall back to ``prev.pt`` or refuse, naming the file;
a damaged file read while training stops the run. A deleted ``last.pt`` resumes from ``prev.pt`` with a warning, a
``last.pt`` from another run is refused naming it and the usable ``prev.pt``, and a kill at any step of writing a
checkpoint leaves two distinct complete checkpoints and no temporary after the next write.
"""

from __future__ import annotations

import errno
import json
import os
import shutil

import pytest
import torch

from fedhet.engine import checkpoint
from fedhet.engine.checkpoint import (
    LAST,
    PREV,
    CheckpointError,
    StateFileError,
    read_checkpoint,
    write_checkpoint,
)
from fedhet.engine.simulation import Simulation
from fedhet.engine.state import AutoStateStore, DiskStateStore, load_state_file
from fedhet.errors import ConfigError, RunFailed
from fedhet.flower.node_state import Attempt, FolderStore, History
from fedhet.results.store import read_metrics

STABLE = ("round", "test_acc", "test_loss", "train_loss")


def disk_scaffold(tiny_config, name, **run):
    return tiny_config(
        run={"name": name, "rounds": 5, "client_state": "disk", **run},
        partition={"name": "iid", "num_clients": 12},
        model={"name": "logreg"},
        train={"clients_per_round": 4, "batch_size": 8},
        algorithm={"name": "scaffold"},
    )


def same_run(a: Simulation, b: Simulation) -> None:
    rows = lambda s: [{k: r[k] for k in STABLE} for r in read_metrics(s.run_dir / "metrics.jsonl")]  # noqa: E731
    assert rows(a) == rows(b)
    torch.testing.assert_close(a.algo.global_params, b.algo.global_params, rtol=0, atol=0)


def damage(path, how: str) -> None:
    """Damage ``path`` in place (its inode, shared by every hard link to it, as a failing disk would)."""
    data = bytearray(path.read_bytes())
    if how == "flipped":  # one bit of the last float of the payload
        data[-30] ^= 0x01
    elif how == "truncated":
        data = data[: len(data) // 2]
    elif how == "empty":
        data = bytearray()
    with open(path, "r+b") as f:
        f.write(bytes(data))
        f.truncate()


def temporaries(folder):
    return sorted(p.name for p in folder.rglob("*.tmp"))


# ------------------------------------------------------------------ the disk store's files and snapshots
@pytest.mark.parametrize("how", ["flipped", "truncated", "empty"])
def test_a_damaged_state_file_is_refused_naming_it(tmp_path, how):
    store = DiskStateStore(tmp_path)
    store.put(3, {"c": torch.arange(64, dtype=torch.float32)})
    path = tmp_path / "current" / "3.pt"
    damage(path, how)
    with pytest.raises(StateFileError, match=str(path)):
        store.get(3)
    with pytest.raises(StateFileError, match=str(path)):
        list(store.items())


def test_a_state_file_without_a_hash_is_refused_clearly(tmp_path):
    store = DiskStateStore(tmp_path)
    store.put(3, {"c": torch.ones(4)})
    torch.save({"c": torch.ones(4)}, tmp_path / "current" / "3.pt")  # as fedhet wrote it before it sealed them
    with pytest.raises(StateFileError, match="3.pt: .*no SHA-256"):
        store.get(3)


def test_a_state_file_is_sealed_with_the_checkpoint_format(tmp_path):
    store = DiskStateStore(tmp_path)
    store.put(3, {"c": torch.ones(4)})
    data = (tmp_path / "current" / "3.pt").read_bytes()
    assert data.startswith(checkpoint.STATE_MAGIC)
    torch.testing.assert_close(load_state_file(tmp_path / "current" / "3.pt")["c"], torch.ones(4))
    assert not temporaries(tmp_path)


@pytest.mark.parametrize("how", ["flipped", "truncated", "swapped", "legacy"])
@pytest.mark.parametrize("kind", ["disk", "auto"])
def test_a_damaged_snapshot_is_refused_before_anything_changes(tmp_path, how, kind):
    store = DiskStateStore(tmp_path) if kind == "disk" else AutoStateStore(tmp_path, budget_bytes=0)
    store.put(0, {"c": torch.zeros(8)})
    store.put(1, {"c": torch.ones(8)})
    snap = store.state_dict()
    store.put(0, {"c": torch.full((8,), 2.0)})  # the live state moves on; the snapshot keeps its version
    victim = tmp_path / "snapshots" / snap["snapshot"] / "0.pt"
    if how == "swapped":  # a complete, sealed file, but not the one the checkpoint recorded
        victim.unlink()
        shutil.copy(tmp_path / "snapshots" / snap["snapshot"] / "1.pt", victim)
    elif how == "legacy":
        victim.unlink()
        torch.save({"c": torch.zeros(8)}, victim)
    else:
        damage(victim, how)
    with pytest.raises(StateFileError, match=str(victim)):
        store.load_state_dict(snap)
    torch.testing.assert_close(store.get(0)["c"], torch.full((8,), 2.0))  # unchanged
    torch.testing.assert_close(store.get(1)["c"], torch.ones(8))


def snapshot_files(sim: Simulation, name: str) -> list:
    saved = read_checkpoint(sim.checkpoint_dir / name)["executor"]["clients"]
    return sorted((sim.run_dir / "client_state" / "snapshots" / saved["snapshot"]).glob("*.pt"))


@pytest.mark.parametrize("how", ["flipped", "truncated"])
def test_a_damaged_client_state_in_last_pt_resumes_from_prev_pt_naming_it(tiny_config, capsys, how):
    Simulation(disk_scaffold(tiny_config, "cut")).run(stop_after=3)
    sim = Simulation(disk_scaffold(tiny_config, "cut"))
    in_prev = {p.stat().st_ino for p in snapshot_files(sim, PREV)}
    victim = next(p for p in snapshot_files(sim, LAST) if p.stat().st_ino not in in_prev)  # trained in round 3
    damage(victim, how)
    sim.run(resume=True)
    err = capsys.readouterr().err
    assert str(victim) in err and "resuming from the previous checkpoint, round 2" in err, err
    reference = Simulation(disk_scaffold(tiny_config, "ref"))
    reference.run()
    same_run(reference, sim)  # trained on prev.pt's intact states, not on the damaged one


def test_a_damaged_client_state_in_both_checkpoints_is_refused_naming_it(tiny_config):
    Simulation(disk_scaffold(tiny_config, "cut")).run(stop_after=3)
    sim = Simulation(disk_scaffold(tiny_config, "cut"))
    in_last = {p.stat().st_ino for p in snapshot_files(sim, LAST)}
    victim = next(p for p in snapshot_files(sim, PREV) if p.stat().st_ino in in_last)  # one file, two snapshots
    damage(victim, "flipped")
    with pytest.raises(CheckpointError, match=f"no usable checkpoint.*{victim.name}") as info:
        sim.run(resume=True)
    assert str(victim.parent.parent) in str(info.value)
    assert [r["round"] for r in read_metrics(sim.run_dir / "metrics.jsonl")] == [1, 2, 3]  # nothing lost


@pytest.mark.parametrize(
    "run", [{"workers": 1, "executor": "sequential"}, {"workers": 1, "executor": "batched"}, {"workers": 2}]
)
def test_a_state_file_damaged_while_training_stops_the_run_naming_it(tiny_config, run):
    sim = Simulation(disk_scaffold(tiny_config, "bad", **run))
    current = sim.run_dir / "client_state" / "current"

    def break_states(rnd, record):
        for p in current.glob("*.pt"):
            damage(p, "truncated")

    sim.on_round = break_states
    with pytest.raises(StateFileError, match=r"client_state/current/\d+\.pt") as info:
        sim.run()
    assert isinstance(info.value, RunFailed) and "\n" not in str(info.value)
    summary = json.loads((sim.run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and "current/" in summary["error"]
    failures = sim.run_dir / "failures.jsonl"
    assert "Errno" not in (failures.read_text() if failures.exists() else "")


# ------------------------------------------------------------------ a Flower node's state folder
def test_a_damaged_node_state_version_is_refused_naming_it(tmp_path):
    store = FolderStore(tmp_path)
    history = History("run", (Attempt("ab", 0, 5),), (2,))
    store.put(7, history, 1, 0, {"c": torch.arange(16, dtype=torch.float32)})
    torch.testing.assert_close(store.get(7, history)["c"], torch.arange(16, dtype=torch.float32))
    (path,) = store.folder("run", 7).glob("*.pt")
    assert path.read_bytes().startswith(checkpoint.STATE_MAGIC)
    damage(path, "flipped")
    with pytest.raises(StateFileError, match=str(path)):
        store.get(7, history)


# ------------------------------------------------------------------ last.pt deleted or foreign
def test_a_deleted_last_pt_resumes_from_prev_pt_with_one_warning(tiny_config, capsys):
    make = lambda name, rounds=4: tiny_config(run={"name": name, "rounds": rounds})  # noqa: E731
    Simulation(make("cut")).run(stop_after=3)
    sim = Simulation(make("cut"))
    sim.checkpoint_path.unlink()
    sim.run(resume=True)
    lines = [line for line in capsys.readouterr().err.splitlines() if "last.pt" in line]
    assert len(lines) == 1 and "last.pt is missing" in lines[0], lines
    assert "resuming from the previous checkpoint, round 2" in lines[0]
    reference = Simulation(make("ref"))
    reference.run()
    same_run(reference, sim)


def test_a_last_pt_from_another_run_is_refused_naming_it_and_the_usable_prev_pt(tiny_config):
    Simulation(tiny_config(run={"name": "cut", "rounds": 4})).run(stop_after=3)
    other = Simulation(tiny_config(run={"name": "other", "rounds": 4}, train={"lr": 0.05}))
    other.run(stop_after=3)
    sim = Simulation(tiny_config(run={"name": "cut", "rounds": 4}))
    shutil.copy(other.checkpoint_path, sim.checkpoint_path)
    with pytest.raises(ConfigError) as info:
        sim.run(resume=True)
    message = str(info.value)
    assert str(sim.checkpoint_path) in message and "train.lr" in message
    assert str(sim.checkpoint_dir / PREV) in message and "round 2" in message
    assert "\n" not in message
    assert read_checkpoint(sim.checkpoint_path)["config"]["train"]["lr"] == 0.05  # nothing was changed


def test_a_config_change_that_every_checkpoint_refuses_still_names_the_file(tiny_config):
    Simulation(tiny_config(run={"name": "cut", "rounds": 4})).run(stop_after=3)
    sim = Simulation(tiny_config(run={"name": "cut", "rounds": 4}, train={"lr": 0.05}))
    with pytest.raises(ConfigError, match="config differs") as info:
        sim.run(resume=True)
    assert str(sim.checkpoint_path) in str(info.value) and "prev.pt" not in str(info.value)


# ------------------------------------------------------------------ rotation: a kill at any step
WATCHED = ("link", "replace", "rename", "unlink", "fsync", "open")


def rounds(folder):
    return read_checkpoint(folder / LAST)["round"], read_checkpoint(folder / PREV)["round"]


def check_two_distinct(folder):
    last, prev = rounds(folder)
    assert prev < last
    assert not os.path.samefile(folder / LAST, folder / PREV)
    return last, prev


def two_checkpoints(folder):
    write_checkpoint(folder, {"round": 1, "x": torch.zeros(100)})
    write_checkpoint(folder, {"round": 2, "x": torch.ones(100)})


def count_steps(folder) -> int:
    """How many watched calls writing checkpoint 3 over two others makes."""
    two_checkpoints(folder)
    calls = []
    real = {name: getattr(os, name) for name in WATCHED}
    try:
        for name in WATCHED:
            setattr(os, name, lambda *a, _n=name, **k: calls.append(_n) or real[_n](*a, **k))
        write_checkpoint(folder, {"round": 3, "x": torch.full((100,), 2.0)})
    finally:
        for name, fn in real.items():
            setattr(os, name, fn)
    return len(calls)


def write_killed_at(folder, step: int) -> int:
    """Write checkpoint 3 in a child process that dies (``os._exit``, as kill -9: no cleanup runs) just before its
    ``step``-th file-system call; returns its exit code (0: it finished first)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            calls = [0]
            real = {name: getattr(os, name) for name in WATCHED}

            def wrap(name):
                def call(*a, **k):
                    if calls[0] == step:
                        real["_exit"](9)
                    calls[0] += 1
                    return real[name](*a, **k)

                return call

            real["_exit"] = os._exit
            for name in WATCHED:
                setattr(os, name, wrap(name))
            write_checkpoint(folder, {"round": 3, "x": torch.full((100,), 2.0)})
            real["_exit"](0)
        except BaseException:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_a_kill_at_any_step_of_a_checkpoint_write_leaves_two_distinct_checkpoints(tmp_path):
    steps = count_steps(tmp_path / "probe")
    assert steps >= 4
    for step in range(steps + 1):
        folder = tmp_path / f"step{step}"
        two_checkpoints(folder)
        code = write_killed_at(folder, step)
        assert code == (0 if step == steps else 9), (step, code)
        last, _ = check_two_distinct(folder)  # both complete, two files: a fallback is left
        assert last in (2, 3), step
        write_checkpoint(folder, {"round": 4, "x": torch.full((100,), 3.0)})  # the resumed run's next checkpoint
        assert check_two_distinct(folder) == (4, last), step
        assert temporaries(folder) == [], step


@pytest.mark.parametrize("fails", ["link", "replace", "fsync"])
def test_a_failing_step_of_a_checkpoint_write_leaves_both_checkpoints_and_no_temporary(tmp_path, monkeypatch, fails):
    real = getattr(os, fails)
    for nth in range(4):  # the first to the fourth such call fails (a write makes at most two of each)
        folder = tmp_path / f"{fails}{nth}"
        two_checkpoints(folder)

        def failing(*a, calls=[], nth=nth, **k):  # noqa: B006 - one list per definition: the calls so far
            calls.append(1)
            if len(calls) == nth + 1:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(*a, **k)

        monkeypatch.setattr(os, fails, failing)
        try:
            write_checkpoint(folder, {"round": 3, "x": torch.full((100,), 2.0)})
        except OSError as err:
            assert err.errno == errno.ENOSPC
        finally:
            monkeypatch.setattr(os, fails, real)
        check_two_distinct(folder)
        assert temporaries(folder) == [], (fails, nth)
        write_checkpoint(folder, {"round": 4, "x": torch.full((100,), 3.0)})
        check_two_distinct(folder)
        assert temporaries(folder) == [], (fails, nth)


def test_prev_pt_left_as_a_second_name_of_last_pt_is_repaired_by_the_next_write(tmp_path):
    """What a kill in the middle of the rotation of fedhet before this fix left: prev.pt a hard link of last.pt."""
    two_checkpoints(tmp_path)
    (tmp_path / PREV).unlink()
    os.link(tmp_path / LAST, tmp_path / PREV)
    write_checkpoint(tmp_path, {"round": 3, "x": torch.full((100,), 2.0)})
    assert check_two_distinct(tmp_path) == (3, 2)
    assert temporaries(tmp_path) == []

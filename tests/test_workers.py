"""Worker processes: identical bits to in-process clients, dead workers replaced, Ctrl-C leaves a resumable run."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

from fedhet.algorithms import ALGORITHMS
from fedhet.engine import simulation, workers
from fedhet.engine.simulation import Simulation, resolve_workers
from fedhet.engine.workers import ProcessExecutor, SharedClients
from fedhet.results.store import read_metrics

STABLE = ("round", "test_acc", "test_loss", "train_loss", "client_dist_acc", "client_acc_mean", "clients")


def stable(sim):
    return [{k: r.get(k) for k in STABLE} for r in read_metrics(sim.run_dir / "metrics.jsonl")]


def config(tiny_config, algorithm, name, workers=1, **run):
    params = {"pfedme": {"inner_steps": 2}}.get(algorithm, {})
    return tiny_config(
        run={"name": name, "rounds": 2, "workers": workers, **run},
        partition={"local_test_fraction": 0.2},
        train={"participation": 1.0, "momentum": 0.5},
        algorithm={"name": algorithm, **params},
    )


def test_shared_clients_are_views_of_one_copy(tiny_config):
    sim = Simulation(config(tiny_config, "fedavg", "pack"))
    shared = SharedClients.pack(sim.fed.clients)
    assert shared.x.is_shared() and shared.y.is_shared()
    for mine, theirs in zip(sim.fed.clients, shared.unpack(), strict=True):
        assert torch.equal(mine.x, theirs.x) and torch.equal(mine.y_test, theirs.y_test)
        assert theirs.x.untyped_storage().data_ptr() == shared.x.untyped_storage().data_ptr()


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ALGORITHMS.names())
def test_workers_give_the_same_bits_as_in_process_clients(tiny_config, algorithm):
    local = Simulation(config(tiny_config, algorithm, "local"))
    local.run()
    parallel = Simulation(config(tiny_config, algorithm, "parallel", workers=2))
    assert isinstance(parallel.executor, ProcessExecutor)
    parallel.run()
    assert stable(local) == stable(parallel)
    torch.testing.assert_close(local.algo.global_params, parallel.algo.global_params, rtol=0, atol=0)
    for cid, state in local.executor.store.items():
        other = parallel.executor.store.get(cid)
        assert sorted(state) == sorted(other)
        for key in state:
            torch.testing.assert_close(state[key], other[key], rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("store", ["disk", "memory"])
def test_three_workers_resume_bit_exact_with_client_state(tiny_config, kill_and_resume, store):
    make = lambda name: config(  # noqa: E731
        tiny_config, "scaffold", name, workers=3, rounds=4, client_state=store
    )
    reference = Simulation(config(tiny_config, "scaffold", "reference", rounds=4, client_state=store))
    reference.run()
    full, resumed = kill_and_resume(make)
    assert stable(reference) == stable(full) == stable(resumed)
    torch.testing.assert_close(reference.algo.global_params, resumed.algo.global_params, rtol=0, atol=0)


def reset_by_peer() -> None:
    raise ConnectionResetError(104, "Connection reset by peer")


@pytest.mark.slow
def test_a_worker_that_dies_while_it_sets_up_fails_the_run_in_one_line(tiny_config, monkeypatch):
    """A worker gone before its first task (killed, or unable to read its data) stops the run as a RunFailed: the
    summary says why and the command line prints one 'failed:' line (it was a traceback)."""
    from fedhet.errors import RunFailed

    real_setup_one = workers.WorkerPool._setup_one

    def kill_then_set_up(pool, i):  # a new worker, or one a pool kept from an earlier run of this process
        pool.procs[i].kill()
        pool.procs[i].join()
        real_setup_one(pool, i)

    monkeypatch.setattr(workers.WorkerPool, "_setup_one", kill_then_set_up)
    sim = Simulation(config(tiny_config, "fedavg", "dies-at-setup", workers=2))
    with pytest.raises(RunFailed, match="worker process 0 died while it set up"):
        sim.run()
    summary = json.loads((sim.run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and "died while it set up" in summary["error"]


@pytest.mark.slow
@pytest.mark.parametrize("reads_as", ["eof", "reset"])
def test_a_dead_worker_is_a_failed_client_and_is_replaced(tiny_config, monkeypatch, reads_as):
    """A dead worker's pipe reads as EOF, or, when it died with bytes unread in its socket (CI saw it under load),
    as a reset connection: either way its client fails and a new worker takes its place."""
    sim = Simulation(config(tiny_config, "fedavg", f"killed-{reads_as}", workers=2, rounds=3))
    real_wait, killed = workers.wait, []

    def wait_and_kill(objects):
        if not killed and sim.executor.pool is not None and len(objects) == 4:  # both workers are training
            proc = sim.executor.pool.procs[0]
            os.kill(proc.pid, signal.SIGKILL)
            killed.append(proc.pid)
            if reads_as == "reset":
                monkeypatch.setattr(sim.executor.pool.conns[0], "recv", reset_by_peer)
        return real_wait(objects)

    monkeypatch.setattr(workers, "wait", wait_and_kill)
    summary = sim.run()
    assert summary["status"] == "finished" and killed
    failures = [line for line in (sim.run_dir / "failures.jsonl").read_text().splitlines() if "WorkerDied" in line]
    assert len(failures) == 1 and "signal 9" in failures[0]
    records = read_metrics(sim.run_dir / "metrics.jsonl")
    assert records[0]["dropped"] == 1 and [r["dropped"] for r in records[1:]] == [0, 0]
    assert all(p.is_alive() for p in sim.executor.pool.procs) and sim.executor.pool.procs[0].pid != killed[0]


@pytest.mark.slow
def test_ctrl_c_stops_every_worker_and_the_run_resumes_bit_exact(tiny_config, monkeypatch):
    make = lambda name: config(tiny_config, "scaffold", name, workers=2, rounds=3)  # noqa: E731
    reference = Simulation(make("reference"))
    reference.run()
    sim = Simulation(make("interrupted"))
    real_wait, calls = workers.wait, []

    def interrupt(objects):
        calls.append(1)
        if len(calls) == 8:  # in round 2
            raise KeyboardInterrupt
        return real_wait(objects)

    monkeypatch.setattr(workers, "wait", interrupt)
    with pytest.raises(KeyboardInterrupt):
        sim.run()
    procs = [p for p in sim.executor.pool.procs if p is not None]
    assert procs == [] and workers.pool(2).setup_msg is None
    monkeypatch.undo()
    resumed = Simulation(make("interrupted"))
    resumed.run(resume=True)
    assert stable(reference) == stable(resumed)
    torch.testing.assert_close(reference.algo.global_params, resumed.algo.global_params, rtol=0, atol=0)


def test_auto_workers(tiny_config, monkeypatch):
    monkeypatch.setattr(simulation, "usable_cores", lambda: 4)
    auto = lambda **kw: resolve_workers(tiny_config(run={"workers": 0}, **kw))  # noqa: E731
    assert auto(train={"clients_per_round": 3}) == 3
    assert auto(train={"participation": 1.0}) == 4
    assert auto(train={"clients_per_round": 1}) == 1
    monkeypatch.setattr(simulation, "usable_cores", lambda: 2)  # two intra-op threads were as fast (performance.md)
    assert auto(train={"participation": 1.0}) == 1


def test_too_little_shared_memory_trains_in_process_with_a_warning(tiny_config, monkeypatch, capsys):
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(workers.shutil, "disk_usage", lambda path: usage(64 * 2**20, 64 * 2**20, 1000))
    sim = Simulation(config(tiny_config, "fedavg", "small-shm", workers=2))
    assert not isinstance(sim.executor, ProcessExecutor) and sim.workers == 1
    assert "/dev/shm has 0 MB free: clients train here" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["fedrod", "fednh", "fedper", "fedbabu"])
def test_lazily_built_layouts_leave_dropout_streams_alone(tiny_config, algorithm):
    """With dropout (the global random stream), workers equal in-process clients for the algorithms that build a
    throw-away model to find a slice of the flat vector (each builds it under fork_rng)."""

    def make(name, workers=1):
        cfg = config(tiny_config, algorithm, name, workers=workers)
        return cfg.model_copy(update={"model": cfg.model.model_copy(update={"dropout": 0.5})})

    local, parallel = Simulation(make("local")), Simulation(make("parallel", workers=2))
    local.run()
    parallel.run()
    torch.testing.assert_close(local.algo.global_params, parallel.algo.global_params, rtol=0, atol=0)

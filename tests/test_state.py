"""Client state stores: memory, disk (hard-link snapshots) and auto (spills to disk past a budget)."""

from __future__ import annotations

import pytest
import torch

from fedhet.engine.simulation import Simulation
from fedhet.engine.state import AutoStateStore, DiskStateStore, MemoryStateStore
from fedhet.results.store import read_metrics


def stores(tmp_path):
    return [MemoryStateStore(), DiskStateStore(tmp_path / "disk"), AutoStateStore(tmp_path / "auto", 10**9)]


def test_get_put_delete_and_isolation(tmp_path):
    for store in stores(tmp_path):
        assert store.get(3) == {}
        store.put(3, {"c": torch.ones(4)})
        got = store.get(3)
        got["c"].add_(1)  # a client's copy: mutating it must not change the store
        torch.testing.assert_close(store.get(3)["c"], torch.ones(4))
        store.put(3, {})  # an empty state clears the client
        assert store.get(3) == {} and len(store) == 0


def test_disk_snapshot_keeps_the_version_it_linked(tmp_path):
    store = DiskStateStore(tmp_path)
    store.put(0, {"c": torch.zeros(2)})
    snap = store.state_dict()
    store.put(0, {"c": torch.ones(2)})
    store.put(1, {"c": torch.ones(2)})
    store.load_state_dict(snap)
    torch.testing.assert_close(store.get(0)["c"], torch.zeros(2))
    assert store.get(1) == {} and len(store) == 1


def test_disk_frees_only_the_snapshots_no_kept_checkpoint_names(tmp_path):
    store = DiskStateStore(tmp_path)
    store.put(0, {"c": torch.zeros(2)})
    saved = [store.state_dict() for _ in range(4)]
    assert len(list((tmp_path / "snapshots").iterdir())) == 4  # nothing is freed while writing
    store.retain([saved[0], saved[2]])
    left = sorted(p.name for p in (tmp_path / "snapshots").iterdir())
    assert left == sorted([saved[0]["snapshot"], saved[2]["snapshot"]])


def test_auto_spills_to_disk_past_the_budget(tmp_path):
    store = AutoStateStore(tmp_path, budget_bytes=100)
    store.put(0, {"c": torch.zeros(10)})  # 40 bytes: stays in memory
    assert not store.on_disk
    store.put(1, {"c": torch.zeros(20)})  # 120 bytes in all: everything moves to disk
    assert store.on_disk and len(list((tmp_path / "current").glob("*.pt"))) == 2
    torch.testing.assert_close(store.get(0)["c"], torch.zeros(10))


def many_clients(tiny_config, **run):
    return tiny_config(
        run={"rounds": 3, **run},
        partition={"name": "iid", "num_clients": 300},
        model={"name": "logreg"},
        train={"clients_per_round": 10, "batch_size": 4},
        algorithm={"name": "scaffold"},
    )


def test_scaffold_with_many_clients_keeps_states_on_disk(tiny_config):
    sim = Simulation(many_clients(tiny_config, name="disk", client_state="disk"))
    sim.run()
    store = sim.executor.store
    assert isinstance(store, DiskStateStore)  # holds no tensors in memory
    assert len(store) == len(sim.seen) == len(list(store.current.glob("*.pt")))


@pytest.mark.parametrize("kind", ["disk", "auto"])
def test_resume_is_bit_exact_with_state_on_disk(tiny_config, kill_and_resume, kind):
    budget = {"client_state_budget_mb": 0.001} if kind == "auto" else {}  # auto spills in round 1
    full, resumed = kill_and_resume(lambda name: many_clients(tiny_config, name=name, client_state=kind, **budget))
    torch.testing.assert_close(full.algo.global_params, resumed.algo.global_params, rtol=0, atol=0)
    keys = ("round", "test_acc", "test_loss")
    assert [{k: r[k] for k in keys} for r in read_metrics(full.run_dir / "metrics.jsonl")] == [
        {k: r[k] for k in keys} for r in read_metrics(resumed.run_dir / "metrics.jsonl")
    ]
    for cid, state in full.executor.store.items():
        torch.testing.assert_close(state["c_i"], resumed.executor.store.get(cid)["c_i"], rtol=0, atol=0)

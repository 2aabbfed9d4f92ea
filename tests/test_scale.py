"""Large federations: evaluation that costs what the data costs, not what the number of clients costs."""

from __future__ import annotations

import numpy as np
import pytest

from fedhet.data.types import DataError
from fedhet.engine.simulation import Simulation
from fedhet.results.store import read_metrics
from fedhet.toolkit.evaluate import evaluate, local_test_acc


def test_local_test_accuracy_in_shared_batches_equals_one_pass_per_client(tiny_config):
    sim = Simulation(tiny_config(partition={"num_clients": 6, "local_test_fraction": 0.3}))
    clients = sim.fed.clients
    clients[2].x_test, clients[2].y_test = clients[2].x_test[:0], clients[2].y_test[:0]  # an empty split
    for batch in (7, 64, 4096):
        got = local_test_acc(sim.model, clients, batch)
        want = [evaluate(sim.model, c.x_test, c.y_test, 10, batch).acc if len(c.y_test) else np.nan for c in clients]
        np.testing.assert_array_equal(got, np.array(want))


@pytest.mark.parametrize("limit", [3, None])
def test_personalised_accuracy_is_measured_on_a_seeded_sample_of_large_federations(tiny_config, limit):
    cfg = tiny_config(
        run={"name": f"pers-{limit}", "rounds": 2, "personal_eval_clients": limit},
        partition={"num_clients": 6, "local_test_fraction": 0.3},
        train={"participation": 1.0},
        algorithm={"name": "pfedme", "inner_steps": 2},
    )
    sim = Simulation(cfg)
    sim.run()
    records = read_metrics(sim.run_dir / "metrics.jsonl")
    if limit is None:
        assert all(r["personal_clients"] == 6 and "personal_sample" not in r for r in records)
    else:
        assert all(r["personal_clients"] == 3 and r["personal_sample"] == 3 for r in records)
        assert sim.personal_sample(2, list(range(6))) == sim.personal_sample(2, list(range(6)))  # seeded


@pytest.mark.slow
def test_ten_thousand_clients_need_memory_for_the_participants_only(tiny_config):
    """SCAFFOLD on Fashion-MNIST split into 10,000 clients, 20 per round, client state on disk: a short smoke run
    (the timed 20-round run with 100 per round is in benchmarks/throughput.py)."""
    cfg = tiny_config(
        run={"name": "big", "rounds": 2, "client_state": "disk"},
        dataset={"name": "fmnist"},
        partition={"name": "iid", "num_clients": 10_000, "local_test_fraction": 0.2},
        model={"name": "logreg"},
        train={"clients_per_round": 20, "batch_size": 10},
        algorithm={"name": "scaffold"},
    )
    try:
        sim = Simulation(cfg)
    except DataError as err:  # make test installs it; a bare checkout may not have it
        pytest.skip(str(err))
    summary = sim.run()
    assert summary["status"] == "finished"
    assert len(sim.executor.store) <= 40  # only the clients that trained have a state, and it is on disk
    assert np.isfinite(read_metrics(sim.run_dir / "metrics.jsonl")[-1]["client_acc_mean"])

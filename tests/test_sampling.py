"""Dynamic sampling (FedUFO Sec. 3.3.2, notes/fedufo.md reading 11): half of a round's clients are the ones the
global model serves worst, half at random; measured as the fairness metrics measure accuracy; seeded from (seed,
round) like uniform sampling; checkpointed, so a killed run resumes bit for bit; logged to sampling.jsonl."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedhet.engine.simulation import Simulation
from fedhet.results.store import read_metrics


def dyn_config(tiny_config, name="dyn", algorithm="fedavg", **train):
    return tiny_config(
        run={"name": name, "rounds": 5},
        partition={"name": "shards", "num_clients": 10, "shards_per_client": 2, "local_test": "matched"},
        train={"clients_per_round": 4, "sampling": "dynamic", **train},
        algorithm={"name": algorithm},
    )


def test_the_worst_half_is_taken_and_the_rest_drawn_from_the_others(tiny_config):
    sim = Simulation(dyn_config(tiny_config, sampling_refresh=100))
    sim.performance = [0.9, 0.1, 0.8, 0.7, 0.05, 0.6, 0.95, 0.5, 0.99, 0.4]
    for rnd in range(2, 12):  # refresh=100: the set values are used from round 2 on
        chosen = sim.sample_clients(rnd)
        assert len(chosen) == len(set(chosen)) == 4 and chosen == sorted(chosen)
        assert {1, 4} <= set(chosen)  # the two lowest accuracies, 0.05 and 0.1
        assert sim.sample_clients(rnd) == chosen  # (seed, round, performance) decide the draw
    randoms = {tuple(sorted(set(sim.sample_clients(r)) - {1, 4})) for r in range(2, 40)}
    assert len(randoms) > 5  # the other half varies from round to round


def test_ties_among_the_worst_are_broken_at_random(tiny_config):
    sim = Simulation(dyn_config(tiny_config, sampling_refresh=100, sampling_worst=1.0))
    sim.performance = [0.0] * 8 + [1.0, 1.0]
    picks = [tuple(sim.sample_clients(r)) for r in range(2, 30)]
    assert all(8 not in p and 9 not in p for p in picks)  # all four are tied worst, never the two best
    assert len(set(picks)) > 5  # not always the lowest ids


def test_performance_is_each_clients_accuracy_on_its_local_test_data(tiny_config):
    sim = Simulation(dyn_config(tiny_config))
    got = sim.client_performance(1)
    sim.flat.set_params(sim.algo.global_params)
    with torch.no_grad():
        want = [float((sim.model(c.x_test).argmax(1) == c.y_test).double().mean()) for c in sim.fed.clients]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    sim_train = Simulation(dyn_config(tiny_config, "t", sampling_measure="train"))
    with torch.no_grad():
        want = [float((sim.model(c.x).argmax(1) == c.y).double().mean()) for c in sim.fed.clients]
    np.testing.assert_allclose(sim_train.client_performance(1), want, rtol=0, atol=1e-12)


def test_uniform_sampling_is_unchanged(tiny_config):
    uniform = Simulation(dyn_config(tiny_config, sampling="uniform"))
    rng = np.random.default_rng
    from fedhet.toolkit.local import derive_seed

    for rnd in (1, 2, 3):
        want = sorted(int(c) for c in rng(derive_seed(0, rnd, 0x5A)).choice(10, size=4, replace=False))
        assert uniform.sample_clients(rnd) == want


@pytest.mark.parametrize("algorithm", ["fedavg", "scaffold"])
def test_dynamic_sampling_learns_and_resumes_bit_exact(tiny_config, kill_and_resume, algorithm):
    full, resumed = kill_and_resume(
        lambda name: dyn_config(tiny_config, name, algorithm, sampling_refresh=2), stop_after=3
    )
    records = read_metrics(full.run_dir / "metrics.jsonl")
    assert records[-1]["test_acc"] > 0.5, records[-1]  # 10 classes on 2-class clients: chance is 0.1
    assert read_metrics(full.run_dir / "metrics.jsonl") == [
        {**r, "elapsed_s": f["elapsed_s"]}
        for r, f in zip(read_metrics(resumed.run_dir / "metrics.jsonl"), records, strict=True)
    ]
    log = read_metrics(full.run_dir / "sampling.jsonl")
    assert [r["round"] for r in log] == [1, 2, 3, 4, 5]
    assert [r["measured_round"] for r in log] == [1, 1, 3, 3, 5]  # sampling_refresh=2
    assert all(len(r["worst"]) == 2 and len(r["random"]) == 2 for r in log)
    assert log == read_metrics(resumed.run_dir / "sampling.jsonl")
    torch.testing.assert_close(full.algo.global_params, resumed.algo.global_params, rtol=0, atol=0)

"""The centralized upper bound: one client holding every client's training data, trained by the shared loop, and
evaluated on the partition's clients like any federated method."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedhet.engine.simulation import Simulation
from fedhet.errors import ConfigError
from fedhet.results.store import read_metrics
from fedhet.toolkit.evaluate import client_accuracy
from fedhet.toolkit.local import batch_indices, derive_seed


def central_config(tiny_config, name="central", algorithm="centralized", rounds=3, **params):
    return tiny_config(
        run={"name": name, "rounds": rounds},
        partition={"name": "shards", "num_clients": 10, "shards_per_client": 2, "local_test": "matched"},
        train={"clients_per_round": 3},
        algorithm={"name": algorithm, **params},
    )


def test_one_client_holds_every_clients_training_data(tiny_config):
    sim = Simulation(central_config(tiny_config))
    assert sim.fed.num_clients == 1 and sim.eval_fed.num_clients == 10
    pooled = sim.fed.clients[0]
    assert torch.equal(pooled.y, torch.cat([c.y for c in sim.eval_fed.clients]))
    assert torch.equal(pooled.x, torch.cat([c.x for c in sim.eval_fed.clients]))
    assert np.array_equal(sim.fed.train_counts[0], sim.eval_fed.train_counts.sum(axis=0))
    assert sim.sample_clients(1) == [0]


@pytest.mark.parametrize("epochs", [None, 0.5])
def test_a_round_is_plain_sgd_over_the_pooled_data(tiny_config, epochs):
    """Round 1 by hand: torch.optim.SGD over the pooled data in the client's batch order gives the global model
    (train.local_epochs = 1 epoch, or the algorithm's own local_epochs)."""
    cfg = central_config(tiny_config, rounds=1, **({} if epochs is None else {"local_epochs": epochs}))
    sim = Simulation(cfg)
    start = sim.algo.global_params.clone()
    sim.run()
    data, t = sim.fed.clients[0], cfg.train
    sim.flat.set_params(start)
    opt = torch.optim.SGD(sim.model.parameters(), lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)
    gen = torch.Generator().manual_seed(derive_seed(cfg.run.seed, 1, 0, 0))
    steps = int(np.ceil((epochs or t.local_epochs) * np.ceil(len(data.y) / t.batch_size)))
    for idx in batch_indices(len(data.y), t.batch_size, steps, gen):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(sim.model(data.x[idx]), data.y[idx]).backward()
        opt.step()
    torch.testing.assert_close(sim.flat.get_params(), sim.algo.global_params, rtol=0, atol=1e-6)


def test_centralized_learns_beyond_fedavg_and_measures_fairness_on_the_partition(tiny_config):
    central = Simulation(central_config(tiny_config))
    central.run()
    fedavg = Simulation(central_config(tiny_config, "fedavg", "fedavg"))
    fedavg.run()
    last = read_metrics(central.run_dir / "metrics.jsonl")[-1]
    assert last["test_acc"] > 0.85 and last["test_acc"] > read_metrics(fedavg.run_dir / "metrics.jsonl")[-1]["test_acc"]
    central.flat.set_params(central.algo.global_params)
    acc = client_accuracy(central.model, central.eval_fed, 1024)
    assert last["client_acc_min"] == pytest.approx(acc.min()) and last["client_acc_std"] == pytest.approx(acc.std())


def test_centralized_refuses_flower(tiny_config):
    from fedhet.engine.client import LocalExecutor

    with pytest.raises(ConfigError, match="simulation"):
        Simulation(central_config(tiny_config), executor=LocalExecutor(None, [], None))

"""FedMeta (data-sharing): the shared 10% per client, one server fine-tuning step on it by hand after the FedAvg
average, and a run that learns (beyond FedAvg on pathological shards) and resumes bit for bit."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedhet.algorithms import ALGORITHMS, Reply, Setup
from fedhet.algorithms.base import ClientData
from fedhet.algorithms.fedmeta import shared_indices
from fedhet.config import TrainSection
from fedhet.engine.simulation import Simulation
from fedhet.models.base import FedModel
from fedhet.results.store import read_metrics
from fedhet.toolkit.flat import FlatModel

D, C = 4, 3


def test_each_client_shares_a_tenth_of_its_samples_at_least_one():
    picks = shared_indices([10, 3, 0, 25, 40], 0.1, np.random.default_rng(0))
    assert [len(p) for p in picks] == [1, 1, 0, 2, 4]  # round(0.3) = 0 -> 1; round(2.5) = 2
    for p, n in zip(picks, [10, 3, 0, 25, 40], strict=True):
        assert len(set(p.tolist())) == len(p) and all(0 <= i < n for i in p)


def test_the_average_is_fine_tuned_on_the_shared_data_by_hand():
    lr, mom, wd = 0.2, 0.9, 0.01
    train = TrainSection(batch_size=64, lr=lr, momentum=mom, weight_decay=wd)
    entry = ALGORITHMS.get("fedmeta")

    def build():
        return FedModel({"flat": nn.Flatten()}, D, C)

    algo = entry.obj(entry.params(meta_fraction=1.0, meta_epochs=1), Setup(2, C, train, build))
    flat = FlatModel(build())
    g = torch.Generator().manual_seed(0)
    algo.init_server(torch.randn(flat.num_params, generator=g), flat.get_buffers())
    xs = [torch.randn(3, D, generator=g), torch.randn(2, D, generator=g)]
    ys = [torch.tensor([0, 1, 1]), torch.tensor([2, 0])]
    clients = [ClientData(x, y, C) for x, y in zip(xs, ys, strict=True)]
    algo.receive_shared_data(SimpleNamespace(clients=clients, num_classes=C), seed=0)
    assert torch.equal(algo.meta.x, torch.cat(xs)) and torch.equal(algo.meta.y, torch.cat(ys))

    a, b = torch.randn(flat.num_params, generator=g), torch.randn(flat.num_params, generator=g)
    algo.aggregate(1, {0: Reply({"params": a}, num_examples=3), 1: Reply({"params": b}, num_examples=1)}, "train")
    w = 0.75 * a + 0.25 * b  # FedAvg's weights 3:1
    x, y = torch.cat(xs), torch.cat(ys)  # one batch of all 5 shared samples: one step, fresh momentum
    W, bias = w[: C * D].view(C, D), w[C * D :]
    err = ((x @ W.T + bias).softmax(1) - F.one_hot(y, C).float()) / 5
    grad = torch.cat([(err.T @ x).reshape(-1), err.sum(0)])
    torch.testing.assert_close(algo.global_params, w - lr * (grad + wd * w))
    assert algo.round_metrics(1)["meta_samples"] == 5


def shard_config(tiny_config, name, algorithm):
    return tiny_config(
        run={"name": name, "rounds": 4},
        partition={"name": "shards", "num_clients": 10, "shards_per_client": 2, "local_test": "matched"},
        train={"clients_per_round": 4},
        algorithm={"name": algorithm},
    )


def test_fedmeta_learns_beyond_fedavg_and_resumes_bit_exact(tiny_config, kill_and_resume):
    full, resumed = kill_and_resume(lambda name: shard_config(tiny_config, name, "fedmeta"))
    records = read_metrics(full.run_dir / "metrics.jsonl")
    fedavg = Simulation(shard_config(tiny_config, "fedavg", "fedavg"))
    fedavg.run()
    base = read_metrics(fedavg.run_dir / "metrics.jsonl")[-1]["test_acc"]
    assert records[-1]["test_acc"] > max(0.6, base), (records[-1]["test_acc"], base)  # shared IID data help
    n = sum(len(c.y) for c in full.fed.clients)
    assert records[-1]["meta_samples"] == pytest.approx(sum(max(1, round(0.1 * len(c.y))) for c in full.fed.clients))
    assert records[-1]["meta_samples"] < 0.11 * n
    assert [r["test_acc"] for r in records] == [r["test_acc"] for r in read_metrics(resumed.run_dir / "metrics.jsonl")]
    torch.testing.assert_close(full.algo.global_params, resumed.algo.global_params, rtol=0, atol=0)

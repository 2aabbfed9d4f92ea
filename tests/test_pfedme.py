"""pFedMe: the theta inner steps and the local-model step against hand computation, the personal model kept as
client state, and end-to-end learning with personalised accuracy."""

from __future__ import annotations

import pytest
import torch
from quadratic import A, B, TwoParams, client_context
from torch import nn

from fedhet.algorithms import ALGORITHMS, Reply, Setup
from fedhet.algorithms.base import ClientContext, ClientData
from fedhet.algorithms.pfedme import PFedMe, PFedMeConfig
from fedhet.config import TrainSection
from fedhet.engine.simulation import Simulation
from fedhet.models import build_model
from fedhet.results.store import read_metrics
from fedhet.toolkit.flat import FlatModel


class QuadraticPFedMe(PFedMe):
    """f(theta) = 1/2 sum_j A_j (theta_j - B_j)^2 on every batch."""

    def theta_loss(self, theta, x, y):
        return 0.5 * (A * (theta.model.w - B).pow(2)).sum()


@pytest.mark.parametrize("mu", [0.0, 0.01])
def test_theta_and_local_model_steps_match_hand_computation(mu):
    lam, plr, eta, k = 2.0, 0.1, 0.05, 3
    train = TrainSection(batch_size=2, local_steps=2, lr=eta)
    algo = QuadraticPFedMe(
        PFedMeConfig(lam=lam, inner_steps=k, personal_lr=plr, mu=mu),
        Setup(2, num_classes=3, train=train, build_model=TwoParams),
    )
    z = torch.tensor([2.0, 1.0])
    algo.init_server(z, torch.zeros(0))
    model = TwoParams()
    ctx = client_context(algo.configure(1, [0], "train")[0], model, train)
    reply = algo.client_update(ctx)

    w, theta = z.clone(), z.clone()  # both start from the global model; theta carries over between iterations
    for _ in range(2):
        for _ in range(k):
            theta = theta - plr * (A * (theta - B) + lam * (theta - w) + mu * theta)
        w = w - eta * lam * (w - theta)
    torch.testing.assert_close(reply.tensors["params"], w)
    torch.testing.assert_close(ctx.state["personal"], theta)
    torch.testing.assert_close(algo.personalize(ctx), theta)
    torch.testing.assert_close(ctx.message.tensors["params"], z)  # the message is never written


class NormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(4)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(self.norm(x))


def test_reply_carries_the_normalisation_statistics_of_theta():
    train = TrainSection(batch_size=8, local_steps=2, lr=0.1)
    algo = PFedMe(PFedMeConfig(), Setup(2, num_classes=3, train=train, build_model=NormNet))
    model = NormNet()
    flat = FlatModel(model)
    algo.init_server(flat.get_params(), flat.get_buffers())
    data = ClientData(torch.randn(16, 4) * 3 + 2, torch.randint(0, 3, (16,)), 3)
    ctx = ClientContext(
        0,
        1,
        "train",
        algo.configure(1, [0], "train")[0],
        data,
        {},
        model,
        flat,
        train,
        torch.Generator().manual_seed(0),
    )
    reply = algo.client_update(ctx)
    torch.testing.assert_close(reply.tensors["buffers"], algo.theta_model().get_buffers())
    assert not torch.equal(reply.tensors["buffers"], algo.global_buffers)  # theta's running means moved


def test_pfedme_learns_and_reports_personalised_accuracy(tiny_config):
    cfg = tiny_config(
        run={"rounds": 5},
        partition={"local_test_fraction": 0.2},
        train={"lr": 0.1},
        algorithm={"name": "pfedme", "lam": 15.0, "personal_lr": 0.05, "inner_steps": 3},
    )
    sim = Simulation(cfg)
    final = sim.run()["final"]
    assert final["test_acc"] > 0.6, final
    assert final["personal_acc_macro"] > 0.7 and final["personal_clients"] == len(sim.seen)
    assert final["personal_never_sampled"] == sim.fed.num_clients - len(sim.seen)


def test_train_all_sends_to_every_client_and_aggregates_only_the_sampled():
    entry = ALGORITHMS.get("pfedme")
    setup = Setup(3, 3, TrainSection(), lambda: build_model("logreg", (4,), 3))
    algo = entry.obj(entry.params(train_all=True), setup)
    algo.init_server(torch.zeros(3), torch.zeros(0))
    msgs = algo.configure(1, [1], "train")
    assert sorted(msgs) == [0, 1, 2]  # every client trains
    replies = {cid: Reply({"params": torch.full((3,), float(cid + 1))}, num_examples=10) for cid in msgs}
    algo.aggregate(1, replies, "train")
    torch.testing.assert_close(algo.global_params, torch.full((3,), 2.0))  # client 1's model only
    algo.configure(2, [0, 2], "train")
    algo.aggregate(2, {0: replies[0], 1: replies[1]}, "train")  # client 2 dropped: only client 0 counts
    torch.testing.assert_close(algo.global_params, torch.full((3,), 1.0))
    algo.configure(3, [2], "train")
    algo.aggregate(3, {0: replies[0]}, "train")  # no sampled client finished: the model stays
    torch.testing.assert_close(algo.global_params, torch.full((3,), 1.0))


def test_train_all_trains_every_client_and_gives_the_sampled_only_global_model(tiny_config):
    algo = {"name": "pfedme", "lam": 15.0, "personal_lr": 0.05, "inner_steps": 2}
    sims = {}
    for train_all in (False, True):
        cfg = tiny_config(
            run={"name": f"all{train_all}", "rounds": 3},
            partition={"local_test_fraction": 0.2},
            algorithm={**algo, "train_all": train_all},
        )
        sims[train_all] = sim = Simulation(cfg)
        sim.run()
    sampled, everyone = sims[False], sims[True]
    n = everyone.fed.num_clients
    ever_sampled = set().union(*(sampled.sample_clients(r) for r in (1, 2, 3)))
    assert ever_sampled != set(range(n))  # participation 0.5: some clients were never sampled
    assert set(everyone.seen) == set(range(n)) and set(sampled.seen) == ever_sampled
    assert {cid for cid, _ in everyone.executor.store.items()} == set(range(n))  # each has its theta
    torch.testing.assert_close(everyone.algo.global_params, sampled.algo.global_params, rtol=0, atol=0)
    final = read_metrics(everyone.run_dir / "metrics.jsonl")[-1]
    assert final["personal_clients"] == n and final["personal_never_sampled"] == 0 and final["clients"] == n

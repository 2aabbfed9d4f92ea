"""pFedMe: the theta inner steps and the local-model step against hand computation, the personal model kept as
client state, and end-to-end learning with personalised accuracy."""

from __future__ import annotations

import pytest
import torch
from quadratic import A, B, TwoParams, client_context
from torch import nn

from fedhet.algorithms import Setup
from fedhet.algorithms.base import ClientContext, ClientData
from fedhet.algorithms.pfedme import PFedMe, PFedMeConfig
from fedhet.config import TrainSection
from fedhet.engine.flat import FlatModel
from fedhet.engine.simulation import Simulation


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

"""FedNova: normaliser a_i, the server's normalised average, and equivalence with FedAvg where they must agree."""

from __future__ import annotations

import pytest
import torch

from fedhet.algorithms import Reply, Setup
from fedhet.algorithms.base import ClientContext, ClientData
from fedhet.algorithms.fednova import FedNova, FedNovaConfig, effective_steps, normaliser
from fedhet.algorithms.server_opt import ServerOptimizer, SgdParams
from fedhet.config import TrainSection
from fedhet.engine.simulation import Simulation
from fedhet.models import build_model
from fedhet.toolkit.flat import FlatModel


def make_algo(train: TrainSection, num_params: int, mu: float = 0.0, server_lr: float = 1.0) -> FedNova:
    setup = Setup(num_clients=3, num_classes=3, train=train, build_model=lambda: build_model("logreg", (4,), 3))
    algo = FedNova(FedNovaConfig(mu=mu), setup, ServerOptimizer(SgdParams(lr=server_lr)))
    algo.init_server(torch.ones(num_params), torch.zeros(0))
    return algo


class UnitGradientNova(FedNova):
    """A linear loss whose gradient is 1 in every coordinate, so x - y_i = lr * a_i exactly."""

    def local_loss(self, ctx, x, y):
        return sum(p.sum() for p in ctx.model.parameters())


def test_momentum_closed_form_matches_brute_force_sum():
    for rho in (0.0, 0.5, 0.9, 0.99):
        for tau in (1, 2, 7, 40):
            # step t moves along sum_{m < t} rho^m times the gradients; a_i sums that over the tau steps
            brute = sum(sum(rho**m for m in range(t)) for t in range(1, tau + 1))
            assert effective_steps(tau, rho) == pytest.approx(brute, rel=1e-12)
    assert effective_steps(3, 0.9) == pytest.approx(1 + 1.9 + 2.71)


def test_prox_recursion_matches_its_geometric_sum():
    # plain SGD with prox: a_i = sum_{t < tau} (1 - eta mu)^t (Wang et al. 2020, FedProx as a special case)
    assert normaliser(6, eta_mu=0.1) == pytest.approx(sum(0.9**t for t in range(6)))
    assert normaliser(6, momentum=0.0, eta_mu=0.0) == 6.0


@pytest.mark.parametrize(
    ("momentum", "nesterov", "mu"),
    [(0.0, False, 0.0), (0.9, False, 0.0), (0.9, True, 0.0), (0.0, False, 0.5)],
)
def test_normaliser_matches_the_local_dynamics(momentum, nesterov, mu):
    """With a unit gradient every coordinate of x - y_i is lr * a_i where a_i is the dynamics' coefficient sum (every
    case but a proximal term with momentum, where the official recursion is used: see the next tests)."""
    reply, num_params = run_one_client(UnitGradientNova, momentum, nesterov, mu, start=0.0)
    a = reply.scalars["a"]
    assert a == pytest.approx(normaliser(5, momentum, nesterov, 0.1 * mu))
    torch.testing.assert_close(reply.tensors["cum_update"] / 0.1, torch.full((num_params,), a))
    assert set(reply.tensors) == {"cum_update"}


class QuadraticNova(FedNova):
    """Loss sum(p^2 / 2 + p): gradient p + 1, so the trajectory depends on where the proximal term goes."""

    def local_loss(self, ctx, x, y):
        return sum((p.pow(2) / 2 + p).sum() for p in ctx.model.parameters())


def official_step_by_hand(steps, lr, momentum, nesterov, mu, start):
    """JYWa/FedNova's FedNova.step() on one coordinate with gradient x + 1, written out: returns (x_0 - x_K, a_i)."""
    x = x0 = start
    buf = None
    counter = vec = 0.0
    for _ in range(steps):
        d = x + 1.0
        if momentum:
            buf = d if buf is None else momentum * buf + d
            if nesterov:
                d = d + momentum * buf
                d = d + mu * (x - x0)  # d is a new tensor: the buffer is left alone
            else:
                buf = buf + mu * (x - x0)  # d_p aliases the buffer: the term stays in it
                d = buf
        else:
            d = d + mu * (x - x0)
        x = x - lr * d
        if momentum:
            counter = counter * momentum + 1
            vec += counter
        if lr * mu:
            vec = vec * (1 - lr * mu) + 1
        if not momentum and not lr * mu:
            vec += 1
    return x0 - x, vec


@pytest.mark.parametrize(
    ("momentum", "nesterov", "mu"),
    [(0.9, False, 0.5), (0.5, True, 0.5), (0.0, False, 0.5), (0.9, False, 0.0), (0.0, False, 0.0)],
)
def test_local_update_and_normaliser_follow_the_official_step(momentum, nesterov, mu):
    reply, num_params = run_one_client(QuadraticNova, momentum, nesterov, mu, start=0.5)
    update, a = official_step_by_hand(5, 0.1, momentum, nesterov, mu, start=0.5)
    torch.testing.assert_close(reply.tensors["cum_update"], torch.full((num_params,), update))
    if mu or not nesterov:  # without prox, Nesterov uses the exact normaliser, not the official heavy-ball one
        assert reply.scalars["a"] == pytest.approx(a, rel=1e-12)


def test_prox_with_momentum_normaliser_is_the_official_recursion():
    # issue 15's measurement: K = 10, rho = 0.9, mu = 0.5, lr = 0.1 gives a = 41.5 (the former reading gave 35.2)
    counter = vec = 0.0
    for _ in range(10):
        counter = 0.9 * counter + 1
        vec = (vec + counter) * (1 - 0.05) + 1
    assert normaliser(10, 0.9, False, 0.05) == pytest.approx(vec, rel=1e-12)
    assert normaliser(10, 0.9, False, 0.05) == pytest.approx(41.505, abs=1e-3)


def run_one_client(cls, momentum, nesterov, mu, start):
    train = TrainSection(batch_size=4, local_steps=5, lr=0.1, momentum=momentum, nesterov=nesterov)
    model = build_model("logreg", (4,), 3)
    flat = FlatModel(model)
    setup = Setup(num_clients=1, num_classes=3, train=train, build_model=lambda: build_model("logreg", (4,), 3))
    algo = cls(FedNovaConfig(mu=mu), setup)
    algo.init_server(torch.full((flat.num_params,), start), flat.get_buffers())
    ctx = ClientContext(
        cid=0,
        round=1,
        phase="train",
        message=algo.configure(1, [0], "train")[0],
        data=ClientData(torch.randn(4, 4), torch.zeros(4, dtype=torch.long), 3),
        state={},
        model=model,
        flat=flat,
        train=train,
        generator=torch.Generator().manual_seed(0),
    )
    return algo.client_update(ctx), flat.num_params


def test_server_update_matches_hand_computation_with_unequal_steps():
    algo = make_algo(TrainSection(), num_params=3)
    replies = {
        0: Reply({"cum_update": torch.tensor([0.2, 0.0, -0.2])}, {"a": 2.0}, num_examples=10),
        1: Reply({"cum_update": torch.tensor([1.0, 0.5, 0.0])}, {"a": 5.0}, num_examples=30),
    }
    algo.aggregate(1, replies, "train")
    # p = (0.25, 0.75); tau_eff = 0.25*2 + 0.75*5 = 4.25; sum p d/a = (0.175, 0.075, -0.025)
    assert algo.tau_eff == pytest.approx(4.25)
    torch.testing.assert_close(algo.global_params, torch.tensor([1 - 0.74375, 1 - 0.31875, 1 + 0.10625]))


def test_server_lr_scales_the_normalised_step():
    algo = make_algo(TrainSection(), num_params=2, server_lr=0.5)
    replies = {0: Reply({"cum_update": torch.tensor([0.4, -0.2])}, {"a": 4.0}, num_examples=5)}
    algo.aggregate(1, replies, "train")  # one client: tau_eff = a, so the proposed step is d itself
    torch.testing.assert_close(algo.global_params, torch.tensor([1 - 0.2, 1 + 0.1]))


def test_equal_steps_without_momentum_is_fedavg(tiny_config):
    train = {"participation": 1.0, "local_steps": 3}
    nova = Simulation(tiny_config(run={"name": "nova", "rounds": 1}, train=train, algorithm={"name": "fednova"}))
    avg = Simulation(tiny_config(run={"name": "avg", "rounds": 1}, train=train, algorithm={"name": "fedavg"}))
    nova.run(), avg.run()
    torch.testing.assert_close(nova.algo.global_params, avg.algo.global_params)
    assert nova.algo.tau_eff == 3.0


def test_fednova_learns_on_digits_with_momentum_and_prox(tiny_config):
    cfg = tiny_config(
        run={"rounds": 6},
        train={"participation": 1.0, "lr": 0.05, "momentum": 0.5},
        algorithm={"name": "fednova", "mu": 0.01},
    )
    sim = Simulation(cfg)
    summary = sim.run()
    assert summary["final"]["test_acc"] > 0.8, summary["final"]
    assert summary["final"]["tau_eff"] > 1.0

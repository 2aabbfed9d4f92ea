"""SCAFFOLD option II: corrected local steps, control-variate updates, server step and resume."""

from __future__ import annotations

import pytest
import torch
from quadratic import A, B, TwoParams, client_context, quadratic_loss

from fedhet.algorithms import Reply, Setup
from fedhet.algorithms.base import ClientData
from fedhet.algorithms.scaffold import Scaffold, ScaffoldConfig
from fedhet.algorithms.server_opt import ServerOptimizer, SgdParams
from fedhet.config import TrainSection
from fedhet.engine.simulation import Simulation
from fedhet.models import build_model
from fedhet.results.store import read_metrics
from fedhet.toolkit.flat import FlatModel


class QuadraticScaffold(Scaffold):
    """Local loss 1/2 sum_j A_j (w_j - B_j)^2, so the loss gradient is A * (w - B)."""

    def local_loss(self, ctx, x, y):
        return quadratic_loss(ctx.model)


def make_setup(train: TrainSection, num_clients: int) -> Setup:
    return Setup(num_clients, num_classes=3, train=train, build_model=lambda: build_model("logreg", (4,), 3))


def make_ctx(cid, msg, model, data, train, state):
    return client_context(msg, model, train, data=data, state=state, cid=cid)


@pytest.mark.parametrize(
    ("momentum", "correction", "divisor"), [(0.0, True, 3.0), (0.0, False, 3.0), (0.9, False, 3.0), (0.9, True, 5.61)]
)
def test_quadratic_client_update_matches_hand_computation(momentum, correction, divisor):
    train = TrainSection(batch_size=4, local_steps=3, lr=0.1, momentum=momentum)
    algo = QuadraticScaffold(ScaffoldConfig(momentum_correction=correction), make_setup(train, num_clients=4))
    x, c, c_i = torch.tensor([2.0, 1.0]), torch.tensor([0.3, -0.2]), torch.tensor([-0.1, 0.4])
    algo.init_server(x, torch.zeros(0))
    algo.c = c
    data = ClientData(torch.zeros(4, 1), torch.zeros(4, dtype=torch.long), 3)
    ctx = make_ctx(0, algo.configure(1, [0], "train")[0], TwoParams(), data, train, {"c_i": c_i.clone()})
    reply = algo.client_update(ctx)

    w, buf = x.clone(), None
    for _ in range(3):
        d = A * (w - B) + c - c_i  # the corrected gradient g + c - c_i
        buf = d if buf is None else momentum * buf + d
        w = w - 0.1 * buf
    c_i_new = c_i - c + (x - w) / (divisor * 0.1)  # option II (K = 5.61 = 1 + 1.9 + 2.71 with momentum correction)
    assert set(reply.tensors) == {"delta_y", "delta_c"}
    torch.testing.assert_close(reply.tensors["delta_y"], w - x)
    torch.testing.assert_close(reply.tensors["delta_c"], c_i_new - c_i)
    torch.testing.assert_close(ctx.state["c_i"], c_i_new)
    torch.testing.assert_close(ctx.message.tensors["c"], c)  # the message is read, never written


class LinearScaffold(Scaffold):
    """Local loss G . w: a constant gradient G, so the true mean gradient that c_i estimates is known exactly."""

    def local_loss(self, ctx, x, y):
        return (G * ctx.model.w).sum()


G = torch.tensor([0.7, -1.3])


@pytest.mark.parametrize(("momentum", "nesterov"), [(0.0, False), (0.5, False), (0.9, False), (0.9, True)])
def test_control_variate_is_the_true_gradient_under_momentum_by_default(momentum, nesterov):
    """With a constant gradient G every corrected step uses G + c - c_i, so option II must return c_i+ = G for any
    old c and c_i. The default divisor does under momentum; K * eta_l is 1/(1 - momentum) times too large."""
    train = TrainSection(batch_size=4, local_steps=7, lr=0.05, momentum=momentum, nesterov=nesterov)
    for correction in (True, False):
        config = ScaffoldConfig() if correction else ScaffoldConfig(momentum_correction=False)  # True is the default
        algo = LinearScaffold(config, make_setup(train, num_clients=4))
        algo.init_server(torch.tensor([2.0, 1.0]), torch.zeros(0))
        algo.c = torch.tensor([0.3, -0.2])
        state = {"c_i": torch.tensor([-0.1, 0.4])}
        algo.client_update(make_ctx(0, algo.configure(1, [0], "train")[0], TwoParams(), None, train, state))
        if correction or not momentum:
            torch.testing.assert_close(state["c_i"], G)
        else:
            assert (state["c_i"] - G).norm() > 0.5 * G.norm()  # far off: the over-correction that diverges


@pytest.mark.parametrize("weighting", ["uniform", "samples"])
def test_unequal_step_counts_give_finite_exact_variates_and_scaled_server_update(weighting):
    train = TrainSection(batch_size=4, local_epochs=1, lr=0.2)
    algo = Scaffold(ScaffoldConfig(weighting=weighting), make_setup(train, 5), ServerOptimizer(SgdParams(lr=0.5)))
    torch.manual_seed(0)
    dim = FlatModel(build_model("logreg", (4,), 3)).num_params
    x, c = torch.randn(dim), torch.randn(dim)
    algo.init_server(x, torch.zeros(0))
    algo.c = c.clone()
    msg = algo.configure(1, [0, 1], "train")[0]
    old_c_i = {0: torch.randn(dim), 1: torch.zeros(dim)}  # client 1 trains for the first time: no state, zeros
    states = {0: {"c_i": old_c_i[0].clone()}, 1: {}}
    replies, steps = {}, {}
    for cid, n in ((0, 10), (1, 25)):  # ceil(10/4) = 3 and ceil(25/4) = 7 local steps
        data = ClientData(torch.randn(n, 4), torch.randint(0, 3, (n,)), 3)
        ctx = make_ctx(cid, msg, build_model("logreg", (4,), 3), data, train, states[cid])
        replies[cid] = algo.client_update(ctx)
        steps[cid] = ctx.steps
    assert steps == {0: 3, 1: 7}
    for cid, k in steps.items():
        r = replies[cid]
        assert all(torch.isfinite(t).all() for t in r.tensors.values())
        y = x + r.tensors["delta_y"]
        torch.testing.assert_close(states[cid]["c_i"], old_c_i[cid] - c + (x - y) / (k * 0.2))
    algo.aggregate(1, replies, "train")
    w = [0.5, 0.5] if weighting == "uniform" else [10 / 35, 25 / 35]
    mean_dy = w[0] * replies[0].tensors["delta_y"] + w[1] * replies[1].tensors["delta_y"]
    mean_dc = (replies[0].tensors["delta_c"] + replies[1].tensors["delta_c"]) / 2
    torch.testing.assert_close(algo.global_params, x + 0.5 * mean_dy)  # eta_g = server.lr = 0.5
    torch.testing.assert_close(algo.c, c + (2 / 5) * mean_dc)  # |S|/N = 2/5, uniform whatever the weighting


def test_server_ignores_everything_but_deltas():
    algo = Scaffold(ScaffoldConfig(), make_setup(TrainSection(), 4))
    algo.init_server(torch.ones(2), torch.zeros(0))
    reply = Reply({"delta_y": torch.tensor([0.5, -1.0]), "delta_c": torch.tensor([4.0, 8.0])}, num_examples=3)
    algo.aggregate(1, {2: reply}, "train")
    torch.testing.assert_close(algo.global_params, torch.tensor([1.5, 0.0]))
    torch.testing.assert_close(algo.c, torch.tensor([1.0, 2.0]))
    assert algo.round_metrics(1) == {"c_norm": pytest.approx(5**0.5)}


@pytest.mark.parametrize(("weighting", "train"), [("uniform", {"local_steps": 1}), ("samples", {})])
def test_first_round_with_zero_variates_is_fedavg(tiny_config, weighting, train):
    scaffold = Simulation(
        tiny_config(run={"name": "s", "rounds": 1}, train=train, algorithm={"name": "scaffold", "weighting": weighting})
    )
    fedavg = Simulation(
        tiny_config(run={"name": "f", "rounds": 1}, train=train, algorithm={"name": "fedavg", "weighting": weighting})
    )
    scaffold.run(), fedavg.run()
    torch.testing.assert_close(scaffold.algo.global_params, fedavg.algo.global_params)


def test_scaffold_learns_on_digits_and_c_is_the_mean_of_client_variates(tiny_config):
    sim = Simulation(tiny_config(run={"rounds": 6}, algorithm={"name": "scaffold"}))
    summary = sim.run()
    assert summary["final"]["test_acc"] > 0.8, summary["final"]
    states = dict(sim.executor.store.items())
    assert 0 < len(states) <= sim.fed.num_clients  # participation 0.5: clients that never trained hold no state
    mean_c_i = sum(s["c_i"] for s in states.values()) / sim.fed.num_clients
    torch.testing.assert_close(sim.algo.c, mean_c_i)


def test_kill_and_resume_is_bit_exact(tiny_config, kill_and_resume):
    algo = {"name": "scaffold", "momentum_correction": True}
    full, resumed = kill_and_resume(
        lambda name: tiny_config(run={"name": name, "rounds": 4}, train={"momentum": 0.5}, algorithm=algo)
    )
    keys = ("round", "test_acc", "test_loss", "train_loss", "c_norm")
    r_full, r_cut = (read_metrics(s.run_dir / "metrics.jsonl") for s in (full, resumed))
    assert [{k: r[k] for k in keys} for r in r_full] == [{k: r[k] for k in keys} for r in r_cut]
    torch.testing.assert_close(full.algo.global_params, resumed.algo.global_params, rtol=0, atol=0)
    torch.testing.assert_close(full.algo.c, resumed.algo.c, rtol=0, atol=0)

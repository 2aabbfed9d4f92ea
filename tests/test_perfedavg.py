"""Per-FedAvg: first-order and Hessian-free meta-steps against hand computation, the one-step personalisation on
training data (or, marked, on test data), and end-to-end learning."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from quadratic import A, B, TwoParams, client_context, quadratic_loss

from fedhet.algorithms import Setup
from fedhet.algorithms.base import ClientData
from fedhet.algorithms.perfedavg import PerFedAvg, PerFedAvgConfig
from fedhet.config import TrainSection
from fedhet.engine.simulation import Simulation
from fedhet.models import build_model
from fedhet.toolkit.flat import FlatModel


class QuadraticPerFedAvg(PerFedAvg):
    """f(w) = 1/2 sum_j A_j (w_j - B_j)^2 on every batch: gradient A (w - B), Hessian diag(A)."""

    def task_loss(self, ctx, x, y):
        return quadratic_loss(ctx.model)


def make_ctx(msg, model, train, data=None, seed=0):
    data = data or ClientData(torch.zeros(6, 1), torch.zeros(6, dtype=torch.long), 3)
    return client_context(msg, model, train, data=data, seed=seed)


def make_algo(cls, train, **cfg):
    setup = Setup(2, num_classes=3, train=train, build_model=lambda: build_model("logreg", (4,), 3))
    return cls(PerFedAvgConfig(**cfg), setup)


@pytest.mark.parametrize("variant", ["first_order", "hessian_free"])
@pytest.mark.parametrize("inner_steps", [1, 2])
def test_meta_steps_match_hand_computation(variant, inner_steps):
    alpha, beta = 0.1, 0.05
    train = TrainSection(batch_size=2, local_steps=3, lr=beta)
    algo = make_algo(QuadraticPerFedAvg, train, inner_lr=alpha, inner_steps=inner_steps, variant=variant)
    z = torch.tensor([2.0, 1.0])
    algo.init_server(z, torch.zeros(0))
    reply = algo.client_update(make_ctx(algo.configure(1, [0], "train")[0], TwoParams(), train))

    w = z.clone()
    for _ in range(3):
        adapted = w.clone()
        for _ in range(inner_steps):
            adapted = adapted - alpha * A * (adapted - B)
        g = A * (adapted - B)
        if variant == "hessian_free":
            g = g - alpha * A * g  # (I - alpha H) g with H = diag(A); the central difference is exact here
        w = w - beta * g
    torch.testing.assert_close(reply.tensors["params"], w)


@pytest.mark.parametrize("leaky", [False, True])
def test_personalisation_is_one_step_from_the_global_model_on_train_or_test_data(leaky):
    train = TrainSection(batch_size=32, local_steps=1, lr=0.1)  # a batch of 32 covers each whole split
    algo = make_algo(PerFedAvg, train, inner_lr=0.3, leaky=leaky)
    torch.manual_seed(0)
    model = build_model("logreg", (4,), 3)
    z = torch.randn(FlatModel(model).num_params)
    algo.init_server(z, torch.zeros(0))
    data = ClientData(torch.randn(10, 4), torch.randint(0, 3, (10,)), 3, torch.randn(5, 4), torch.randint(0, 3, (5,)))
    personal = algo.personalize(make_ctx(algo.global_message(1), model, train, data))

    ref = build_model("logreg", (4,), 3)
    flat = FlatModel(ref)
    flat.set_params(z)
    x, y = (data.x_test, data.y_test) if leaky else (data.x, data.y)
    F.cross_entropy(ref(x), y).backward()
    torch.testing.assert_close(personal, z - 0.3 * flat.grad)
    assert algo.personal_metric_prefix == ("personal_leaky" if leaky else "personal")


@pytest.mark.parametrize("variant", ["first_order", "hessian_free"])
def test_perfedavg_learns_and_reports_personalised_accuracy(tiny_config, variant):
    cfg = tiny_config(
        run={"rounds": 5},
        partition={"local_test_fraction": 0.2},
        algorithm={"name": "perfedavg", "variant": variant, "inner_lr": 0.05},
    )
    sim = Simulation(cfg)
    final = sim.run()["final"]
    assert final["test_acc"] > 0.7, final
    assert final["personal_acc_macro"] > 0.7 and final["personal_clients"] == len(sim.seen)

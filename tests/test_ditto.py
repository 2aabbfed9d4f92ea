"""Ditto: the global (FedAvg) update and the personal proximal iterations against hand computation, the personal
model kept as client state across rounds, and end-to-end learning with personalised accuracy that resumes bit for
bit."""

from __future__ import annotations

import pytest
import torch
from quadratic import A, B, TwoParams, client_context, quadratic_loss

from fedhet.algorithms import Setup
from fedhet.algorithms.ditto import PERSONAL, Ditto, DittoConfig
from fedhet.config import TrainSection
from fedhet.results.store import read_metrics


class QuadraticDitto(Ditto):
    """F(w) = 1/2 sum_j A_j (w_j - B_j)^2 on every batch, for both models."""

    def local_loss(self, ctx, x, y):
        return quadratic_loss(ctx.model)

    def personal_loss(self, ctx, x, y):
        return quadratic_loss(ctx.model)


def run_round(algo, rnd, state, train):
    ctx = client_context(algo.configure(rnd, [0], "train")[0], TwoParams(), train, state=state)
    ctx.round = rnd
    return algo.client_update(ctx), ctx


def global_steps(w, eta, momentum, steps):
    """torch.optim.SGD with momentum from a fresh buffer (the shared loop's optimiser)."""
    buf = None
    for _ in range(steps):
        g = A * (w - B)
        buf = g if buf is None else momentum * buf + g
        w = w - eta * buf
    return w


def personal_steps(v, anchor, lam, lr, steps):
    for _ in range(steps):
        v = v - lr * (A * (v - B) + lam * (v - anchor))
    return v


@pytest.mark.parametrize(
    ("personal_lr", "personal_epochs", "expected_steps"),
    [(None, None, 2), (0.2, 1.5, 3)],  # 4 samples, batch 2: 2 global steps; 1.5 epochs = ceil(1.5 * 2) = 3
)
def test_global_and_personal_updates_match_hand_computation(personal_lr, personal_epochs, expected_steps):
    lam, eta, momentum = 0.5, 0.1, 0.5
    train = TrainSection(batch_size=2, local_epochs=1, lr=eta, momentum=momentum)
    algo = QuadraticDitto(
        DittoConfig(lam=lam, personal_lr=personal_lr, personal_epochs=personal_epochs),
        Setup(2, num_classes=3, train=train, build_model=TwoParams),
    )
    plr = eta if personal_lr is None else personal_lr
    z = torch.tensor([2.0, 1.0])
    algo.init_server(z, torch.zeros(0))

    state: dict[str, torch.Tensor] = {}
    reply, ctx = run_round(algo, 1, state, train)
    w1 = global_steps(z, eta, momentum, 2)
    v1 = personal_steps(z, z, lam, plr, expected_steps)  # first round: v starts from the received model
    torch.testing.assert_close(reply.tensors["params"], w1)
    torch.testing.assert_close(state[PERSONAL], v1)
    torch.testing.assert_close(algo.personalize(ctx), v1)
    torch.testing.assert_close(ctx.message.tensors["params"], z)  # the message is never written

    algo.aggregate(1, {0: reply}, "train")
    torch.testing.assert_close(algo.global_params, w1)
    reply, ctx = run_round(algo, 2, state, train)
    # Round 2: v carries over from the state and is pulled toward the new global model w1, never toward w_k.
    v2 = personal_steps(v1, w1, lam, plr, expected_steps)
    torch.testing.assert_close(reply.tensors["params"], global_steps(w1, eta, momentum, 2))
    torch.testing.assert_close(state[PERSONAL], v2)
    assert reply.metrics["personal_loss"] > 0


def test_lam_zero_makes_the_personal_model_a_purely_local_one():
    train = TrainSection(batch_size=2, local_steps=3, lr=0.1)
    algo = QuadraticDitto(DittoConfig(lam=0.0), Setup(2, num_classes=3, train=train, build_model=TwoParams))
    z = torch.tensor([2.0, 1.0])
    algo.init_server(z, torch.zeros(0))
    state: dict[str, torch.Tensor] = {}
    reply, _ = run_round(algo, 1, state, train)
    # Without momentum and with lam = 0 the personal model takes exactly the global update's steps.
    torch.testing.assert_close(state[PERSONAL], reply.tensors["params"])


def test_a_negative_lam_is_refused_with_its_name():
    from fedhet.config import load_config
    from fedhet.engine.simulation import resolve_config
    from fedhet.errors import ConfigError

    with pytest.raises(ConfigError, match="algorithm 'ditto': lam: must be greater than or equal to 0"):
        resolve_config(load_config(None, ["algorithm.name=ditto", "algorithm.lam=-1"]))


# ------------------------------------------------------------------------------------------- end to end
def ditto_config(tiny_config, name, **algo):
    return tiny_config(
        run={"name": name, "rounds": 5},
        partition={"local_test_fraction": 0.2},
        train={"participation": 1.0},  # FedRANE's protocol: every client every round
        algorithm={"name": "ditto", **algo},
    )


def test_ditto_learns_both_models_and_resumes_bit_exact(tiny_config, kill_and_resume):
    full, resumed = kill_and_resume(lambda name: ditto_config(tiny_config, name))
    records = read_metrics(full.run_dir / "metrics.jsonl")
    final = records[-1]
    assert final["test_acc"] > 0.7, final  # 10 classes: chance is 0.1
    # After 5 short rounds the personal models (trained on ~240 samples each) trail the global one (0.76 vs 0.92).
    assert final["personal_acc_micro"] > 0.7 and final["personal_clients"] == len(full.seen), final
    keys = ("round", "test_acc", "test_loss", "train_loss", "personal_acc_micro", "personal_acc_macro")
    assert [{k: r[k] for k in keys} for r in records] == [
        {k: r[k] for k in keys} for r in read_metrics(resumed.run_dir / "metrics.jsonl")
    ]
    torch.testing.assert_close(full.algo.global_params, resumed.algo.global_params, rtol=0, atol=0)
    assert full.executor.store.items()
    for cid, state in full.executor.store.items():
        torch.testing.assert_close(state[PERSONAL], resumed.executor.store.get(cid)[PERSONAL], rtol=0, atol=0)


def test_the_global_model_is_exactly_fedavgs(tiny_config):
    """The personal iterations run after the global update and draw their batches afterwards, so the aggregated
    model is FedAvg's bit for bit, whatever lam is."""
    from fedhet.engine.simulation import Simulation

    sims = {
        name: Simulation(tiny_config(run={"name": name}, algorithm={"name": name}, train={"momentum": 0.5}))
        for name in ("fedavg", "ditto")
    }
    finals = {name: sim.run()["final"] for name, sim in sims.items()}
    assert finals["ditto"]["test_acc"] == finals["fedavg"]["test_acc"]
    torch.testing.assert_close(sims["ditto"].algo.global_params, sims["fedavg"].algo.global_params, rtol=0, atol=0)

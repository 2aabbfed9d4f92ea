"""APPLE: one local step of the core and the DR vector against hand computation, the proximal schedule, the server's
core stack (shared by every message, rows replaced by replies), the personalised mixture, and end-to-end learning
that resumes bit for bit."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedhet.algorithms import ALGORITHMS, Setup
from fedhet.algorithms.apple import STATE_P, proximal_weight
from fedhet.algorithms.base import ClientContext, ClientData, Reply
from fedhet.config import TrainSection
from fedhet.models.base import FedModel
from fedhet.results.store import read_metrics
from fedhet.toolkit.flat import FlatModel

D, C, N = 4, 3, 3


def linear_model() -> FedModel:
    """Logits = x W^T + b: the features are the inputs."""
    return FedModel({"flat": nn.Flatten()}, D, C)


def make_apple(train: TrainSection | None = None, **params):
    entry = ALGORITHMS.get("apple")
    cfg = entry.params(**params)
    train = train or TrainSection(batch_size=6, local_steps=1, lr=0.1)
    algo = entry.obj(cfg, Setup(N, C, train, linear_model))
    torch.manual_seed(0)
    model = linear_model()
    flat = FlatModel(model)
    algo.init_server(flat.get_params(), flat.get_buffers())
    return algo, model, flat


def context(algo, model, flat, rnd, cid, data, state) -> ClientContext:
    msg = algo.configure(rnd, [cid], "train")[cid]
    return ClientContext(
        cid, rnd, "train", msg, data, state, model, flat, algo.setup.train, torch.Generator().manual_seed(rnd)
    )


def test_proximal_weight_follows_the_official_schedules():
    cfg = ALGORITHMS.get("apple").params(mu=0.5, decay_rounds=4)
    assert [proximal_weight(cfg, r) for r in (1, 3, 5, 9)] == pytest.approx([0.5, 0.5 * 0.001**0.5, 0.0, 0.0])
    cos = ALGORITHMS.get("apple").params(mu=0.5, decay_rounds=4, scheduler="cosine")
    assert [proximal_weight(cos, r) for r in (1, 2, 3, 5)] == pytest.approx(
        [0.5, 0.5 * (math.cos(math.pi / 4) + 1) / 2, 0.25, 0]
    )
    assert proximal_weight(ALGORITHMS.get("apple").params(mu=0.0), 1) == 0.0


@pytest.mark.parametrize(("rnd", "scale"), [(1, False), (3, False), (3, True)])
def test_one_step_of_core_and_dr_vector_matches_hand_computation(rnd, scale):
    lr, dr_lr, mu = 0.1, 0.05, 0.3
    algo, model, flat = make_apple(dr_lr=dr_lr, mu=mu, decay_rounds=4, scheduler="cosine", scale_core_lr=scale)
    g = torch.Generator().manual_seed(1)
    algo.cores = torch.randn(N, flat.num_params, generator=g)  # three clients' cores from earlier rounds
    x, y = torch.randn(6, D, generator=g), torch.tensor([0, 1, 2, 2, 1, 0])
    p = torch.tensor([0.5, 0.3, 0.2])
    cid = 1
    ctx = context(algo, model, flat, rnd, cid, ClientData(x, y, C), {STATE_P: p.clone()})
    cores = algo.cores.clone()
    reply = algo.client_update(ctx)

    w = (p[:, None] * cores).sum(0)  # the personalised model sum_j p_j c_j
    W, b = w[: C * D].view(C, D), w[C * D :]
    err = ((x @ W.T + b).softmax(1) - F.one_hot(y, C).float()) / 6
    grad_w = torch.cat([(err.T @ x).reshape(-1), err.sum(0)])  # gradient of the mean cross-entropy at w
    eta = lr * (N if scale else 1)  # PFLlib's step: N times the learning rate
    torch.testing.assert_close(reply.tensors["params"], cores[cid] - eta * p[cid] * grad_w)

    lam_mu = mu * (math.cos(math.pi * (rnd - 1) / 4) + 1) / 2
    grad_p = cores @ grad_w + 2 * lam_mu * (p - 1 / N)
    torch.testing.assert_close(ctx.state[STATE_P], p - dr_lr * grad_p)
    assert torch.equal(algo.cores, cores)  # the message's stack is read-only


def test_the_dr_vector_takes_momentum_steps_at_the_moving_core():
    lr, dr_lr = 0.2, 0.1
    algo, model, flat = make_apple(
        train=TrainSection(batch_size=6, local_steps=2, lr=lr), mu=0.0, dr_lr=dr_lr, scale_core_lr=False
    )
    g = torch.Generator().manual_seed(2)
    algo.cores = torch.randn(N, flat.num_params, generator=g)
    x, y = torch.randn(6, D, generator=g), torch.tensor([0, 1, 2, 2, 1, 0])
    p = torch.tensor([0.2, 0.2, 0.6])
    ctx = context(algo, model, flat, 1, 0, ClientData(x, y, C), {STATE_P: p.clone()})
    reply = algo.client_update(ctx)

    def grads(q, cores):
        """(gradient at the mixture, gradient of p) for DR vector q and cores."""
        w = (q[:, None] * cores).sum(0)
        W, b = w[: C * D].view(C, D), w[C * D :]
        err = ((x @ W.T + b).softmax(1) - F.one_hot(y, C).float()) / 6
        gw = torch.cat([(err.T @ x).reshape(-1), err.sum(0)])
        return gw, cores @ gw

    cores = algo.cores.clone()
    gw1, gp1 = grads(p, cores)
    p1 = p - dr_lr * gp1
    cores[0] = cores[0] - lr * p[0] * gw1  # the client's own core has moved before the second step
    gw2, gp2 = grads(p1, cores)
    torch.testing.assert_close(ctx.state[STATE_P], p1 - dr_lr * (0.9 * gp1 + gp2))  # momentum 0.9 on p
    torch.testing.assert_close(reply.tensors["params"], cores[0] - lr * p1[0] * gw2)  # train.momentum 0


def test_every_message_shares_one_core_stack_and_replies_replace_rows():
    algo, model, flat = make_apple(core_init="independent")
    msgs = algo.configure(1, [0, 2], "train")
    assert msgs[0].tensors["cores"] is msgs[2].tensors["cores"] is algo.cores
    assert msgs[2].tensors["params"].data_ptr() == algo.cores[2].data_ptr()  # a view, not a copy
    assert not torch.equal(algo.cores[0], algo.cores[1])  # independently initialised cores
    new = {0: torch.full((flat.num_params,), 1.0), 2: torch.full((flat.num_params,), 4.0)}
    old_row1 = algo.cores[1].clone()
    algo.aggregate(
        1,
        {c: Reply(tensors={"params": v}, num_examples=n) for (c, v), n in zip(new.items(), (3, 1), strict=True)},
        "train",
    )
    assert torch.equal(algo.cores[0], new[0]) and torch.equal(algo.cores[2], new[2])
    assert torch.equal(algo.cores[1], old_row1)  # a client that did not reply keeps its core
    # the reported global model: sample-weighted mean of the cores of clients that have replied
    torch.testing.assert_close(algo.global_params, torch.full((flat.num_params,), (3 * 1.0 + 1 * 4.0) / 4))


def test_shared_initialisation_starts_every_core_at_the_global_model():
    algo, _, _ = make_apple(core_init="shared")
    assert all(torch.equal(row, algo.global_params) for row in algo.cores)


def test_personalised_model_is_the_clients_mixture_of_the_cores():
    algo, model, flat = make_apple()
    p = torch.tensor([0.1, 0.7, 0.2])
    msg = algo.global_message(2)
    ctx = ClientContext(
        0,
        2,
        "personalize",
        msg,
        ClientData(torch.zeros(1, D), torch.zeros(1).long(), C),
        {STATE_P: p},
        model,
        flat,
        algo.setup.train,
        torch.Generator(),
    )
    torch.testing.assert_close(algo.personalize(ctx), (p[:, None] * algo.cores).sum(0))
    ctx.state = {}
    assert algo.personalize(ctx) is None  # a client that never trained has no personalised model


def apple_config(tiny_config, name, rounds=8, **algo):
    return tiny_config(
        run={"name": name, "rounds": rounds},
        partition={"local_test_fraction": 0.25},
        train={"participation": 1.0, "local_epochs": 3},
        algorithm={"name": "apple", **algo},
    )


def test_apple_learns_personalised_models_and_resumes_bit_exact(tiny_config, kill_and_resume):
    full, resumed = kill_and_resume(lambda name: apple_config(tiny_config, name), stop_after=4)
    records = read_metrics(full.run_dir / "metrics.jsonl")
    final = records[-1]
    assert final["personal_acc_micro"] > 0.85 and final["personal_clients"] == 6, final  # 10 classes: chance 0.1
    assert final["personal_acc_micro"] > records[0]["personal_acc_micro"] + 0.1
    assert final["test_acc"] > 0.5  # the reported mean of the cores
    keys = ("round", "test_acc", "train_loss", "personal_acc_micro", "personal_acc_macro")
    assert [{k: r[k] for k in keys} for r in records] == [
        {k: r[k] for k in keys} for r in read_metrics(resumed.run_dir / "metrics.jsonl")
    ]
    torch.testing.assert_close(full.algo.cores, resumed.algo.cores, rtol=0, atol=0)
    for cid, state in full.executor.store.items():
        torch.testing.assert_close(state[STATE_P], resumed.executor.store.get(cid)[STATE_P], rtol=0, atol=0)


def test_the_official_setting_learns_too(tiny_config):
    """Independently initialised cores and unscaled steps (pFL-APPLE's code): slower, but it learns."""
    from fedhet.engine.simulation import Simulation

    sim = Simulation(apple_config(tiny_config, "official", rounds=8, core_init="independent", scale_core_lr=False))
    records = sim.run() and read_metrics(sim.run_dir / "metrics.jsonl")
    assert records[-1]["personal_acc_micro"] > 0.5 > records[0]["personal_acc_micro"] + 0.3, records[-1]

"""FML: the mutual-learning losses and one local step of both models against hand computation, the private model
and its momentum kept on the client, and a run that learns and resumes bit for bit."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedhet.algorithms import ALGORITHMS, Setup
from fedhet.algorithms.base import ClientContext, ClientData
from fedhet.algorithms.fml import MOMENTUM, PRIVATE, mutual_loss
from fedhet.config import TrainSection
from fedhet.models.base import FedModel
from fedhet.results.store import read_metrics
from fedhet.toolkit.flat import FlatModel

D, C = 4, 3


def linear_model() -> FedModel:
    return FedModel({"flat": nn.Flatten()}, D, C)  # logits = x W^T + b


def test_mutual_loss_by_hand():
    own = torch.tensor([[1.0, 0.0, -1.0], [0.5, 0.5, 2.0]])
    other = torch.tensor([[0.0, 2.0, 0.0], [1.0, -1.0, 0.0]])
    y = torch.tensor([0, 2])
    total = 0.0
    for o, t, label in zip(own.tolist(), other.tolist(), y.tolist(), strict=True):
        log_p = [v - math.log(sum(math.exp(u) for u in o)) for v in o]
        q = [math.exp(v) / sum(math.exp(u) for u in t) for v in t]
        ce = -log_p[label]
        kl = sum(qi * (math.log(qi) - lp) for qi, lp in zip(q, log_p, strict=True))
        total += 0.3 * ce + 0.7 * kl
    assert mutual_loss(own, other, y, 0.3).item() == pytest.approx(total / 2, rel=1e-6)


def test_one_step_of_both_models_by_hand():
    lr, mom, wd, alpha, beta = 0.1, 0.9, 0.01, 0.3, 0.6
    train = TrainSection(batch_size=5, local_steps=1, lr=lr, momentum=mom, weight_decay=wd)
    entry = ALGORITHMS.get("fml")
    algo = entry.obj(entry.params(alpha=alpha, beta=beta), Setup(2, C, train, linear_model))
    model = linear_model()
    flat = FlatModel(model)
    g = torch.Generator().manual_seed(1)
    algo.init_server(torch.randn(flat.num_params, generator=g), flat.get_buffers())
    own, old_buf = torch.randn(flat.num_params, generator=g), torch.randn(flat.num_params, generator=g)
    x, y = torch.randn(5, D, generator=g), torch.tensor([0, 1, 2, 2, 0])
    msg = algo.configure(1, [0], "train")[0]
    state = {PRIVATE: own.clone(), MOMENTUM: old_buf.clone()}
    ctx = ClientContext(0, 1, "train", msg, ClientData(x, y, C), state, model, flat, train, torch.Generator())
    reply = algo.client_update(ctx)

    def split(w):
        return w[: C * D].view(C, D), w[C * D :]

    w = algo.global_params
    (Wm, bm), (Wp, bp) = split(w), split(own)
    m, p = x @ Wm.T + bm, x @ Wp.T + bp
    onehot = F.one_hot(y, C).float()
    sm, sp = m.softmax(1), p.softmax(1)
    dm = (beta * (sm - onehot) + (1 - beta) * (sm - sp)) / 5  # each model's loss gradient at its logits
    dp = (alpha * (sp - onehot) + (1 - alpha) * (sp - sm)) / 5
    grad_m = torch.cat([(dm.T @ x).reshape(-1), dm.sum(0)])
    grad_p = torch.cat([(dp.T @ x).reshape(-1), dp.sum(0)])
    # the meme model's momentum starts fresh each round: its first direction is g + wd w
    torch.testing.assert_close(reply.tensors["params"], w - lr * (grad_m + wd * w))
    # the private model's momentum buffer lives across rounds: buf <- mom buf + (g + wd w)
    buf = mom * old_buf + grad_p + wd * own
    torch.testing.assert_close(ctx.state[MOMENTUM], buf)
    torch.testing.assert_close(ctx.state[PRIVATE], own - lr * buf)
    assert algo.personalize(ctx) is ctx.state[PRIVATE]


def test_a_new_clients_private_model_is_its_own_random_initialisation():
    train = TrainSection(batch_size=5, local_steps=1, lr=0.1)
    entry = ALGORITHMS.get("fml")
    algo = entry.obj(entry.params(), Setup(2, C, train, linear_model))
    model = linear_model()
    flat = FlatModel(model)
    algo.init_server(flat.get_params(), flat.get_buffers())
    msg = algo.configure(1, [0], "train")[0]
    data = ClientData(torch.randn(5, D), torch.tensor([0, 1, 2, 2, 0]), C)
    inits = []
    for seed in (0, 0, 1):
        ctx = ClientContext(0, 1, "train", msg, data, {}, model, flat, train, torch.Generator().manual_seed(seed))
        algo.before_local(ctx)
        inits.append(ctx.state[PRIVATE])
    assert torch.equal(inits[0], inits[1]) and not torch.equal(inits[0], inits[2])
    assert not torch.equal(inits[0], algo.global_params)


def test_fml_learns_and_resumes_bit_exact(tiny_config, kill_and_resume):
    def make(name):
        return tiny_config(
            run={"name": name, "rounds": 5},
            partition={"local_test_fraction": 0.2},
            algorithm={"name": "fml"},
        )

    full, resumed = kill_and_resume(make)
    records = read_metrics(full.run_dir / "metrics.jsonl")
    assert records[-1]["test_acc"] > 0.7, records[-1]  # the global (meme) model; chance is 0.1
    # the private models, from their own random start after 2-3 participations each (never-sampled ones counted)
    assert records[-1]["personal_acc_micro"] > 0.5, records[-1]
    assert records == [
        {**r, "elapsed_s": f["elapsed_s"]}
        for r, f in zip(read_metrics(resumed.run_dir / "metrics.jsonl"), records, strict=True)
    ]
    torch.testing.assert_close(full.algo.global_params, resumed.algo.global_params, rtol=0, atol=0)
    for cid, state in full.executor.store.items():
        torch.testing.assert_close(state[PRIVATE], resumed.executor.store.get(cid)[PRIVATE], rtol=0, atol=0)

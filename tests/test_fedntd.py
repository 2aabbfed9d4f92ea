"""FedNTD: not-true logits, the distillation term against a hand computation, the frozen global teacher, and
learning end to end."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fedhet.algorithms import ALGORITHMS, Setup
from fedhet.algorithms.base import ClientContext, ClientData
from fedhet.algorithms.fedntd import not_true, ntd_loss
from fedhet.config import TrainSection
from fedhet.engine.simulation import Simulation
from fedhet.models import build_model
from fedhet.toolkit.flat import FlatModel


def test_not_true_drops_the_label_column():
    logits = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    assert not_true(logits, torch.tensor([1, 2])).tolist() == [[1.0, 3.0], [4.0, 5.0]]


def softmax(values, tau):
    exps = [math.exp(v / tau) for v in values]
    return [e / sum(exps) for e in exps]


def test_distillation_term_by_hand():
    local = torch.tensor([[2.0, 0.0, -1.0], [0.5, 1.0, 3.0]], requires_grad=True)
    teacher = torch.tensor([[1.0, 1.0, 0.0], [-2.0, 0.0, 2.0]])
    y = torch.tensor([0, 2])
    tau = 2.0
    total = 0.0
    for row, g_row, label in zip(local.tolist(), teacher.tolist(), y.tolist(), strict=True):
        q = softmax([v for c, v in enumerate(row) if c != label], tau)
        p = softmax([v for c, v in enumerate(g_row) if c != label], tau)
        total += sum(pi * math.log(pi / qi) for pi, qi in zip(p, q, strict=True))
    expected = tau**2 * total / 2  # summed over classes, averaged over the batch
    loss = ntd_loss(local, teacher, y, tau)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    loss.backward()
    assert local.grad[0, 0] == 0 and local.grad[1, 2] == 0  # the true class is left to the cross-entropy


def make_client(beta: float):
    entry = ALGORITHMS.get("fedntd")

    def build():
        return build_model("mlp", (4,), 3, hidden=[5])

    train = TrainSection(batch_size=8, local_steps=3, lr=0.5)
    algo = entry.obj(entry.params(beta=beta, tau=1.5), Setup(1, 3, train, build))
    torch.manual_seed(0)
    model = build()
    flat = FlatModel(model)
    algo.init_server(flat.get_params(), flat.get_buffers())
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    msg = algo.configure(1, [0], "train")[0]
    ctx = ClientContext(0, 1, "train", msg, ClientData(x, y, 3), {}, model, flat, train, torch.Generator())
    return algo, ctx, x, y


def test_teacher_is_the_received_model_while_the_local_model_moves():
    algo, ctx, x, y = make_client(beta=0.3)
    sent = ctx.global_params.clone()
    reply = algo.client_update(ctx)
    assert not torch.equal(reply.tensors["params"], sent)
    inputs = algo.loss_inputs(ctx)  # the teacher runs at the received model's parameters, in eval mode
    torch.testing.assert_close(inputs["global"], sent)
    assert not algo._teacher.module.model.training
    teacher = algo.setup.build_model().eval()
    FlatModel(teacher).set_params(sent)
    with torch.no_grad():
        global_logits = teacher(x)
    expected = F.cross_entropy(ctx.model(x), y) + 0.3 * ntd_loss(ctx.model(x), global_logits, y, 1.5)
    torch.testing.assert_close(algo.local_loss(ctx, x, y), expected)


def test_beta_zero_is_plain_cross_entropy():
    algo, ctx, x, y = make_client(beta=0.0)
    algo.before_local(ctx)
    assert algo.loss_inputs(ctx) == {}
    torch.testing.assert_close(algo.local_loss(ctx, x, y), F.cross_entropy(ctx.model(x), y))


def test_fedntd_learns_on_digits(tiny_config):
    cfg = tiny_config(run={"rounds": 4}, train={"participation": 1.0}, algorithm={"name": "fedntd"})
    summary = Simulation(cfg).run()
    assert summary["final"]["test_acc"] > 0.8, summary["final"]

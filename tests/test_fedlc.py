"""FedLC: calibrated cross-entropy against a hand computation, the true class in the denominator, absent classes,
the client's own label counts, and learning end to end."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fedhet.algorithms import ALGORITHMS
from fedhet.algorithms.base import ClientContext, ClientData, Message
from fedhet.algorithms.fedlc import calibrated_cross_entropy, calibration
from fedhet.config import TrainSection
from fedhet.engine.simulation import Simulation
from fedhet.models import build_model
from fedhet.toolkit.flat import FlatModel


def test_calibrated_loss_by_hand():
    counts = torch.tensor([16.0, 1.0, 0.0])  # 16^{-1/4} = 0.5, 1^{-1/4} = 1, class 2 absent
    shift = calibration(counts, 2.0)
    assert shift[:2].tolist() == [1.0, 2.0] and math.isinf(shift[2])
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.5, -1.0, 4.0]], requires_grad=True)
    y = torch.tensor([0, 1])
    loss = calibrated_cross_entropy(logits, y, shift)
    # calibrated rows: [0, 0, -inf] and [-0.5, -3, -inf]
    row0 = -math.log(math.exp(0) / (math.exp(0) + math.exp(0)))
    row1 = -math.log(math.exp(-3) / (math.exp(-0.5) + math.exp(-3)))
    assert loss.item() == pytest.approx((row0 + row1) / 2, rel=1e-6)
    loss.backward()
    # d/dz_c = (p_c - [c = y]) / B: the true class is in the softmax (FL-bench#5), the absent class gets nothing
    p1 = math.exp(-0.5) / (math.exp(-0.5) + math.exp(-3))
    expected = torch.tensor([[0.5 - 1, 0.5, 0.0], [p1, (1 - p1) - 1, 0.0]]) / 2
    torch.testing.assert_close(logits.grad, expected)


def test_local_loss_uses_the_clients_whole_label_counts():
    entry = ALGORITHMS.get("fedlc")
    algo = entry.obj(entry.params(tau=0.5), None)
    torch.manual_seed(0)
    model = build_model("logreg", (4,), 3)
    flat = FlatModel(model)
    y_all = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1])  # 4 of class 0, 12 of class 1, no 2
    x_all = torch.randn(len(y_all), 4)
    ctx = ClientContext(
        0, 1, "train", Message({"params": flat.get_params()}), ClientData(x_all, y_all, 3), {}, model, flat,
        TrainSection(), torch.Generator(),
    )  # fmt: skip
    algo.before_local(ctx)
    x, y = x_all[:2], y_all[:2]  # a batch holding only class 0: the counts still come from the whole client
    shift = torch.tensor([0.5 * 4**-0.25, 0.5 * 12**-0.25, math.inf])
    expected = F.cross_entropy(model(x) - shift, y)
    torch.testing.assert_close(algo.local_loss(ctx, x, y), expected)


def test_fedlc_learns_on_digits(tiny_config):
    cfg = tiny_config(run={"rounds": 4}, train={"participation": 1.0}, algorithm={"name": "fedlc"})
    summary = Simulation(cfg).run()
    assert summary["final"]["test_acc"] > 0.8, summary["final"]

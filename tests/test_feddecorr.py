"""FedDecorr: the official loss against a hand computation, its invariances and limits, the local objective, and
learning end to end."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fedhet.algorithms import ALGORITHMS
from fedhet.algorithms.feddecorr import decorrelation_loss
from fedhet.engine.simulation import Simulation
from fedhet.models import build_model


def test_loss_by_hand():
    z = torch.tensor([[1.0, 2.0], [2.0, 0.0], [3.0, 4.0]])
    # column 1: mean 2, unbiased var 1 -> standardised (-1, 0, 1); column 2: mean 2, var 4 -> (0, -1, 1)
    # K = zᵀz has off-diagonal entries (-1)(0) + (0)(-1) + (1)(1) = 1 (both); mean of squares 1, divided by B = 3
    assert decorrelation_loss(z).item() == pytest.approx(1 / 3, rel=1e-6)


def test_perfectly_correlated_dimensions_and_invariances():
    torch.manual_seed(0)
    a = torch.randn(10, 1)
    z = torch.cat([a, 3 * a + 1, -a], dim=1)
    # every standardised column is ±(the same unit-variance vector), so |K_ij| = B - 1 off the diagonal
    assert decorrelation_loss(z).item() == pytest.approx(9**2 / 10, rel=1e-5)
    w = torch.randn(10, 5)
    torch.testing.assert_close(decorrelation_loss(w * torch.tensor([1, 2, 3, 4, 5.0]) + 7), decorrelation_loss(w))
    assert decorrelation_loss(torch.randn(1, 5)).item() == 0.0


def test_local_loss_is_ce_plus_beta_decorrelation_of_the_embedding():
    entry = ALGORITHMS.get("feddecorr")
    algo = entry.obj(entry.params(beta=0.7), None)
    torch.manual_seed(0)
    model = build_model("mlp", (6,), 3, hidden=[8])

    class Ctx:
        pass

    Ctx.model = model
    x, y = torch.randn(5, 6), torch.tensor([0, 1, 2, 0, 1])
    embedding = model.body(x)
    expected = F.cross_entropy(model.head(embedding), y) + 0.7 * decorrelation_loss(embedding)
    torch.testing.assert_close(algo.local_loss(Ctx, x, y), expected)
    assert entry.params().beta == 0.1


def test_feddecorr_learns_on_digits(tiny_config):
    cfg = tiny_config(run={"rounds": 4}, train={"participation": 1.0}, algorithm={"name": "feddecorr"})
    summary = Simulation(cfg).run()
    assert summary["final"]["test_acc"] > 0.8, summary["final"]

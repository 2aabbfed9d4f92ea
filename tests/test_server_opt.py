"""Server optimisers in Flower's form (``form = "flower"``) against Flower 1.41's own strategies and formula."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord
from flwr.serverapp import strategy as flwr_strategy
from flwr.serverapp.strategy import FedAvg

from fedhet.algorithms.server_opt import AdaptiveParams, FedAdagrad, FedAdam, FedYogi, build_server_optimizer
from fedhet.errors import ConfigError

HYPER = {"lr": 0.1, "beta1": 0.9, "beta2": 0.99, "tau": 0.01}
TARGETS = ([0.5, -0.1, 0.0], [-0.2, 0.3, 0.1], [0.05, 0.05, -0.4])  # pseudo-gradients of three rounds


def flower_trajectory(cls, monkeypatch, x0: np.ndarray, hyper: dict) -> list[np.ndarray]:
    """Run Flower's strategy itself on the pseudo-gradients, with its FedAvg step replaced by the given target."""
    if cls is flwr_strategy.FedAdagrad:  # Flower's FedAdagrad has no momentum (beta_1 = 0) and no beta_2
        strat = cls(eta=hyper["lr"], tau=hyper["tau"])
    else:
        strat = cls(eta=hyper["lr"], beta_1=hyper["beta1"], beta_2=hyper["beta2"], tau=hyper["tau"])
    x, out = x0.astype(np.float32), []
    for rnd, delta in enumerate(TARGETS, start=1):
        target = ArrayRecord({"w": Array((x + np.float32(delta)).astype(np.float32))})
        monkeypatch.setattr(FedAvg, "aggregate_train", lambda self, r, replies, t=target: (t, None))
        strat.current_arrays = {"w": x}
        arrays, _ = strat.aggregate_train(rnd, [])
        x = arrays["w"].numpy()
        out.append(x)
    return out


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [(FedAdam, flwr_strategy.FedAdam), (FedYogi, flwr_strategy.FedYogi), (FedAdagrad, flwr_strategy.FedAdagrad)],
)
def test_flower_form_follows_flowers_strategies(ours, theirs, monkeypatch):
    hyper = {**HYPER, "beta1": 0.0} if ours is FedAdagrad else HYPER
    x0 = np.array([1.0, -2.0, 0.5], dtype=np.float32)
    expected = flower_trajectory(theirs, monkeypatch, x0, hyper)
    opt = ours(AdaptiveParams(form="flower", **hyper))
    x = torch.from_numpy(x0)
    opt.init(x)
    for delta, want in zip(TARGETS, expected, strict=True):
        x = opt.step(x, x + torch.tensor(delta))
        np.testing.assert_allclose(x.numpy(), want, rtol=1e-5, atol=1e-7)


def test_bias_corrected_adam_matches_flowers_formula_by_hand():
    opt = FedAdam(AdaptiveParams(form="flower", **HYPER))
    x = torch.tensor([1.0, -2.0])
    opt.init(x)
    d1, d2 = torch.tensor([0.5, -0.1]), torch.tensor([-0.2, 0.3])
    m1, v1 = 0.1 * d1, 0.01 * d1**2  # v starts at 0, not tau^2
    eta1 = 0.1 * (1 - 0.99**2) ** 0.5 / (1 - 0.9**2)  # Flower's exponent is round + 1
    x1 = x + eta1 * m1 / (v1.sqrt() + 0.01)
    torch.testing.assert_close(opt.step(x, x + d1), x1)
    m2, v2 = 0.9 * m1 + 0.1 * d2, 0.99 * v1 + 0.01 * d2**2
    eta2 = 0.1 * (1 - 0.99**3) ** 0.5 / (1 - 0.9**3)
    torch.testing.assert_close(opt.step(x1, x1 + d2), x1 + eta2 * m2 / (v2.sqrt() + 0.01))


def test_reddi_form_is_the_default_and_keeps_no_step_count():
    opt = build_server_optimizer("fedadam", {})
    assert opt.params.form == "reddi"
    x = torch.zeros(2)
    opt.init(x)
    opt.step(x, x + 1.0)
    assert set(opt.state) == {"m", "v"}


def test_unknown_form_names_the_choices():
    with pytest.raises(ConfigError, match="form.*reddi.*flower"):
        build_server_optimizer("fedyogi", {"form": "keras"})

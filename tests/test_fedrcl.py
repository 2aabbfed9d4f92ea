"""FedRCL: both loss variants against naive O(B^2) loops, the penalty's threshold, stability, multi-level
averaging, the local objective, and an end-to-end run on digits."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fedhet.algorithms import ALGORITHMS
from fedhet.algorithms.fedrcl import FedRCLConfig, pooled_unit, rcl_loss, rcl_official, rcl_paper, resolve_levels
from fedhet.config import build_config
from fedhet.engine.simulation import Simulation
from fedhet.models import build_model

LABELS = [0, 0, 0, 1, 1, 2, 2, 2, 2, 3]  # class 3 has a single sample


def clustered_features(seed: int = 0, dim: int = 6) -> torch.Tensor:
    """Unit features with a tight class 0 (its penalty fires), a loose class 2 and random others, in float64."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(4, dim, generator=g, dtype=torch.float64)
    spread = torch.tensor([0.1, 0.6, 1.5, 1.0], dtype=torch.float64)
    y = torch.tensor(LABELS)
    z = centres[y] + spread[y, None] * torch.randn(len(y), dim, generator=g, dtype=torch.float64)
    return F.normalize(z, dim=1), y


def cos(z, i, j) -> float:
    return float(z[i] @ z[j])


def naive_official(z, y, tau, lam, topk_neg):
    """The released code, one anchor at a time: hardest positive (self included), top-k negatives, and a penalty
    on the least similar other positive when even it is at least λ."""
    scl, pen = [], []
    labels = y.tolist()
    for i in range(len(labels)):
        same = [cos(z, i, j) for j in range(len(labels)) if labels[j] == labels[i]]
        negs = sorted((cos(z, i, k) for k in range(len(labels)) if labels[k] != labels[i]), reverse=True)[:topk_neg]
        pos = math.exp(min(same) / tau)
        scl.append(-math.log(pos / (pos + sum(math.exp(s / tau) for s in negs))))
        others = [cos(z, i, j) for j in range(len(labels)) if j != i and labels[j] == labels[i]]
        fires = others and min(others) >= lam
        pen.append(-math.log(math.exp(1 / tau) / (math.exp(1 / tau) + math.exp(min(others) / tau))) if fires else 0)
    return scl, pen


def naive_paper(z, y, tau, lam):
    """Eq. 5 written out: SCL over all positives (averaged) with the k != i denominator, and the penalty
    log(Σ_{P} e^{s/τ} + e^{1/τ}) − 1/τ with P the positives more similar than λ."""
    scl, pen = [], []
    labels = y.tolist()
    n = len(labels)
    for i in range(n):
        denominator = sum(math.exp(cos(z, i, k) / tau) for k in range(n) if k != i)
        positives = [j for j in range(n) if j != i and labels[j] == labels[i]]
        terms = [-math.log(math.exp(cos(z, i, j) / tau) / denominator) for j in positives]
        scl.append(sum(terms) / len(terms) if terms else 0.0)
        close = sum(math.exp(cos(z, i, j) / tau) for j in positives if cos(z, i, j) > lam)
        pen.append(math.log(close + math.exp(1 / tau)) - 1 / tau)
    return scl, pen


@pytest.mark.parametrize("lam", [0.7, 0.0])
@pytest.mark.parametrize("topk_neg", [2, 5])
def test_official_variant_matches_the_naive_loop(lam, topk_neg):
    z, y = clustered_features()
    scl, pen = rcl_official(z, y, 0.05, lam, topk_neg)
    want_scl, want_pen = naive_official(z, y, 0.05, lam, topk_neg)
    torch.testing.assert_close(scl, torch.tensor(want_scl, dtype=torch.float64))
    torch.testing.assert_close(pen, torch.tensor(want_pen, dtype=torch.float64))
    assert pen[:3].gt(0).all() and pen[9] == 0  # the tight class 0 is penalised; the lone sample has no partner
    others = z[9] @ z[:9].T  # the lone sample's positive is itself (similarity 1)
    top = others.topk(topk_neg).values / 0.05
    torch.testing.assert_close(scl[9], torch.logsumexp(torch.cat([torch.tensor([20.0], dtype=z.dtype), top]), 0) - 20)


@pytest.mark.parametrize("lam", [0.7, 0.0])
def test_paper_variant_matches_the_naive_loop(lam):
    z, y = clustered_features(seed=1)
    scl, pen = rcl_paper(z, y, 0.05, lam)
    want_scl, want_pen = naive_paper(z, y, 0.05, lam)
    torch.testing.assert_close(scl, torch.tensor(want_scl, dtype=torch.float64))
    torch.testing.assert_close(pen, torch.tensor(want_pen, dtype=torch.float64))
    assert pen.gt(0).sum() > 0 and pen[9] == 0 and scl[9] == 0


@pytest.mark.parametrize("variant", ["official", "paper"])
def test_penalty_is_zero_when_no_pair_exceeds_lambda(variant):
    z = torch.eye(8, 16)  # orthogonal features: every similarity is 0 < λ
    y = torch.tensor([0, 0, 0, 1, 1, 2, 2, 3])
    z.requires_grad_(True)
    cfg = FedRCLConfig(variant=variant)
    _, pen = rcl_loss([z], y, cfg)
    assert pen.item() == 0.0
    (grad,) = torch.autograd.grad(pen, z)
    assert grad.abs().sum() == 0


@pytest.mark.parametrize("variant", ["official", "paper"])
@pytest.mark.parametrize("labels", [[0, 0, 1, 2, 2, 2], [3], [1, 1, 1, 1], [0, 1, 2, 3]])
def test_gradients_are_finite_with_singletons_and_degenerate_batches(variant, labels):
    torch.manual_seed(0)
    model = build_model("resnet18", (3, 16, 16), 4, width=4)
    y = torch.tensor(labels)
    x = torch.randn(len(y), 3, 16, 16)
    x[1:2] = x[0:1] if len(y) > 1 else x[1:2]  # an exact duplicate: similarity 1, where e^{1/τ} lives
    cfg = FedRCLConfig(variant=variant, threshold=0.0)
    logits, feats = model.forward_features(x)
    scl, pen = rcl_loss([feats[name] for name in model.contrastive_levels], y, cfg)
    loss = F.cross_entropy(logits, y) + scl + pen
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_stable_at_a_tiny_temperature():
    z = F.normalize(torch.randn(6, 5), dim=1)
    z = torch.cat([z, z])  # duplicates: similarities of exactly 1
    y = torch.tensor([0, 1, 2, 0, 1, 2] * 2)
    for variant in ("official", "paper"):
        scl, pen = rcl_loss([z], y, FedRCLConfig(variant=variant, tau=0.001))  # e^{1000} overflows float64
        assert torch.isfinite(scl) and torch.isfinite(pen)


def test_levels_are_pooled_normalised_and_averaged():
    torch.manual_seed(0)
    y = torch.tensor([0, 0, 1, 1, 2])
    maps, flat = torch.randn(5, 3, 4, 4), torch.randn(5, 7)
    cfg = FedRCLConfig(threshold=0.2)
    scl, pen = rcl_loss([maps, flat], y, cfg)
    per_level = [rcl_official(F.normalize(f, dim=1), y, 0.05, 0.2, 2) for f in (maps.mean((2, 3)), flat)]
    torch.testing.assert_close(scl, (per_level[0][0].mean() + per_level[1][0].mean()) / 2)
    torch.testing.assert_close(pen, (per_level[0][1].mean() + per_level[1][1].mean()) / 2)
    torch.testing.assert_close(pooled_unit(maps).norm(dim=1), torch.ones(5))
    relu_scl, _ = rcl_loss([maps], y, FedRCLConfig(feature_relu=True))
    torch.testing.assert_close(relu_scl, rcl_official(pooled_unit(maps.relu()), y, 0.05, 0.7, 2)[0].mean())


def test_level_resolution():
    resnet = build_model("resnet18", (1, 8, 8), 10, width=2)
    lenet = build_model("lenet5", (1, 28, 28), 10)
    assert resolve_levels(resnet, None) == ("conv1", "conv2_x", "conv3_x", "conv4_x", "conv5_x")
    assert resolve_levels(lenet, None) == ("conv1", "conv2", "fc1", "embedding")  # every stage, never the logits
    assert resolve_levels(resnet, ("conv5_x",)) == ("conv5_x",)  # the last-layer-only ablation (Table 4)
    with pytest.raises(ValueError, match="taps of the model"):
        resolve_levels(resnet, ("layer4",))


def test_local_loss_is_ce_plus_scl_plus_beta_penalty():
    entry = ALGORITHMS.get("fedrcl")
    cfg = entry.params(beta=2.5, threshold=0.1)
    algo = entry.obj(cfg, None)
    torch.manual_seed(0)
    model = build_model("resnet18", (1, 8, 8), 3, width=2)
    x, y = torch.randn(6, 1, 8, 8), torch.tensor([0, 0, 1, 1, 2, 2])

    class Ctx:  # the two fields local_loss reads
        scratch = {"rcl_levels": model.contrastive_levels}

    Ctx.model = model
    logits, feats = model.forward_features(x)
    scl, pen = rcl_loss([feats[n] for n in model.contrastive_levels], y, cfg)
    expected = F.cross_entropy(logits, y) + scl + 2.5 * pen
    torch.testing.assert_close(algo.local_loss(Ctx, x, y), expected)
    assert pen.item() > 0 and cfg.weighting == "uniform" and cfg.variant == "official"


def digits_config(tmp_path, name: str, **algorithm):
    return build_config(
        {
            "run": {"name": name, "rounds": 4, "out_dir": str(tmp_path / "runs"), "progress": False},
            "dataset": {"name": "digits"},
            "partition": {"name": "balanced_dirichlet", "alpha": 0.5, "num_clients": 6},
            "model": {"name": "mlp", "hidden": [64, 32]},  # two levels: fc1 and the embedding
            "train": {"local_epochs": 2, "batch_size": 32, "lr": 0.1, "grad_clip": 10.0},
            "algorithm": {"name": "fedrcl", **algorithm},
        }
    )


@pytest.mark.parametrize("variant", ["official", "paper"])
def test_fedrcl_learns_on_digits(tmp_path, variant):
    summary = Simulation(digits_config(tmp_path, variant, variant=variant)).run()
    assert summary["final"]["test_acc"] > 0.8, summary["final"]

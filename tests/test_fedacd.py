"""FedACD: L1, L2, the probability matrix, V_m and the aggregation weights against hand computations, the epoch
schedule of P, finite gradients at the edges, and learning / resuming end to end."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from fedhet.algorithms import ALGORITHMS, Reply, Setup
from fedhet.algorithms.base import ClientContext, ClientData
from fedhet.algorithms.fedacd import (
    FedACD,
    adjusted_cross_entropy,
    adjustment_matrix,
    draw_beta,
    flatten_loss,
    score,
)
from fedhet.config import TrainSection
from fedhet.engine.simulation import Simulation
from fedhet.errors import ConfigError
from fedhet.models import build_model
from fedhet.toolkit.confusion import template_kl
from fedhet.toolkit.flat import FlatModel

NAN = math.nan
TAU = 1.0 - 1e-5


# ------------------------------------------------------------------------------------------ hand computations
def softmax(z: list[float]) -> list[float]:
    m = max(z)
    e = [math.exp(v - m) for v in z]
    return [v / sum(e) for v in e]


def hand_l1(z: list[float], y: int) -> float:
    """KL(p || q), q_y = p_y, q_k = (1 - p_y) / (C - 1): Eq. 7 term by term."""
    p = softmax(z)
    c = len(z)
    q = [p[y] if k == y else (1 - p[y]) / (c - 1) for k in range(c)]
    return sum(p[k] * math.log(p[k] / q[k]) for k in range(c))


def hand_l2(z: list[float], y: int, delta: dict[tuple[int, int], float]) -> float:
    """Eq. 8 as printed: log(1 + sum_{i != y} exp(f_i - f_y + log Delta_yi))."""
    return math.log(1 + sum(math.exp(z[i] - z[y] + math.log(delta[y, i])) for i in range(len(z)) if i != y))


def hand_p(probs: list[list[float]], rows: list[list[tuple[int, float]]], c: int) -> list[list[float]]:
    """Weighted row means: sample k adds weight * probs[k] to each (row, weight) in rows[k]; NaN rows if empty."""
    sums = [[0.0] * c for _ in range(c)]
    counts = [0.0] * c
    for p, targets in zip(probs, rows, strict=True):
        for row, weight in targets:
            counts[row] += weight
            for j in range(c):
                sums[row][j] += weight * p[j]
    return [[s / counts[i] if counts[i] else NAN for s in sums[i]] for i in range(c)]


def hand_deltas(p: list[list[float]], delta_missing: float) -> dict[tuple[int, int], float]:
    c = len(p)
    present = [not math.isnan(row[0]) for row in p]
    return {
        (y, i): (p[y][i] / p[i][y] if present[i] else delta_missing)
        for y in range(c)
        if present[y]
        for i in range(c)
        if i != y
    }


def make_ctx(x, y, num_classes, train, seed=0, **algo_params) -> tuple[FedACD, ClientContext]:
    torch.manual_seed(seed)
    model = build_model("logreg", (x.shape[1],), num_classes)
    flat = FlatModel(model)
    setup = Setup(1, num_classes, train, lambda: build_model("logreg", (x.shape[1],), num_classes))
    entry = ALGORITHMS.get("fedacd")
    algo = entry.obj(entry.params(**algo_params), setup)
    algo.init_server(torch.randn(flat.num_params), flat.get_buffers())
    msg = algo.configure(1, [0], "train")[0]
    ctx = ClientContext(
        0, 1, "train", msg, ClientData(x, y, num_classes), {}, model, flat, train, torch.Generator().manual_seed(1)
    )
    return algo, ctx


def probs_of(model, xs: torch.Tensor) -> list[list[float]]:
    """Softmax outputs, one sample at a time (the model is the tool here, not what is tested)."""
    with torch.no_grad():
        return [torch.softmax(model(x[None]).double(), dim=1)[0].tolist() for x in xs]


# ------------------------------------------------------------------------------------------------------- L1
def test_flatten_loss_is_the_kl_to_the_flattened_target_and_its_closed_form():
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0], [0.3, 0.1, -2.0, 1.5], [3.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    y = torch.tensor([0, 3, 0])
    got = flatten_loss(logits, y)
    for row, label, value in zip(logits.tolist(), y.tolist(), got.tolist(), strict=True):
        p = softmax(row)
        rest = [p[k] / (1 - p[label]) for k in range(4) if k != label]  # renormalised non-target distribution
        closed = (1 - p[label]) * (math.log(3) - (-sum(v * math.log(v) for v in rest)))
        assert hand_l1(row, label) == pytest.approx(closed, rel=1e-12)
        assert value == pytest.approx(closed, rel=1e-10, abs=1e-15)
    assert got[2].item() == pytest.approx(0.0, abs=1e-15)  # non-target outputs already flat: nothing to do


@pytest.mark.parametrize("detach", [False, True])
def test_flatten_loss_gradient_is_the_literal_formulas(detach):
    """Differentiating through q (default) or holding q fixed: the same gradient as Eq. 7 written out naively."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0], [0.3, 0.1, -2.0, 1.5]], dtype=torch.float64, requires_grad=True)
    y = torch.tensor([1, 3])
    flatten_loss(logits, y, detach_target=detach).sum().backward()
    got = logits.grad.clone()
    logits.grad = None
    p = torch.softmax(logits, dim=1)
    target = F.one_hot(y, 4).bool()
    p_y = p[target].unsqueeze(1)
    q = torch.where(target, p, (1 - p_y) / 3)
    q = q.detach() if detach else q
    (p * (p / q).log()).sum().backward()
    torch.testing.assert_close(got, logits.grad)


@pytest.mark.parametrize("detach", [False, True])
def test_flatten_loss_is_finite_when_the_target_probability_is_one(detach):
    logits = torch.tensor([[60.0, 0.0, 0.0], [60.0, 0.0, 0.0], [200.0, 0.0, -5.0]], requires_grad=True)
    y = torch.tensor([0, 1, 0])
    loss = flatten_loss(logits, y, detach)
    assert torch.isfinite(loss).all()
    assert loss[0].item() == pytest.approx(0.0, abs=1e-6)  # p_y = 1: no non-target mass to flatten
    assert loss[1].item() == pytest.approx(math.log(2), rel=1e-5)  # all non-target mass on one class: log(C - 1)
    loss.sum().backward()
    assert torch.isfinite(logits.grad).all()


# ------------------------------------------------------------------------------------------------------- L2
def test_adjusted_cross_entropy_is_eq8_with_delta_yi_over_iy_and_a_missing_class():
    p = torch.tensor([[0.7, 0.2, 0.1], [0.3, 0.6, 0.1], [NAN, NAN, NAN]], dtype=torch.float64)  # class 2 absent
    adjust = adjustment_matrix(p, delta_missing=1e-4, floor=1e-8, clip=None)
    expected = [[0.0, math.log(0.2 / 0.3), math.log(1e-4)], [math.log(0.3 / 0.2), 0.0, math.log(1e-4)]]
    torch.testing.assert_close(adjust[:2], torch.tensor(expected, dtype=torch.float64))
    assert torch.equal(adjust[2], torch.zeros(3, dtype=torch.float64))  # an absent row is never a label
    logits = torch.tensor([[1.0, 0.5, -0.2], [0.1, 2.0, 0.3], [0.4, 0.4, 3.0]], dtype=torch.float64)
    y = torch.tensor([0, 1, 0])
    deltas = hand_deltas(p.tolist(), 1e-4)
    assert deltas[0, 1] == pytest.approx(0.2 / 0.3) and deltas[1, 0] == pytest.approx(0.3 / 0.2)
    got = adjusted_cross_entropy(logits, y, adjust)
    for z, label, value in zip(logits.tolist(), y.tolist(), got.tolist(), strict=True):
        assert value == pytest.approx(hand_l2(z, label, deltas), rel=1e-12)


def test_adjustment_clamps_p_and_clips_only_the_estimated_entries():
    p = torch.tensor([[0.9, 0.1, 0.0, 0.0], [0.05, 0.95, 0.0, 0.0], [0.2, 0.3, 0.5, 0.0], [NAN] * 4])
    adjust = adjustment_matrix(p.double(), delta_missing=1e-3, floor=1e-8, clip=None)
    assert adjust[0, 2].item() == pytest.approx(math.log(1e-8 / 0.2))  # P_02 = 0 -> the floor
    assert adjust[2, 0].item() == pytest.approx(math.log(0.2 / 1e-8))
    clipped = adjustment_matrix(p.double(), delta_missing=1e-3, floor=1e-8, clip=0.5)
    assert clipped[0, 2].item() == -0.5 and clipped[2, 0].item() == 0.5
    assert clipped[0, 1].item() == 0.5 and clipped[1, 2].item() == -0.5  # log 2 = 0.69 and log(1e-8 / 0.3)
    assert clipped[0, 3].item() == pytest.approx(math.log(1e-3))  # the missing-class value is not clipped


def test_adjusted_cross_entropy_is_plain_cross_entropy_when_p_is_symmetric():
    p = torch.tensor([[0.8, 0.1, 0.1], [0.1, 0.7, 0.2], [0.1, 0.2, 0.7]], dtype=torch.float64)
    adjust = adjustment_matrix(p, 1e-4, 1e-8, None)
    logits = torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([0, 1, 2, 2, 0])
    torch.testing.assert_close(adjusted_cross_entropy(logits, y, adjust), F.cross_entropy(logits, y, reduction="none"))


# ------------------------------------------------------------------------------------------------------ V_m
def test_score_is_the_sigmoid_of_the_inverse_mean_row_kl_over_present_rows():
    p = [[0.9, 0.05, 0.05, 0.0], [0.2, 0.7, 0.0, 0.1], [NAN] * 4, [0.0, 0.0, 0.0, 1.0]]  # class 2 absent
    kls = []
    for i in (0, 1, 3):
        off = (1 - TAU) / 3
        kls.append(sum(v * math.log(v / (TAU if j == i else off)) for j, v in enumerate(p[i]) if v > 0))
    assert kls[2] == pytest.approx(-math.log(TAU))  # a one-hot row: only log(1 / tau)
    mean_kl, sum_kl = sum(kls) / 3, sum(kls)
    got_mean = template_kl(torch.tensor(p, dtype=torch.float64), TAU, "mean_rows")
    got_sum = template_kl(torch.tensor(p, dtype=torch.float64), TAU, "sum")
    assert got_mean == pytest.approx(mean_kl, rel=1e-12) and got_sum == pytest.approx(sum_kl, rel=1e-12)
    assert score(got_mean) == pytest.approx(1 / (1 + math.exp(-1 / mean_kl)), rel=1e-12)
    assert score(got_sum) == pytest.approx(1 / (1 + math.exp(-1 / sum_kl)), rel=1e-12)
    assert score(0.0) == 1.0 and 0.5 < score(1e6) < 0.5 + 1e-6  # guarded at 1e-12; V in (0.5, 1]


@pytest.mark.parametrize("reduction", ["mean_rows", "sum"])
def test_reply_score_is_v_of_the_final_model_on_clean_local_data(reduction):
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(7, 4, generator=g), torch.tensor([0, 0, 1, 1, 1, 3, 0])  # class 2 absent
    train = TrainSection(batch_size=3, local_epochs=2, lr=0.1)
    algo, ctx = make_ctx(x, y, 4, train, kl_reduction=reduction)
    reply = algo.client_update(ctx)
    ctx.flat.set_params(reply.tensors["params"])
    p = hand_p(probs_of(ctx.model, x), [[(label, 1.0)] for label in y.tolist()], 4)
    kls = []
    for i in (0, 1, 3):
        off = (1 - TAU) / 3
        kls.append(sum(v * math.log(v / (TAU if j == i else off)) for j, v in enumerate(p[i]) if v > 0))
    kl = sum(kls) / 3 if reduction == "mean_rows" else sum(kls)
    assert reply.metrics["kl"] == pytest.approx(kl, rel=1e-6)  # float32 logits: batched vs one by one
    assert reply.scalars["score"] == pytest.approx(1 / (1 + math.exp(-1 / kl)), rel=1e-6)
    assert reply.num_examples == 7 and reply.metrics["steps"] == 6.0


# --------------------------------------------------------------------------------------- P and the local loss
@pytest.mark.parametrize("mixup", [True, False])
def test_option_b_p_and_loss_by_hand(mixup):
    """Epoch 1 uses the clean P of the received model; its loss is lam [L1 + L2](y_a) + (1 - lam) [...](y_b) on the
    mixed batch; epoch 2 uses the lam-weighted row means of epoch 1's training outputs."""
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(4, 3, generator=g), torch.tensor([0, 0, 1, 2])
    train = TrainSection(batch_size=4, local_steps=2, lr=0.5)  # one batch per epoch: the refresh is at step 1
    algo, ctx = make_ctx(x, y, 3, train, mixup=mixup, l2_weight=0.7)
    lam, perm = (0.3, torch.tensor([2, 0, 3, 1])) if mixup else (1.0, torch.arange(4))
    algo.draw_mix = lambda ctx, n: (lam, perm)
    seen = {}
    original = algo.local_loss

    def recording(ctx, xb, yb):
        if ctx.steps == 0:
            seen["p_epoch1"] = ctx.scratch["acd_p"].clone()
            xm = lam * xb + (1 - lam) * xb[perm]
            seen["probs"] = probs_of(ctx.model, xm)
            with torch.no_grad():
                seen["logits"] = ctx.model(xm).double().tolist()
            seen["ya"], seen["yb"] = yb.tolist(), yb[perm].tolist()
        loss = original(ctx, xb, yb)
        if ctx.steps == 0:
            seen["loss"] = loss.item()
        return loss

    algo.local_loss = recording
    ctx.flat.set_params(ctx.global_params)
    clean = hand_p(probs_of(ctx.model, x), [[(label, 1.0)] for label in y.tolist()], 3)
    algo.client_update(ctx)

    torch.testing.assert_close(seen["p_epoch1"], torch.tensor(clean, dtype=torch.float64))
    deltas = hand_deltas(clean, 1e-4)
    parts = []
    for labels, weight in ((seen["ya"], lam), (seen["yb"], 1 - lam)):
        per = [hand_l1(z, t) + 0.7 * hand_l2(z, t, deltas) for z, t in zip(seen["logits"], labels, strict=True)]
        parts.append(weight * sum(per) / 4)
    assert seen["loss"] == pytest.approx(sum(parts), rel=1e-5)

    rows = [[(a, lam), (b, 1 - lam)] for a, b in zip(seen["ya"], seen["yb"], strict=True)]
    expected = hand_p(seen["probs"], rows, 3)
    torch.testing.assert_close(ctx.scratch["acd_p"], torch.tensor(expected, dtype=torch.float64))
    log_ratio = [[math.log(expected[i][j] / expected[j][i]) for j in range(3)] for i in range(3)]
    torch.testing.assert_close(ctx.scratch["acd_adjust"], torch.tensor(log_ratio, dtype=torch.float32))


def test_mixup_draws_lam_and_partners_from_the_client_generator():
    algo, ctx = make_ctx(torch.randn(4, 3), torch.tensor([0, 1, 2, 0]), 3, TrainSection(), mixup_alpha=0.4)
    x = torch.arange(12.0).view(4, 3)
    y = torch.tensor([0, 1, 2, 0])
    state = ctx.generator.get_state()
    xm, labels = algo.mix(ctx, x, y)
    ctx.generator.set_state(state)
    lam = draw_beta(0.4, ctx.generator)
    perm = torch.randperm(4, generator=ctx.generator)
    torch.testing.assert_close(xm, lam * x + (1 - lam) * x[perm])
    assert labels[0][1] == lam and labels[1][1] == 1 - lam
    assert torch.equal(labels[0][0], y) and torch.equal(labels[1][0], y[perm])
    draws = torch.tensor([draw_beta(0.4, torch.Generator().manual_seed(s)) for s in range(4000)])
    # Beta(0.4, 0.4): mean 1/2, variance 1 / (4 (2 alpha + 1)) = 1/7.2
    assert draws.mean().item() == pytest.approx(0.5, abs=0.02)
    assert draws.var().item() == pytest.approx(1 / 7.2, abs=0.01)


def test_without_mixup_the_loss_is_l1_plus_l2_on_the_batch_and_draws_nothing():
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(5, 3, generator=g), torch.tensor([0, 1, 1, 2, 0])
    algo, ctx = make_ctx(x, y, 3, TrainSection(batch_size=5), mixup=False)
    algo.before_local(ctx)
    p = hand_p(probs_of(ctx.model, x), [[(label, 1.0)] for label in y.tolist()], 3)
    deltas = hand_deltas(p, 1e-4)
    state = ctx.generator.get_state()
    loss = algo.local_loss(ctx, x, y)
    assert torch.equal(ctx.generator.get_state(), state)
    with torch.no_grad():
        logits = ctx.model(x).double().tolist()
    expected = sum(hand_l1(z, t) + hand_l2(z, t, deltas) for z, t in zip(logits, y.tolist(), strict=True)) / 5
    assert loss.item() == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize(
    ("estimate", "epochs", "steps", "refreshes", "clean_passes"),
    [
        ("train_outputs", 2.0, None, 1, 2),  # n = 10, B = 4: epochs of 3 steps; P refreshed before step 3
        ("train_outputs", 1.0, 7, 2, 2),  # local_steps: boundaries still every ceil(n / B) = 3 steps (3 and 6)
        ("clean_pass", 1.0, 7, 2, 4),  # option A: a clean pass at each boundary, + the first and the final
    ],
)
def test_p_is_refreshed_at_every_epoch_boundary(estimate, epochs, steps, refreshes, clean_passes):
    x, y = torch.randn(10, 3), torch.tensor([0, 1, 2] * 3 + [0])
    train = TrainSection(batch_size=4, local_epochs=epochs, local_steps=steps, lr=0.1)
    algo, ctx = make_ctx(x, y, 3, train, p_estimate=estimate)
    calls = {"refresh": [], "clean": 0}
    refresh, clean = algo.refresh_p, algo.clean_pass

    def counting_refresh(ctx):
        calls["refresh"].append(ctx.steps)
        refresh(ctx)

    def counting_clean(ctx):
        calls["clean"] += 1
        return clean(ctx)

    algo.refresh_p, algo.clean_pass = counting_refresh, counting_clean
    algo.client_update(ctx)
    assert calls["refresh"] == [3 * (k + 1) for k in range(refreshes)]
    assert calls["clean"] == clean_passes


def test_gradients_stay_finite_with_a_one_sample_class_and_saturated_outputs():
    x, y = torch.randn(6, 3), torch.tensor([0, 0, 0, 0, 0, 1])  # class 1 has one sample, class 2 none
    train = TrainSection(batch_size=4, local_epochs=3, lr=0.05, momentum=0.9)
    algo, ctx = make_ctx(x, y, 3, train)
    params = ctx.message.tensors["params"].clone()
    ctx.flat.set_params(params)
    ctx.model.head.weight.data.zero_()
    ctx.model.head.bias.data.copy_(torch.tensor([60.0, 0.0, 0.0]))  # logits [60, 0, 0]: p_0 = 1 to float precision
    ctx.message.tensors["params"] = ctx.flat.get_params()
    reply = algo.client_update(ctx)
    assert torch.isfinite(reply.tensors["params"]).all()
    assert 0.5 < reply.scalars["score"] <= 1.0 and math.isfinite(reply.metrics["kl"])
    assert reply.metrics["log_delta_max"] == pytest.approx(-math.log(1e-8), rel=1e-3)  # the floor was hit


# ---------------------------------------------------------------------------------------------------- server
def server(name="fedacd", **params):
    entry = ALGORITHMS.get(name)
    algo = entry.obj(entry.params(**params), Setup(3, 3, TrainSection(), lambda: None))
    algo.init_server(torch.zeros(2), torch.zeros(1))
    return algo


def replies() -> dict[int, Reply]:
    rows = [(0.6, 10, [1.0, 0.0], 2.0), (0.9, 30, [0.0, 1.0], 0.5), (0.75, 20, [2.0, 2.0], 1.0)]
    return {
        cid: Reply(
            tensors={"params": torch.tensor(w), "buffers": torch.tensor([b])},
            scalars={"score": v},
            num_examples=n,
            metrics={"kl": 1 / math.log(v / (1 - v)), "log_delta_max": 0.1 * cid},
        )
        for cid, (v, n, w, b) in enumerate(rows)
    }


def test_server_weights_are_scores_over_their_sum_or_the_ablations():
    total = 0.6 + 0.9 + 0.75
    assert server().aggregation_weights(replies()) == pytest.approx([0.6 / total, 0.9 / total, 0.75 / total])
    assert server(weighting="uniform").aggregation_weights(replies()) == pytest.approx([1 / 3] * 3)
    assert server(weighting="samples").aggregation_weights(replies()) == pytest.approx([1 / 6, 3 / 6, 2 / 6])
    assert server("fedacd_base").aggregation_weights(replies()) == pytest.approx([1 / 3] * 3)
    assert server("fedacd_base", weighting="score").config.weighting == "score"


def test_aggregate_averages_models_and_buffers_by_score_and_logs_them():
    algo = server()
    algo.aggregate(1, replies(), "train")
    total = 0.6 + 0.9 + 0.75
    expected = [(0.6 * 1 + 0.75 * 2) / total, (0.9 * 1 + 0.75 * 2) / total]
    torch.testing.assert_close(algo.global_params, torch.tensor(expected))
    torch.testing.assert_close(algo.global_buffers, torch.tensor([(0.6 * 2 + 0.9 * 0.5 + 0.75) / total]))
    metrics = algo.round_metrics(1)
    assert metrics["fedacd_score_min"] == 0.6 and metrics["fedacd_score_max"] == 0.9
    assert metrics["fedacd_score_mean"] == pytest.approx(0.75)
    assert metrics["fedacd_kl_mean"] == pytest.approx(sum(1 / math.log(v / (1 - v)) for v in (0.6, 0.9, 0.75)) / 3)
    assert metrics["fedacd_log_delta_max"] == pytest.approx(0.2)
    again = server()
    again.load_state_dict(algo.state_dict())
    assert again.round_metrics(2) == metrics  # checkpointed: a resume logs the same values
    assert server().round_metrics(1) == {}


def test_a_mixup_first_estimate_needs_mixup():
    with pytest.raises(ConfigError, match="p_init"):
        ALGORITHMS.parse("fedacd", {"mixup": False, "p_init": "mixup"})
    with pytest.raises(ConfigError, match="tau"):
        ALGORITHMS.parse("fedacd", {"tau": 1.0})


# ------------------------------------------------------------------------------------------------ end to end
def test_fedacd_learns_on_digits_like_fedavg(tiny_config):
    accs = {}
    for name in ("fedavg", "fedacd"):
        cfg = tiny_config(run={"rounds": 6, "name": name}, algorithm={"name": name})
        accs[name] = Simulation(cfg).run()["final"]["test_acc"]
    assert accs["fedacd"] > 0.6, accs  # 10 classes: chance is 0.1
    assert accs["fedacd"] > accs["fedavg"] - 0.1, accs


@pytest.mark.parametrize(
    "variant",
    [
        {"name": "fedacd_base", "mixup": False},
        {"name": "fedacd", "weighting": "samples", "p_estimate": "clean_pass", "kl_reduction": "sum"},
        {"name": "fedacd", "p_init": "mixup", "l1_detach_target": True, "log_delta_clip": 2.0},
    ],
)
def test_ablations_run_and_learn(tiny_config, variant):
    cfg = tiny_config(run={"rounds": 4, "name": "v"}, algorithm=variant)
    summary = Simulation(cfg).run()
    assert summary["final"]["test_acc"] > 0.4, summary["final"]


def test_kill_and_resume_is_bit_exact(tiny_config, kill_and_resume):
    full, resumed = kill_and_resume(
        lambda name: tiny_config(run={"name": name, "rounds": 4}, train={"momentum": 0.5}, algorithm={"name": "fedacd"})
    )

    def records(sim):
        lines = (sim.run_dir / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(line).items() if k != "elapsed_s"} for line in lines]

    assert records(full) == records(resumed)
    assert "fedacd_score_mean" in records(full)[-1]
    torch.testing.assert_close(full.algo.global_params, resumed.algo.global_params, rtol=0, atol=0)

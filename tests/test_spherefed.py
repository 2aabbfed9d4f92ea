"""SphereFed: the fixed hyperspherical classifier, the loss by hand, local training that never moves the classifier,
the clients' feature statistics and the server's closed-form calibration against centralised least squares, and
end-to-end learning that resumes bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedhet.algorithms import ALGORITHMS, Setup
from fedhet.algorithms.base import ClientContext, ClientData
from fedhet.algorithms.spherefed import (
    CALIBRATE,
    TRAIN,
    SphereHead,
    calibrated_classifier,
    feature_statistics,
    sphere_loss,
)
from fedhet.config import TrainSection
from fedhet.models.base import FedModel
from fedhet.results.store import read_metrics
from fedhet.toolkit.flat import FlatModel

D, C = 5, 3


def hidden_model() -> FedModel:
    return FedModel({"fc": nn.Sequential(nn.Linear(4, D), nn.ReLU())}, D, C)


def make_spherefed(build=hidden_model, train: TrainSection | None = None, **params):
    entry = ALGORITHMS.get("spherefed")
    cfg = entry.params(**params)

    def build_prepared():
        return entry.obj.prepare_model(cfg, build())

    train = train or TrainSection(batch_size=8, local_steps=3, lr=0.5, momentum=0.9, weight_decay=0.01)
    algo = entry.obj(cfg, Setup(2, C, train, build_prepared))
    torch.manual_seed(0)
    model = build_prepared()
    flat = FlatModel(model)
    algo.init_server(flat.get_params(), flat.get_buffers())
    return algo, model, flat


def context(algo, model, flat, rnd, phase, data, cid=0) -> ClientContext:
    msg = algo.configure(rnd, [cid], phase)[cid]
    return ClientContext(
        cid, rnd, phase, msg, data, {}, model, flat, algo.setup.train, torch.Generator().manual_seed(1)
    )


def data(n=24, seed=0) -> ClientData:
    g = torch.Generator().manual_seed(seed)
    return ClientData(torch.randn(n, 4, generator=g), torch.randint(0, C, (n,), generator=g), C)


def test_the_classifier_is_a_fixed_orthonormal_buffer_without_bias():
    _, model, _ = make_spherefed()
    assert isinstance(model.head, SphereHead)
    assert [name for name, _ in model.head.named_parameters()] == []  # nothing for an optimiser to move
    w = model.head.weight
    torch.testing.assert_close(w @ w.T, torch.eye(C))  # C <= D: orthonormal rows on the unit sphere


def test_logits_are_the_classifier_on_normalised_features():
    head = SphereHead(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]]))
    z = torch.tensor([[3.0, 4.0], [0.0, -2.0]])
    torch.testing.assert_close(head(z), torch.tensor([[0.6, 0.8, 0.36 + 0.64], [0.0, -1.0, -0.8]]))


def test_losses_by_hand():
    logits = torch.tensor([[0.6, 0.8, 0.0], [0.0, -1.0, 0.5]])
    y = torch.tensor([1, 2])
    # |(0.6, -0.2, 0)|^2 = 0.4 and |(0, -1, -0.5)|^2 = 1.25, averaged over the two samples
    assert sphere_loss(logits, y, "mse", 1.0).item() == pytest.approx((0.4 + 1.25) / 2)
    assert sphere_loss(logits, y, "ce", 4.0).item() == pytest.approx(F.cross_entropy(4 * logits, y).item())


def test_local_training_moves_the_body_and_never_the_classifier():
    algo, model, flat = make_spherefed()
    algo.global_buffers = algo.with_classifier(torch.full((C, D), 0.3))  # a calibrated classifier from before
    ctx = context(algo, model, flat, 2, TRAIN, data())
    assert torch.equal(ctx.message.tensors["buffers"], algo.with_classifier(algo.fixed))  # trains on the fixed W
    reply = algo.client_update(ctx)
    assert not torch.equal(reply.tensors["params"], algo.global_params)
    assert torch.equal(reply.tensors["buffers"][algo.classifier_slice()], algo.fixed)


def test_one_mse_step_matches_hand_computation():
    lr = 0.5
    algo, model, flat = make_spherefed(train=TrainSection(batch_size=24, local_steps=1, lr=lr))
    d = data()
    ctx = context(algo, model, flat, 1, TRAIN, d)
    w = algo.global_params.clone()
    reply = algo.client_update(ctx)
    s = flat.slices()
    W1, b1 = (
        w[s["body.fc.0.weight"]].view(D, 4).clone().requires_grad_(),
        w[s["body.fc.0.bias"]].clone().requires_grad_(),
    )
    z = (d.x @ W1.T + b1).clamp(min=0)
    fixed = algo.fixed.view(C, D)
    loss = ((z / z.norm(dim=1, keepdim=True)) @ fixed.T - F.one_hot(d.y, C)).pow(2).sum(1).mean()
    gw, gb = torch.autograd.grad(loss, (W1, b1))
    want = w.clone()
    want[s["body.fc.0.weight"]] -= lr * gw.reshape(-1)
    want[s["body.fc.0.bias"]] -= lr * gb
    torch.testing.assert_close(reply.tensors["params"], want)


def test_feature_statistics_by_hand():
    _, model, _ = make_spherefed()
    d = data(n=7)
    gram, cross = feature_statistics(model, d.x, d.y, C)
    h = F.normalize(model.body(d.x), dim=1).detach()
    torch.testing.assert_close(gram, h.T @ h)
    torch.testing.assert_close(cross, h.T @ F.one_hot(d.y, C).float())


def test_federated_calibration_equals_centralised_least_squares():
    """Two clients' statistics give the least-squares classifier of their pooled normalised features."""
    algo, model, flat = make_spherefed(ridge=0.0)
    datasets = {0: data(n=30, seed=1), 1: data(n=12, seed=2)}
    replies = {}
    for cid, d in datasets.items():
        ctx = context(algo, model, flat, 1, CALIBRATE, d, cid)
        replies[cid] = algo.client_update(ctx)
        assert set(replies[cid].tensors) == {"gram", "cross"}  # statistics only, never features or data
    algo.aggregate(1, replies, CALIBRATE)
    flat.set_params(algo.global_params)
    with torch.no_grad():
        h = torch.cat([F.normalize(model.body(d.x), dim=1) for d in datasets.values()]).double()
    y = torch.cat([F.one_hot(d.y, C) for d in datasets.values()]).double()
    want = torch.linalg.lstsq(h, y).solution.T  # argmin_W sum |W h - y|^2
    got = algo.global_buffers[algo.classifier_slice()].view(C, D)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    mse = ((h @ want.T - y) ** 2).sum(1).mean()
    assert algo.round_metrics(1)["calibration_mse"] == pytest.approx(float(mse), rel=1e-4)
    assert algo.round_metrics(1)["calibration_mse"] < algo.round_metrics(1)["calibration_mse_fixed"]
    # evaluation and personalised evaluation see the calibrated classifier; training never does
    assert torch.equal(algo.global_message(2).tensors["buffers"], algo.global_buffers)
    assert torch.equal(algo.configure(2, [0], TRAIN)[0].tensors["buffers"], algo.with_classifier(algo.fixed))


def test_ridge_is_added_to_the_gram_matrix():
    gram, cross = torch.eye(2) * 2, torch.tensor([[1.0, 0.0], [0.0, 3.0]])
    torch.testing.assert_close(calibrated_classifier(gram, cross, 1.0), torch.tensor([[1 / 3, 0.0], [0.0, 1.0]]))


def test_the_training_phase_restores_the_fixed_classifier_after_averaging():
    algo, model, flat = make_spherefed()
    algo.global_buffers = algo.with_classifier(torch.full((C, D), 0.3))
    replies = {cid: algo.client_update(context(algo, model, flat, 1, TRAIN, data(seed=cid), cid)) for cid in (0, 1)}
    algo.aggregate(1, replies, TRAIN)
    assert torch.equal(algo.global_buffers[algo.classifier_slice()], algo.fixed)
    assert algo.round_metrics(1)["train_loss"] == pytest.approx(
        sum(r.metrics["train_loss"] for r in replies.values()) / 2
    )


def sphere_config(tiny_config, name, **algo):
    return tiny_config(
        run={"name": name, "rounds": 6},
        partition={"local_test_fraction": 0.25},
        algorithm={"name": "spherefed", **algo},
    )


def test_spherefed_learns_and_resumes_bit_exact(tiny_config, kill_and_resume):
    full, resumed = kill_and_resume(lambda name: sphere_config(tiny_config, name))
    records = read_metrics(full.run_dir / "metrics.jsonl")
    final = records[-1]
    assert final["test_acc"] > 0.75 and final["personal_acc_micro"] > 0.75, final  # 10 classes: chance is 0.1
    assert final["calibration_mse"] < final["calibration_mse_fixed"] and final["train_loss"] is not None
    keys = ("round", "test_acc", "train_loss", "personal_acc_micro", "calibration_mse")
    assert [{k: r[k] for k in keys} for r in records] == [
        {k: r[k] for k in keys} for r in read_metrics(resumed.run_dir / "metrics.jsonl")
    ]
    torch.testing.assert_close(full.algo.global_buffers, resumed.algo.global_buffers, rtol=0, atol=0)
    torch.testing.assert_close(full.algo.global_params, resumed.algo.global_params, rtol=0, atol=0)


def test_calibration_never_changes_training(tiny_config):
    """The clients train against the fixed classifier either way: only the evaluated classifier differs."""
    from fedhet.engine.simulation import Simulation

    runs = {on: Simulation(sphere_config(tiny_config, f"cal{on}", calibrate=on)) for on in (True, False)}
    finals = {on: sim.run()["final"] for on, sim in runs.items()}
    assert runs[False].algo.phases == (TRAIN,)
    assert torch.equal(runs[True].algo.global_params, runs[False].algo.global_params)
    assert finals[True]["train_loss"] == finals[False]["train_loss"]
    assert torch.equal(runs[False].algo.global_buffers, runs[False].algo.with_classifier(runs[False].algo.fixed))


def test_eval_local_models_scores_the_trained_bodies_not_the_calibration_phase(tiny_config):
    """run.eval_local_models takes the local models from the ``train`` phase's replies (``local_model_phase``): the
    calibration phase only measures the new global body, so its replies carry no local model."""
    from fedhet.engine.client import LOCAL_PARAMS
    from fedhet.engine.simulation import Simulation

    cfg = tiny_config(
        run={"name": "local", "rounds": 2, "eval_local_models": True},
        algorithm={"name": "spherefed"},
    )
    sim = Simulation(cfg)
    seen: dict[str, list[bool]] = {}
    run_phase = sim.executor.run_phase

    def watched(rnd, phase_idx, phase, msgs):
        replies, failures = run_phase(rnd, phase_idx, phase, msgs)
        for reply in replies.values():
            carries = LOCAL_PARAMS in reply.tensors
            seen.setdefault(phase, []).append(carries)
            if carries:  # the model the client trained: its reply's body with the fixed classifier
                assert torch.equal(reply.tensors[LOCAL_PARAMS], reply.tensors["params"])
        return replies, failures

    sim.executor.run_phase = watched
    sim.run()
    assert sim.algo.local_model_phase == TRAIN and sim.algo.phases == (TRAIN, CALIBRATE)
    assert seen[TRAIN] and all(seen[TRAIN]) and not any(seen[CALIBRATE])
    last = read_metrics(sim.run_dir / "metrics.jsonl")[-1]
    assert 0 < last["local_risk"] < 1 and last["local_kl"] > 0

"""FedBABU: one body-only local step against hand computation (momentum, weight decay and clipping never reach the
frozen head), the head kept bit for bit by clients and server, fine-tuning against hand computation on training data
only, and end-to-end learning that resumes bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedhet.algorithms import ALGORITHMS, Setup
from fedhet.algorithms.base import ClientContext, ClientData
from fedhet.algorithms.server_opt import AdaptiveParams, FedAdam, ServerOptimizer
from fedhet.config import TrainSection
from fedhet.models.base import FedModel
from fedhet.results.store import read_metrics
from fedhet.toolkit.flat import FlatModel

D, C = 5, 3


def hidden_model() -> FedModel:
    """4 inputs -> ReLU(Linear) features of width D -> C logits."""
    return FedModel({"fc": nn.Sequential(nn.Linear(4, D), nn.ReLU())}, D, C)


SLICES = FlatModel(hidden_model()).slices()


def make_fedbabu(train: TrainSection | None = None, server_opt=None, clients=2, **params):
    entry = ALGORITHMS.get("fedbabu")
    train = train or TrainSection(batch_size=8, local_steps=1, lr=0.1)
    algo = entry.obj(entry.params(**params), Setup(clients, C, train, hidden_model), server_opt)
    torch.manual_seed(0)
    model = hidden_model()
    flat = FlatModel(model)
    algo.init_server(torch.randn(flat.num_params), flat.get_buffers())
    return algo, model, flat


def context(algo, model, flat, rnd, data, cid=0, phase="train") -> ClientContext:
    msg = algo.configure(rnd, [cid], "train")[cid]
    return ClientContext(
        cid, rnd, phase, msg, data, {}, model, flat, algo.setup.train, torch.Generator().manual_seed(rnd)
    )


def gradients(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """The mean cross-entropy gradient of every parameter of hidden_model at w, written out by hand."""
    W1, b1 = w[SLICES["body.fc.0.weight"]].view(D, 4), w[SLICES["body.fc.0.bias"]]
    Wh, bh = w[SLICES["head.weight"]].view(C, D), w[SLICES["head.bias"]]
    h = x @ W1.T + b1
    z = h.clamp(min=0)
    err = ((z @ Wh.T + bh).softmax(1) - F.one_hot(y, C).float()) / len(y)
    dh = (err @ Wh) * (h > 0)
    return {
        "body.fc.0.weight": (dh.T @ x).reshape(-1),
        "body.fc.0.bias": dh.sum(0),
        "head.weight": (err.T @ z).reshape(-1),
        "head.bias": err.sum(0),
    }


def batch(n=8, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g), torch.randint(0, C, (n,), generator=g)


# ------------------------------------------------------------------------------------------- one local step
@pytest.mark.parametrize("clip", [None, 0.05])
def test_one_step_moves_the_body_only_and_clips_on_the_body_gradient(clip):
    lr, wd = 0.1, 0.01
    train = TrainSection(batch_size=8, local_steps=1, lr=lr, momentum=0.9, weight_decay=wd, grad_clip=clip)
    algo, model, flat = make_fedbabu(train=train)
    x, y = batch()
    w = algo.global_params
    reply = algo.client_update(context(algo, model, flat, 1, ClientData(x, y, C)))

    grads = gradients(w, x, y)
    body = torch.cat([grads["body.fc.0.weight"], grads["body.fc.0.bias"]])
    scale = 1.0 if clip is None else min(1.0, clip / (float(body.norm()) + 1e-6))  # the head's gradient is out
    assert clip is None or scale < 1.0  # the clip really acts
    for name in ("body.fc.0.weight", "body.fc.0.bias"):  # first momentum step: the direction is g + wd w
        want = w[SLICES[name]] - lr * (scale * grads[name] + wd * w[SLICES[name]])
        torch.testing.assert_close(reply.tensors["params"][SLICES[name]], want)
    assert torch.equal(reply.tensors["params"][algo.kept], w[algo.kept])  # frozen: bit for bit


def test_the_head_stays_frozen_through_momentum_and_weight_decay():
    train = TrainSection(batch_size=4, local_steps=7, lr=0.5, momentum=0.9, weight_decay=0.1, nesterov=True)
    algo, model, flat = make_fedbabu(train=train)
    x, y = batch(16)
    reply = algo.client_update(context(algo, model, flat, 1, ClientData(x, y, C)))
    assert torch.equal(reply.tensors["params"][algo.kept], algo.global_params[algo.kept])
    assert not torch.equal(reply.tensors["params"][algo.body], algo.global_params[algo.body])


# ------------------------------------------------------------------------------------------- server
@pytest.mark.parametrize("server", ["sgd", "fedadam"])
def test_the_server_keeps_the_head_and_averages_the_bodies_by_samples(server):
    opt = FedAdam(AdaptiveParams(lr=0.05)) if server == "fedadam" else ServerOptimizer()
    train = TrainSection(batch_size=4, local_steps=3, lr=0.1, momentum=0.5, weight_decay=1e-3)
    algo, model, flat = make_fedbabu(train=train, server_opt=opt, clients=3)
    sizes = {0: 12, 1: 7, 2: 5}  # weights 12/24, 7/24, 5/24
    data = {c: ClientData(*batch(n, seed=c), C) for c, n in sizes.items()}
    head = algo.global_params[algo.kept].clone()
    for rnd in (1, 2):
        before = algo.global_params.clone()
        replies = {c: algo.client_update(context(algo, model, flat, rnd, data[c], c)) for c in sizes}
        algo.aggregate(rnd, replies, "train")
        assert torch.equal(algo.global_params[algo.kept], head)
        if server == "sgd":
            average = sum(sizes[c] / 24 * replies[c].tensors["params"][algo.body] for c in sizes)
            torch.testing.assert_close(algo.global_params[algo.body], average)
        assert not torch.equal(algo.global_params[algo.body], before[algo.body])


# ------------------------------------------------------------------------------------------- fine-tuning
@pytest.mark.parametrize("part", ["full", "head"])
@pytest.mark.parametrize("finetune_lr", [None, 0.3])
def test_finetuning_is_sgd_on_the_training_data_from_the_global_model(part, finetune_lr):
    train = TrainSection(batch_size=64, local_steps=4, lr=0.1)  # one batch holds all; local_steps is not used
    algo, model, flat = make_fedbabu(train=train, finetune_epochs=2, finetune=part, finetune_lr=finetune_lr)
    x, y = batch(10)
    x_test, y_test = batch(6, seed=9)
    data = ClientData(x, y, C, x_test=x_test, y_test=y_test)
    ctx = context(algo, model, flat, 1, data, phase="personalize")
    personal = algo.personalize(ctx)

    lr = finetune_lr or 0.1
    w = algo.global_params.clone()
    for _ in range(2):  # two epochs of one full batch each, plain SGD
        grads = gradients(w, x, y)
        for name, grad in grads.items():
            if part == "full" or name.startswith("head."):
                w[SLICES[name]] -= lr * grad
    torch.testing.assert_close(personal, w)
    if part == "head":
        assert torch.equal(personal[algo.body], algo.global_params[algo.body])
    assert ctx.state == {}  # nothing of the fine-tuned model is kept


def test_zero_finetuning_epochs_is_the_global_model():
    algo, model, flat = make_fedbabu(finetune_epochs=0)
    ctx = context(algo, model, flat, 1, ClientData(*batch(), C), phase="personalize")
    assert torch.equal(algo.personalize(ctx), algo.global_params)


# ------------------------------------------------------------------------------------------- end to end
def babu_config(tiny_config, name, **algo):
    return tiny_config(
        run={"name": name, "rounds": 5},
        partition={"local_test_fraction": 0.2},
        train={"participation": 1.0, "momentum": 0.5, "weight_decay": 1e-4},
        algorithm={"name": "fedbabu", **algo},
    )


def test_fedbabu_learns_both_models_and_resumes_bit_exact(tiny_config, kill_and_resume):
    full, resumed = kill_and_resume(lambda name: babu_config(tiny_config, name))
    records = read_metrics(full.run_dir / "metrics.jsonl")
    final = records[-1]
    assert final["test_acc"] > 0.6, final  # 10 classes: chance is 0.1
    assert final["personal_acc_micro"] > 0.85 and final["personal_clients"] == 6, final
    assert final["personal_acc_micro"] > final["client_acc_mean"]  # fine-tuning personalises
    keys = ("round", "test_acc", "test_loss", "train_loss", "personal_acc_micro", "personal_acc_macro")
    assert [{k: r[k] for k in keys} for r in records] == [
        {k: r[k] for k in keys} for r in read_metrics(resumed.run_dir / "metrics.jsonl")
    ]
    torch.testing.assert_close(full.algo.global_params, resumed.algo.global_params, rtol=0, atol=0)
    from fedhet.engine.simulation import Simulation

    initial = Simulation(babu_config(tiny_config, "fresh")).algo.global_params  # the seeded initial model
    assert torch.equal(full.algo.global_params[full.algo.kept], initial[full.algo.kept])  # the head never moved

"""FedBN and the buffer rule: the paper's digit CNN, one round against a hand computation (shared layers averaged,
each client's BatchNorm parameters and statistics its own), the personalised model with the client's statistics,
the rule per algorithm (averaged by default, local for FedBN and FedPer's personal layers), the refusal of a model
without BatchNorm, and a run on digits that learns and resumes bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedhet.algorithms import ALGORITHMS, Reply, Setup
from fedhet.algorithms.base import ClientContext, ClientData
from fedhet.algorithms.fedbn import BATCHES, BUFFERS, PARAMS
from fedhet.algorithms.server_opt import AvgMParams, FedAvgM
from fedhet.config import TrainSection
from fedhet.engine.simulation import Simulation
from fedhet.errors import ConfigError
from fedhet.models import build_model
from fedhet.models.base import FedModel
from fedhet.models.cnn import BatchNorm1d, BatchNorm2d
from fedhet.results.store import read_metrics
from fedhet.toolkit.flat import FlatModel

D, C = 3, 2


def bn_model() -> FedModel:
    """4 inputs -> Linear -> BatchNorm1d -> ReLU (width D) -> C logits."""
    torch.manual_seed(0)
    return FedModel({"fc": nn.Sequential(nn.Linear(4, D), nn.BatchNorm1d(D), nn.ReLU())}, D, C)


def make(name: str, clients: int = 2, server_opt=None, model=bn_model, **params):
    entry = ALGORITHMS.get(name)
    train = TrainSection(batch_size=64, local_steps=1, lr=0.5, momentum=0.0)
    algo = entry.obj(entry.params(**params), Setup(clients, C, train, model), server_opt)
    net = model()
    flat = FlatModel(net)
    algo.init_server(flat.get_params(), flat.get_buffers())
    return algo, net, flat


def context(algo, net, flat, cid, data, state, rnd=1) -> ClientContext:
    msg = algo.configure(rnd, [cid], "train")[cid]
    return ClientContext(cid, rnd, "train", msg, data, state, net, flat, algo.setup.train, torch.Generator())


def client_data(seed: int, n: int, shift: float) -> ClientData:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g) * (1 + shift) + shift  # feature skew: each client's own scale and offset
    return ClientData(x, torch.randint(0, C, (n,), generator=g), C)


def by_hand(start: nn.Module, data: ClientData, lr: float) -> nn.Module:
    """One full-batch step of plain SGD on the cross-entropy, with PyTorch's own modules and optimiser."""
    model = copy.deepcopy(start).train()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    F.cross_entropy(model(data.x), data.y).backward()
    opt.step()
    return model


def bn_entries(net: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    bn = net.body.fc[1]
    return torch.cat([bn.weight, bn.bias]).detach(), torch.cat([bn.running_mean, bn.running_var])


# ------------------------------------------------------------------------------------------------ the model
def test_cnn_bn_is_the_papers_digit_model_and_fits_any_image_size():
    model = build_model("cnn_bn", (3, 28, 28), 10)
    kinds = [type(m).__name__ for m in model.modules() if not isinstance(m, nn.Sequential | FedModel)]
    assert kinds == [
        *["Conv2d", "BatchNorm2d", "ReLU", "MaxPool2d"] * 2,
        *["Conv2d", "BatchNorm2d", "ReLU"],
        *["Flatten", "Linear", "BatchNorm1d", "ReLU"],
        *["Linear", "BatchNorm1d", "ReLU"],
        "Linear",
    ]
    assert model.body.fc1[1].in_features == 6272 and model.body.fc2[0].out_features == 512  # the paper's 6272-2048-512
    assert model(torch.randn(2, 3, 28, 28)).shape == (2, 10)
    assert build_model("cnn_bn", (1, 8, 8), 10)(torch.randn(2, 1, 8, 8)).shape == (2, 10)  # digits
    with pytest.raises(ConfigError, match="cannot take inputs of shape"):
        build_model("cnn_bn", (1, 3, 3), 10)


def test_a_training_batch_of_one_sample_uses_the_running_statistics():
    model = build_model("cnn_bn", (1, 8, 8), 3, channels=[2, 2, 4], hidden=[5])
    bn = model.body.fc1[2]
    assert isinstance(bn, BatchNorm1d) and isinstance(model.body.conv1[1], BatchNorm2d)
    bn.running_mean.uniform_(-1, 1)
    bn.running_var.uniform_(0.5, 2)
    before = (bn.running_mean.clone(), bn.running_var.clone())
    x = torch.randn(1, 5)
    out = bn.train()(x)  # PyTorch's BatchNorm1d refuses it: no batch statistics in one sample
    assert torch.equal(bn.running_mean, before[0]) and torch.equal(bn.running_var, before[1])
    torch.testing.assert_close(out, bn.eval()(x))
    pytorch = nn.BatchNorm1d(5).train()
    pytorch.load_state_dict(bn.state_dict())
    two = torch.randn(2, 5)
    torch.testing.assert_close(bn.train()(two), pytorch(two))  # any other batch: PyTorch's BatchNorm
    torch.testing.assert_close(bn.running_mean, pytorch.running_mean)
    assert model(torch.randn(1, 1, 8, 8)).shape == (1, 3)  # a one-sample batch trains through the whole model


# ------------------------------------------------------------------------------------------ one round by hand
def test_one_round_averages_the_shared_layers_and_keeps_each_clients_batchnorm():
    algo, net, flat = make("fedbn", weighting="samples")
    initial = bn_model()
    data = {0: client_data(1, 6, 0.0), 1: client_data(2, 10, 2.0)}
    states = {0: {}, 1: {}}
    replies = {cid: algo.client_update(context(algo, net, flat, cid, data[cid], states[cid])) for cid in data}
    trained = {cid: by_hand(initial, d, 0.5) for cid, d in data.items()}
    for cid, model in trained.items():  # each client holds its own trained BatchNorm layers and statistics
        params, stats = bn_entries(model)
        torch.testing.assert_close(states[cid][PARAMS], params)
        torch.testing.assert_close(states[cid][BUFFERS], stats)
        assert states[cid][BATCHES].tolist() == [1]
        reply = replies[cid]  # and sends the received (initial) values in their place
        torch.testing.assert_close(reply.tensors["params"][algo.local_params], algo.global_params[algo.local_params])
        torch.testing.assert_close(reply.tensors["buffers"], algo.global_buffers)
    algo.aggregate(1, replies, "train")
    want = FlatModel(copy.deepcopy(initial))
    shared = [(6 * FlatModel(trained[0]).params + 10 * FlatModel(trained[1]).params) / 16]
    keep = algo.local_params
    expected = shared[0].clone()
    expected[keep] = want.params[keep]  # the server's BatchNorm layers stay the initial ones, bit for bit
    torch.testing.assert_close(algo.global_params, expected)
    assert torch.equal(algo.global_params[keep], want.params[keep])
    assert torch.equal(algo.global_buffers, want.buffers)
    not_bn = torch.ones(flat.num_params, dtype=torch.bool)
    not_bn[keep] = False
    assert not_bn.sum() == flat.num_params - 2 * D  # everything but gamma and beta is shared

    # the personalised model: the averaged layers with the client's own BatchNorm parameters and statistics
    ctx = context(algo, net, flat, 1, data[1], states[1], rnd=2)
    personal = algo.personalize(ctx)
    torch.testing.assert_close(personal[not_bn], algo.global_params[not_bn])
    torch.testing.assert_close(personal[keep], states[1][PARAMS])
    torch.testing.assert_close(algo.personal_buffers(ctx), states[1][BUFFERS])
    assert algo.personalize(context(algo, net, flat, 0, data[0], {}, rnd=2)) is None  # never trained: none


def test_round_two_starts_from_the_clients_own_batchnorm(monkeypatch):
    algo, net, flat = make("fedbn")
    data, state = client_data(3, 8, 1.0), {}
    algo.client_update(context(algo, net, flat, 0, data, state))
    own = (state[PARAMS].clone(), state[BUFFERS].clone())
    seen = {}

    def record(ctx, x, y):
        seen["params"] = ctx.flat.params[algo.local_params].clone()
        seen["buffers"] = ctx.flat.buffers.clone()
        seen["batches"] = int(ctx.model.body.fc[1].num_batches_tracked)
        return F.cross_entropy(ctx.model(x), y)

    monkeypatch.setattr(algo, "local_loss", record)
    algo.client_update(context(algo, net, flat, 0, data, state, rnd=2))
    assert torch.equal(seen["params"], own[0]) and torch.equal(seen["buffers"], own[1]) and seen["batches"] == 1
    assert state[BATCHES].tolist() == [2]
    algo.client_update(context(algo, net, flat, 1, data, {}, rnd=2))  # another client counts from 0
    assert seen["batches"] == 0


def test_no_server_optimiser_moves_the_batchnorm_layers():
    algo, net, flat = make("fedbn", server_opt=FedAvgM(AvgMParams(lr=1.0, momentum=0.9)))
    before = algo.global_params.clone()
    for rnd in (1, 2):
        replies = {
            cid: algo.client_update(context(algo, net, flat, cid, client_data(cid, 8, cid), {}, rnd)) for cid in (0, 1)
        }
        algo.aggregate(rnd, replies, "train")
    assert torch.equal(algo.global_params[algo.local_params], before[algo.local_params])
    assert not torch.equal(algo.global_params, before)


# ------------------------------------------------------------------------------------------- the buffer rule
def two_replies(flat: FlatModel) -> tuple[dict[int, Reply], list[torch.Tensor]]:
    buffers = [flat.get_buffers() + 1.0, flat.get_buffers() * 3.0 + 2.0]
    replies = {
        cid: Reply(tensors={"params": flat.get_params(), "buffers": b}, num_examples=n)
        for cid, (b, n) in enumerate(zip(buffers, (1, 3), strict=True))
    }
    return replies, buffers


@pytest.mark.parametrize("name", ["fedavg", "fedprox", "fedbabu", "fedper"])
def test_buffers_are_averaged_with_the_aggregation_weights_by_default(name):
    algo, _, flat = make(name)
    assert algo.kept_buffers is None  # FedPer's one personal layer (the head) has no buffers
    replies, buffers = two_replies(flat)
    algo.aggregate(1, replies, "train")
    torch.testing.assert_close(algo.global_buffers, 0.25 * buffers[0] + 0.75 * buffers[1])


def deep_bn_model() -> FedModel:
    """Linear -> BatchNorm1d -> ReLU, then Linear -> BatchNorm1d -> ReLU: FedPer's top two layers hold the second
    BatchNorm (and the head)."""
    torch.manual_seed(0)
    stage = lambda i, o: nn.Sequential(nn.Linear(i, o), nn.BatchNorm1d(o), nn.ReLU())  # noqa: E731
    return FedModel({"fc1": stage(4, D), "fc2": stage(D, D)}, D, C)


@pytest.mark.parametrize("name", ["fedbn", "fedper"])
def test_local_buffers_stay_on_the_clients_and_the_rest_is_averaged(name):
    algo, net, flat = make(name, model=deep_bn_model, **({"personal_layers": 2} if name == "fedper" else {}))
    slices = flat.buffer_slices()
    local = ["body.fc2.1.running_mean", "body.fc2.1.running_var"]
    if name == "fedbn":
        local += ["body.fc1.1.running_mean", "body.fc1.1.running_var"]
    kept = torch.zeros(flat.buffers.numel(), dtype=torch.bool)
    for key in local:
        kept[slices[key]] = True
    assert sorted(algo.kept_buffers.tolist()) == kept.nonzero().flatten().tolist()
    before = algo.global_buffers.clone()
    replies, buffers = two_replies(flat)
    algo.aggregate(1, replies, "train")
    torch.testing.assert_close(algo.global_buffers[~kept], (0.25 * buffers[0] + 0.75 * buffers[1])[~kept])
    assert torch.equal(algo.global_buffers[kept], before[kept])

    state = {}  # a client keeps its own, scores its personalised model with them, and sends the global ones
    ctx = context(algo, net, flat, 0, client_data(5, 8, 1.0), state)
    reply = algo.client_update(ctx)
    own = state[BUFFERS if name == "fedbn" else "personal_buffers"]
    assert not torch.equal(own, algo.global_buffers[kept])
    assert torch.equal(reply.tensors["buffers"][kept], algo.global_buffers[kept])
    personal = algo.personal_buffers(context(algo, net, flat, 0, ctx.data, state, rnd=2))
    assert torch.equal(personal[kept], own) and torch.equal(personal[~kept], algo.global_buffers[~kept])


def test_fedbn_refuses_a_model_without_batchnorm():
    plain = lambda: FedModel({"fc": nn.Sequential(nn.Linear(4, D), nn.ReLU())}, D, C)  # noqa: E731
    with pytest.raises(ConfigError, match=r"model has none: use a model with BatchNorm \(model.name = \"cnn_bn\""):
        make("fedbn", model=plain)


def test_a_run_without_batchnorm_is_one_config_error(tiny_config):
    with pytest.raises(ConfigError, match="algorithm 'fedbn' keeps each client's BatchNorm layers"):
        Simulation(tiny_config(algorithm={"name": "fedbn"}, model={"name": "mlp", "hidden": [8]}))


# ------------------------------------------------------------------------------------------------ end to end
def fedbn_config(tiny_config, name, rounds=10):
    return tiny_config(
        run={"name": name, "rounds": rounds},
        partition={"name": "iid", "num_clients": 6, "local_test_fraction": 0.2},
        model={"name": "cnn_bn", "channels": [16, 16, 32], "hidden": [64, 32]},
        train={"participation": 1.0, "batch_size": 32, "lr": 0.02},
        algorithm={"name": "fedbn"},
    )


@pytest.mark.slow
def test_fedbn_learns_on_digits_and_resumes_bit_for_bit(tiny_config, kill_and_resume):
    full, resumed = kill_and_resume(lambda name: fedbn_config(tiny_config, name), stop_after=4)
    records = read_metrics(full.run_dir / "metrics.jsonl")
    assert records[0]["personal_acc_micro"] < 0.5 < 0.85 < records[-1]["personal_acc_micro"]
    assert records[-1]["personal_clients"] == 6
    drop = ("elapsed_s",)
    again = read_metrics(resumed.run_dir / "metrics.jsonl")
    assert [{k: v for k, v in r.items() if k not in drop} for r in records] == [
        {k: v for k, v in r.items() if k not in drop} for r in again
    ]
    assert torch.equal(full.algo.global_params, resumed.algo.global_params)
    assert torch.equal(full.algo.global_buffers, resumed.algo.global_buffers)
    for cid, state in full.executor.store.items():
        other = resumed.executor.store.get(cid)
        assert sorted(state) == sorted(other) == sorted([PARAMS, BUFFERS, BATCHES])
        assert all(torch.equal(state[k], other[k]) for k in state)

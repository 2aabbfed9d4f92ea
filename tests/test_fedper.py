"""FedPer: the personalisation layers counted from the output, one local step against hand computation, the layers
kept on their clients and out of aggregation, the personalised model, and end-to-end learning that resumes bit for
bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedhet.algorithms import ALGORITHMS, Setup
from fedhet.algorithms.base import ClientContext, ClientData
from fedhet.algorithms.fedper import PERSONAL
from fedhet.algorithms.partial import top_layers
from fedhet.algorithms.server_opt import AdaptiveParams, FedAdam, ServerOptimizer
from fedhet.config import TrainSection
from fedhet.errors import ConfigError
from fedhet.models.base import FedModel
from fedhet.results.store import read_metrics
from fedhet.toolkit.flat import FlatModel

D, C = 5, 3
HEAD = D * C + C  # head weight and bias


def hidden_model() -> FedModel:
    """4 inputs -> ReLU(Linear) features of width D -> C logits: two layers with parameters."""
    return FedModel({"fc": nn.Sequential(nn.Linear(4, D), nn.ReLU())}, D, C)


def make_fedper(train: TrainSection | None = None, server_opt=None, clients=2, **params):
    entry = ALGORITHMS.get("fedper")
    train = train or TrainSection(batch_size=8, local_steps=1, lr=0.1)
    algo = entry.obj(entry.params(**params), Setup(clients, C, train, hidden_model), server_opt)
    torch.manual_seed(0)
    model = hidden_model()
    flat = FlatModel(model)
    algo.init_server(torch.randn(flat.num_params), flat.get_buffers())
    return algo, model, flat


def context(algo, model, flat, rnd, data, state, cid=0) -> ClientContext:
    msg = algo.configure(rnd, [cid], "train")[cid]
    return ClientContext(
        cid, rnd, "train", msg, data, state, model, flat, algo.setup.train, torch.Generator().manual_seed(rnd)
    )


# ------------------------------------------------------------------------------------------- personal layers
def test_personal_layers_are_counted_from_the_output():
    model = hidden_model()
    s = FlatModel(hidden_model()).slices()
    head, names = top_layers(hidden_model, 1, "k")
    assert names == ["head"] and head == slice(s["head.weight"].start, s["head.bias"].stop)
    both, names = top_layers(hidden_model, 2, "k")
    assert names == ["body.fc.0", "head"] and both == slice(0, sum(p.numel() for p in model.parameters()))
    with pytest.raises(ConfigError, match=r"algorithm.personal_layers: must be at most 2, .* \(got 3\)"):
        make_fedper(personal_layers=3)


def test_building_the_layout_leaves_the_random_stream_alone():
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    top_layers(hidden_model, 1, "k")  # builds a model (drawing weights) to find the layers
    assert torch.equal(torch.rand(3), expected)


# ------------------------------------------------------------------------------------------- one local step
def test_one_step_trains_the_base_and_the_clients_own_head():
    lr, wd = 0.1, 0.01
    train = TrainSection(batch_size=8, local_steps=1, lr=lr, momentum=0.9, weight_decay=wd)
    algo, model, flat = make_fedper(train=train)
    s = FlatModel(hidden_model()).slices()
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 4, generator=g), torch.tensor([0, 2, 2, 1, 0, 2, 0, 1])
    own = torch.randn(HEAD, generator=g)  # this client's head from an earlier round
    ctx = context(algo, model, flat, 1, ClientData(x, y, C), {PERSONAL: own.clone()})
    w = algo.global_params
    reply = algo.client_update(ctx)

    W1, b1 = w[s["body.fc.0.weight"]].view(D, 4), w[s["body.fc.0.bias"]]
    Wp, bp = own[: D * C].view(C, D), own[D * C :]  # the client's own head, not the received one
    h = x @ W1.T + b1
    z = h.clamp(min=0)
    err = ((z @ Wp.T + bp).softmax(1) - F.one_hot(y, C).float()) / 8
    dh = (err @ Wp) * (h > 0)
    grads = {"body.fc.0.weight": dh.T @ x, "body.fc.0.bias": dh.sum(0)}
    for name, grad in grads.items():  # first momentum step: the direction is g + wd w
        want = w[s[name]] - lr * (grad.reshape(-1) + wd * w[s[name]])
        torch.testing.assert_close(reply.tensors["params"][s[name]], want)
    head_grad = torch.cat([(err.T @ z).reshape(-1), err.sum(0)])
    torch.testing.assert_close(ctx.state[PERSONAL], own - lr * (head_grad + wd * own))
    # the reply carries the received head, never the client's own
    assert torch.equal(reply.tensors["params"][algo.kept], w[algo.kept])


def test_a_new_client_starts_from_the_global_head():
    algo, model, flat = make_fedper()
    x, y = torch.randn(8, 4, generator=torch.Generator().manual_seed(1)), torch.zeros(8, dtype=torch.long)
    ctx = context(algo, model, flat, 1, ClientData(x, y, C), {})
    flat.set_params(ctx.global_params)
    algo.before_local(ctx)
    assert torch.equal(flat.params, algo.global_params)
    algo.client_update(ctx)
    assert not torch.equal(ctx.state[PERSONAL], algo.global_params[algo.kept])  # trained, and now its own


# ------------------------------------------------------------------------------------------- never aggregated
@pytest.mark.parametrize("server", ["sgd", "fedadam"])
@pytest.mark.parametrize("layers", [1, 2])
def test_personal_layers_stay_on_their_clients_and_the_base_is_sample_averaged(server, layers):
    opt = FedAdam(AdaptiveParams(lr=0.05)) if server == "fedadam" else ServerOptimizer()
    train = TrainSection(batch_size=4, local_steps=3, lr=0.1, momentum=0.5)
    algo, model, flat = make_fedper(train=train, server_opt=opt, clients=3, personal_layers=layers)
    keep = algo.kept
    g = torch.Generator().manual_seed(1)
    sizes = {0: 12, 1: 7, 2: 5}  # weights 12/24, 7/24, 5/24
    data = {
        c: ClientData(torch.randn(n, 4, generator=g), torch.randint(0, C, (n,), generator=g), C)
        for c, n in sizes.items()
    }
    states = {cid: {PERSONAL: torch.randn(keep.stop - keep.start, generator=g)} for cid in sizes}
    start = algo.global_params.clone()

    for rnd in (1, 2):
        before = algo.global_params.clone()
        replies = {}
        for cid in sizes:
            mine = states[cid][PERSONAL].clone()
            ctx = context(algo, model, flat, rnd, data[cid], states[cid], cid)
            flat.set_params(ctx.global_params)  # as the loop does: the received model, then the client's layers
            algo.before_local(ctx)
            assert torch.equal(flat.params[keep], mine)
            replies[cid] = algo.client_update(ctx)
            assert torch.equal(replies[cid].tensors["params"][keep], start[keep])
            assert not torch.equal(states[cid][PERSONAL], mine)
        algo.aggregate(rnd, replies, "train")
        assert torch.equal(algo.global_params[keep], start[keep])  # bit for bit, whatever the server optimiser
        if server == "sgd" and keep.start > 0:
            average = sum(sizes[c] / 24 * replies[c].tensors["params"][: keep.start] for c in sizes)
            torch.testing.assert_close(algo.global_params[: keep.start], average)
        if keep.start > 0:
            assert not torch.equal(algo.global_params[: keep.start], before[: keep.start])


# ------------------------------------------------------------------------------------------- personalised model
def test_the_personalised_model_is_the_global_base_with_the_clients_own_layers():
    algo, model, flat = make_fedper()
    own = torch.randn(HEAD, generator=torch.Generator().manual_seed(2))
    data = ClientData(torch.randn(4, 4), torch.zeros(4, dtype=torch.long), C)
    ctx = context(algo, model, flat, 1, data, {PERSONAL: own})
    personal = algo.personalize(ctx)
    assert torch.equal(personal[: algo.kept.start], algo.global_params[: algo.kept.start])
    assert torch.equal(personal[algo.kept], own)
    assert algo.personalize(context(algo, model, flat, 1, data, {})) is None  # never trained: none


# ------------------------------------------------------------------------------------------- end to end
def per_config(tiny_config, name, **algo):
    return tiny_config(
        run={"name": name, "rounds": 5},
        partition={"local_test_fraction": 0.2},
        train={"participation": 1.0},
        algorithm={"name": "fedper", **algo},
    )


def test_fedper_learns_personal_models_and_resumes_bit_exact(tiny_config, kill_and_resume):
    full, resumed = kill_and_resume(lambda name: per_config(tiny_config, name))
    records = read_metrics(full.run_dir / "metrics.jsonl")
    final = records[-1]
    assert final["personal_acc_micro"] > 0.8 and final["personal_clients"] == 6, final  # 10 classes: chance 0.1
    assert final["personal_acc_micro"] > records[0]["personal_acc_micro"]
    keys = ("round", "test_acc", "test_loss", "train_loss", "personal_acc_micro", "personal_acc_macro")
    assert [{k: r[k] for k in keys} for r in records] == [
        {k: r[k] for k in keys} for r in read_metrics(resumed.run_dir / "metrics.jsonl")
    ]
    torch.testing.assert_close(full.algo.global_params, resumed.algo.global_params, rtol=0, atol=0)
    for cid, state in full.executor.store.items():
        torch.testing.assert_close(state[PERSONAL], resumed.executor.store.get(cid)[PERSONAL], rtol=0, atol=0)


def test_too_many_personal_layers_is_a_config_error(tiny_config):
    from fedhet.engine.simulation import Simulation

    with pytest.raises(ConfigError, match="algorithm.personal_layers: must be at most 2"):
        Simulation(per_config(tiny_config, "deep", personal_layers=3))  # mlp [32]: hidden Linear + head

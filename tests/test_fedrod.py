"""FedRoD: the balanced softmax loss and one local step against hand computation, the personal head kept on the
client and out of aggregation, the personalised logits G + P, and end-to-end learning that resumes bit for bit."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedhet.algorithms import ALGORITHMS, Setup
from fedhet.algorithms.base import ClientContext, ClientData
from fedhet.algorithms.fedrod import PERSONAL, balanced_softmax_loss
from fedhet.algorithms.server_opt import AdaptiveParams, FedAdam, ServerOptimizer
from fedhet.config import TrainSection
from fedhet.models.base import FedModel
from fedhet.results.store import read_metrics
from fedhet.toolkit.flat import FlatModel

D, C = 5, 3


def hidden_model() -> FedModel:
    """4 inputs -> ReLU(Linear) features of width D -> C logits."""
    return FedModel({"fc": nn.Sequential(nn.Linear(4, D), nn.ReLU())}, D, C)


def identity_model(head_bias: bool = True) -> FedModel:
    """The features are the inputs themselves (D of them), so logits can be written out by hand."""
    return FedModel({"flat": nn.Flatten()}, D, C, head_bias=head_bias)


def make_fedrod(build=hidden_model, train: TrainSection | None = None, server_opt=None, clients=2, **params):
    entry = ALGORITHMS.get("fedrod")
    cfg = entry.params(**params)

    def build_prepared():
        return entry.obj.prepare_model(cfg, build())

    train = train or TrainSection(batch_size=8, local_steps=1, lr=0.1)
    algo = entry.obj(cfg, Setup(clients, C, train, build_prepared), server_opt)
    torch.manual_seed(0)
    model = build_prepared()
    flat = FlatModel(model)
    algo.init_server(torch.randn(flat.num_params), flat.get_buffers())
    return algo, model, flat


def context(algo, model, flat, rnd, data, state, cid=0) -> ClientContext:
    msg = algo.configure(rnd, [cid], "train")[cid]
    return ClientContext(
        cid, rnd, "train", msg, data, state, model, flat, algo.setup.train, torch.Generator().manual_seed(rnd)
    )


def parts(vec: torch.Tensor, slices: dict[str, slice], prefix: str) -> dict[str, torch.Tensor]:
    return {name[len(prefix) :]: vec[s] for name, s in slices.items() if name.startswith(prefix)}


# ------------------------------------------------------------------------------------------- balanced softmax
def test_balanced_softmax_loss_and_gradient_match_hand_computation_with_a_missing_class():
    logits = torch.tensor([[1.0, 2.0, 0.5], [0.2, -1.0, 3.0], [0.0, 0.0, 0.0]], requires_grad=True)
    y = torch.tensor([0, 2, 0])
    counts = torch.tensor([3.0, 0.0, 1.0])  # class 1 is missing from this client
    loss = balanced_softmax_loss(logits, y, counts.log())
    loss.backward()

    rows = [[1.0, 2.0, 0.5], [0.2, -1.0, 3.0], [0.0, 0.0, 0.0]]
    present = {0: math.log(3.0), 2: math.log(1.0)}  # the missing class drops out of the softmax entirely
    total, grads = 0.0, []
    for row, label in zip(rows, [0, 2, 0], strict=True):
        adjusted = {c: row[c] + shift for c, shift in present.items()}
        norm = sum(math.exp(a) for a in adjusted.values())
        total += -adjusted[label] + math.log(norm)
        p = {c: math.exp(a) / norm for c, a in adjusted.items()}
        grads.append([(p.get(c, 0.0) - (c == label)) / 3 for c in range(3)])
    assert loss.item() == pytest.approx(total / 3, rel=1e-6)
    torch.testing.assert_close(logits.grad, torch.tensor(grads))
    assert torch.all(logits.grad[:, 1] == 0)  # no gradient ever reaches an absent class


# ------------------------------------------------------------------------------------------- one local step
@pytest.mark.parametrize("optimizer", ["plain", "shared"])
def test_one_step_matches_hand_computation(optimizer):
    lr, wd = 0.1, 0.01
    train = TrainSection(batch_size=8, local_steps=1, lr=lr, momentum=0.9, weight_decay=wd)
    algo, model, flat = make_fedrod(train=train, personal_optimizer=optimizer)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 4, generator=g), torch.tensor([0, 2, 2, 0, 0, 2, 0, 0])  # class 1 missing
    own = torch.randn(D * C + C, generator=g)  # the client's P-head from an earlier round
    ctx = context(algo, model, flat, 1, ClientData(x, y, C), {PERSONAL: own.clone()})
    w = algo.global_params
    s = algo.slices()
    reply = algo.client_update(ctx)

    W1, b1 = w[s["body.fc.0.weight"]].view(D, 4), w[s["body.fc.0.bias"]]
    Wg, bg = w[s["head.weight"]].view(C, D), w[s["head.bias"]]
    Wp, bp = own[: D * C].view(C, D), own[D * C :]
    onehot = F.one_hot(y, C).float()
    h = x @ W1.T + b1
    z = h.clamp(min=0)
    generic = z @ Wg.T + bg
    shifted = generic + torch.tensor([math.log(5), -math.inf, math.log(3)])  # counts 5, 0, 3
    err_g = (shifted.softmax(1) - onehot) / 8
    err_p = ((generic + z @ Wp.T + bp).softmax(1) - onehot) / 8
    dh = (err_g @ Wg) * (h > 0)  # the personal loss never reaches the body: only the generic error does
    grads = {"body.fc.0.weight": dh.T @ x, "body.fc.0.bias": dh.sum(0), "head.weight": err_g.T @ z}
    grads["head.bias"] = err_g.sum(0)
    for name, grad in grads.items():  # first momentum step: the direction is g + wd w
        want = w[s[name]] - lr * (grad.reshape(-1) + wd * w[s[name]])
        torch.testing.assert_close(reply.tensors["params"][s[name]], want)

    dp = torch.cat([(err_p.T @ z).reshape(-1), err_p.sum(0)])
    want_p = own - lr * dp if optimizer == "plain" else own - lr * (dp + wd * own)
    torch.testing.assert_close(ctx.state[PERSONAL], want_p)
    # the reply carries the received P slice, never the client's own
    assert torch.equal(reply.tensors["params"][s[PERSONAL]], w[s[PERSONAL]])
    assert reply.metrics["train_loss"] == pytest.approx(reply.metrics["generic_loss"] + reply.metrics["personal_loss"])


# ------------------------------------------------------------------------------------------- never aggregated
@pytest.mark.parametrize("server", ["sgd", "fedadam"])
def test_personal_heads_stay_on_their_clients_and_out_of_the_global_model(server):
    opt = FedAdam(AdaptiveParams(lr=0.05)) if server == "fedadam" else ServerOptimizer()
    train = TrainSection(batch_size=4, local_steps=3, lr=0.1, momentum=0.5)
    algo, model, flat = make_fedrod(train=train, server_opt=opt, clients=3)
    s = algo.slices()[PERSONAL]
    g = torch.Generator().manual_seed(1)
    # unequal sizes: weights 12/24, 7/24, 5/24, whose weighted sum of equal values need not round back to them
    sizes = {0: 12, 1: 7, 2: 5}
    data = {
        c: ClientData(torch.randn(n, 4, generator=g), torch.randint(0, C, (n,), generator=g), C)
        for c, n in sizes.items()
    }
    states = {cid: {PERSONAL: torch.randn(D * C + C, generator=g)} for cid in sizes}
    start = algo.global_params.clone()

    for rnd in (1, 2):
        replies = {}
        for cid in sizes:
            ctx = context(algo, model, flat, rnd, data[cid], states[cid], cid)
            if rnd == 2:  # the loop loads the received model, then before_local the client's own P-head
                flat.set_params(ctx.global_params)
                algo.before_local(ctx)
                assert torch.equal(flat.params[s], states[cid][PERSONAL])
            replies[cid] = algo.client_update(ctx)
            assert torch.equal(replies[cid].tensors["params"][s], start[s])
        algo.aggregate(rnd, replies, "train")
        assert torch.equal(algo.global_params[s], start[s])  # bit for bit, whatever the server optimiser
        assert not torch.equal(algo.global_params[: s.start], start[: s.start])  # the rest did train
    assert len({tuple(state[PERSONAL].tolist()) for state in states.values()}) == 3


def test_a_new_clients_personal_head_is_a_copy_of_the_initial_generic_head():
    entry = ALGORITHMS.get("fedrod")
    model = entry.obj.prepare_model(entry.params(), hidden_model())
    assert torch.equal(model.personal_head.weight, model.head.weight)
    assert torch.equal(model.personal_head.bias, model.head.bias)
    assert model.personal_head.weight.data_ptr() != model.head.weight.data_ptr()


# ------------------------------------------------------------------------------------------- personalised model
@pytest.mark.parametrize("bias", [True, False])  # FedNH's cnn drops the head bias, and then so does the P-head
def test_personalised_logits_are_generic_plus_personal_logits(bias):
    algo, model, flat = make_fedrod(lambda: identity_model(bias))
    s = algo.slices()
    g = torch.Generator().manual_seed(2)
    own = torch.randn(D * C + C * bias, generator=g)
    x = torch.randn(6, D, generator=g)
    ctx = context(algo, model, flat, 1, ClientData(x, torch.zeros(6, dtype=torch.long), C), {PERSONAL: own})
    w = algo.global_params
    Wg, bg = w[s["head.weight"]].view(C, D), w[s["head.bias"]] if bias else torch.zeros(C)
    Wp, bp = own[: D * C].view(C, D), own[D * C :] if bias else torch.zeros(C)

    flat.set_params(algo.personalize(ctx))
    with torch.no_grad():
        torch.testing.assert_close(model(x), (x @ Wg.T + bg) + (x @ Wp.T + bp))
        flat.set_params(w)
        torch.testing.assert_close(model(x), x @ Wg.T + bg)  # the global model: body + G-head only
    assert algo.personalize(context(algo, model, flat, 1, ctx.data, {})) is None  # never trained: none


def test_hyper_personalised_logits_use_the_global_hypernetwork_on_the_label_distribution():
    algo, model, flat = make_fedrod(identity_model, personal_head="hyper")
    s = algo.slices()
    y = torch.tensor([0, 0, 0, 2])  # distribution (3/4, 0, 1/4)
    x = torch.randn(4, D, generator=torch.Generator().manual_seed(4))
    ctx = context(algo, model, flat, 1, ClientData(x, y, C), {})
    w = algo.global_params
    inner = parts(w, s, PERSONAL + ".inner.")
    outer = parts(w, s, PERSONAL + ".outer.")
    d = torch.tensor([0.75, 0.0, 0.25])
    hidden = (inner["weight"].view(D, C) @ d + inner["bias"]).clamp(min=0)
    generated = (outer["weight"].view(D * C, D) @ hidden + outer["bias"]).view(D, C)  # FedNH: z @ H
    Wg, bg = w[s["head.weight"]].view(C, D), w[s["head.bias"]]

    flat.set_params(algo.personalize(ctx))
    with torch.no_grad():
        torch.testing.assert_close(model(x), x @ Wg.T + bg + x @ generated)
    assert algo.personalize(context(algo, model, flat, 1, ctx.data, {})) is not None  # no client state needed


# ------------------------------------------------------------------------------------------- end to end
def rod_config(tiny_config, name, **algo):
    return tiny_config(
        run={"name": name, "rounds": 5},
        partition={"local_test_fraction": 0.2},
        algorithm={"name": "fedrod", **algo},
    )


def test_fedrod_learns_both_models_and_resumes_bit_exact(tiny_config, kill_and_resume):
    full, resumed = kill_and_resume(lambda name: rod_config(tiny_config, name))
    records = read_metrics(full.run_dir / "metrics.jsonl")
    final = records[-1]
    assert final["test_acc"] > 0.7, final  # 10 classes: chance is 0.1
    assert final["personal_acc_micro"] > 0.75 and final["personal_clients"] == len(full.seen), final
    keys = ("round", "test_acc", "test_loss", "train_loss", "personal_acc_micro", "personal_acc_macro")
    assert [{k: r[k] for k in keys} for r in records] == [
        {k: r[k] for k in keys} for r in read_metrics(resumed.run_dir / "metrics.jsonl")
    ]
    torch.testing.assert_close(full.algo.global_params, resumed.algo.global_params, rtol=0, atol=0)
    for cid, state in full.executor.store.items():
        torch.testing.assert_close(state[PERSONAL], resumed.executor.store.get(cid)[PERSONAL], rtol=0, atol=0)


def test_the_personal_head_variant_never_changes_the_global_model(tiny_config):
    """P reads detached features and logits, so body and G-head train identically whatever P is."""
    from fedhet.engine.simulation import Simulation

    runs = {head: Simulation(rod_config(tiny_config, head, personal_head=head)) for head in ("linear", "hyper")}
    finals = {head: sim.run()["final"] for head, sim in runs.items()}
    assert finals["hyper"]["test_acc"] == finals["linear"]["test_acc"]
    assert finals["hyper"]["personal_acc_micro"] > 0.5, finals["hyper"]
    generic = {head: sim.algo.global_params[: sim.algo.slices()[PERSONAL].start] for head, sim in runs.items()}
    assert torch.equal(generic["linear"], generic["hyper"])

"""MOON: contrastive loss against a naive reference, the first participation, the model pool, μ = 0, learning."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fedhet.algorithms import ALGORITHMS, Setup
from fedhet.algorithms.base import ClientContext, ClientData
from fedhet.algorithms.moon import moon_contrastive_loss
from fedhet.algorithms.server_opt import ServerOptimizer, SgdParams
from fedhet.config import TrainSection
from fedhet.engine.simulation import Simulation
from fedhet.errors import ConfigError
from fedhet.results.store import read_metrics
from fedhet.toolkit.flat import FlatModel


def naive_loss(z, z_pos, z_negs, tau):
    def cos(a, b):
        return float(a @ b) / (math.sqrt(float(a @ a)) * math.sqrt(float(b @ b)))

    total = 0.0
    for i in range(len(z)):
        pos = math.exp(cos(z[i], z_pos[i]) / tau)
        negs = sum(math.exp(cos(z[i], n[i]) / tau) for n in z_negs)
        total += -math.log(pos / (pos + negs))
    return total / len(z)


@pytest.mark.parametrize("pool", [1, 2])
def test_contrastive_loss_matches_a_naive_loop(pool):
    g = torch.Generator().manual_seed(pool)
    z, z_pos = torch.randn(5, 7, generator=g), torch.randn(5, 7, generator=g)
    z_negs = [torch.randn(5, 7, generator=g) for _ in range(pool)]
    got = moon_contrastive_loss(z, z_pos, z_negs, 0.5)
    assert got.item() == pytest.approx(naive_loss(z, z_pos, z_negs, 0.5), rel=1e-5)


def test_contrastive_loss_is_stable_at_small_temperature():
    z = torch.randn(4, 3)
    loss = moon_contrastive_loss(z, z, [-z], 0.001)  # e^{1/τ} overflows float32; log-sum-exp does not
    assert torch.isfinite(loss) and loss.item() == pytest.approx(0.0, abs=1e-6)


def make_moon(**params):
    entry = ALGORITHMS.get("moon")
    cfg = entry.params(projection_dim=6, **params)

    def build():
        from fedhet.models import build_model

        return entry.obj.prepare_model(cfg, build_model("mlp", (4,), 3, hidden=[5]))

    setup = Setup(1, 3, TrainSection(batch_size=8, local_steps=2, lr=0.1), build)
    # server lr 0.5: with one client and lr 1 the new global model would equal the client's previous model
    algo = entry.obj(cfg, setup, ServerOptimizer(SgdParams(lr=0.5)))
    torch.manual_seed(0)
    model = build()
    flat = FlatModel(model)
    algo.init_server(flat.get_params(), flat.get_buffers())
    return algo, model, flat


def client_round(algo, model, flat, state, rnd, x, y):
    ctx = ClientContext(
        0, rnd, "train", algo.configure(rnd, [0], "train")[0], ClientData(x, y, 3), state, model, flat,
        algo.setup.train, torch.Generator().manual_seed(rnd),
    )  # fmt: skip
    reply = algo.client_update(ctx)
    algo.aggregate(rnd, {0: reply}, "train")
    return ctx, reply


def test_first_participation_has_no_contrastive_term_and_the_pool_rotates():
    algo, model, flat = make_moon(mu=1.0, pool_size=2)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    state: dict[str, torch.Tensor] = {}
    replies = []
    for rnd in (1, 2, 3):
        sent = algo.global_params.clone()
        ctx, reply = client_round(algo, model, flat, state, rnd, x, y)
        replies.append(reply.tensors["params"])
        flat.set_params(sent)
        ce = F.cross_entropy(model(x), y)
        if rnd == 1:
            assert algo.loss_inputs(ctx) == {}
            assert algo.local_loss(ctx, x, y).item() == ce.item()
        else:
            assert algo.local_loss(ctx, x, y).item() > ce.item() + 1e-4
        pool = state["prev_params"]
        assert len(pool) == min(rnd, 2) and state["prev_buffers"].shape == (len(pool), 0)
        torch.testing.assert_close(pool, torch.stack(replies[-2:]))  # oldest first; round 1's drops out at 3


def test_contrastive_term_uses_the_global_and_previous_models():
    algo, model, flat = make_moon(mu=2.0, temperature=0.7)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    state: dict[str, torch.Tensor] = {}
    client_round(algo, model, flat, state, 1, x, y)
    previous = state["prev_params"][0].clone()
    ctx, _ = client_round(algo, model, flat, state, 2, x, y)  # ctx still holds round 2's message and models
    w = torch.randn(flat.num_params)
    flat.set_params(w)
    project = [algo.setup.build_model().eval() for _ in range(2)]
    FlatModel(project[0]).set_params(ctx.global_params)
    FlatModel(project[1]).set_params(previous)
    with torch.no_grad():
        z_glob, z_prev = (m.projector(m.body(x)) for m in project)
        z = model.projector(model.body(x))
    expected = F.cross_entropy(model(x), y).item() + 2.0 * naive_loss(z, z_glob, [z_prev], 0.7)
    assert algo.local_loss(ctx, x, y).item() == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("mu", [0.0, 1.0])
def test_projector_gets_gradient_only_from_the_contrastive_term(mu):
    algo, model, flat = make_moon(mu=mu)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    state: dict[str, torch.Tensor] = {}
    client_round(algo, model, flat, state, 1, x, y)
    ctx, _ = client_round(algo, model, flat, state, 2, x, y)
    flat.zero_grad()
    algo.local_loss(ctx, x, y).backward()
    proj = flat.slices()
    proj_grad = torch.cat([flat.grad[s] for name, s in proj.items() if name.startswith("projector.")])
    assert (proj_grad.abs().sum() > 0) == (mu > 0)


def test_mu_zero_is_fedavg_with_an_untouched_projector(tiny_config):
    moon = Simulation(tiny_config(run={"name": "moon", "rounds": 2}, algorithm={"name": "moon", "mu": 0.0}))
    avg = Simulation(tiny_config(run={"name": "avg", "rounds": 2}, algorithm={"name": "fedavg"}))
    init = moon.algo.global_params.clone()
    moon.run(), avg.run()
    added = set(moon.flat.slices()) - set(avg.flat.slices())
    assert added and all(name.startswith("projector.") for name in added)
    n = avg.algo.global_params.numel()  # the projector's parameters come after the body's and the head's
    torch.testing.assert_close(moon.algo.global_params[:n], avg.algo.global_params)
    # allclose, not equal: averaging identical projectors with weights that sum to 1 only up to rounding
    torch.testing.assert_close(moon.algo.global_params[n:], init[n:])


def test_moon_learns_on_digits_and_resumes_bit_exact(tiny_config, kill_and_resume):
    algo = {"name": "moon", "mu": 1.0, "pool_size": 2}
    full, resumed = kill_and_resume(
        lambda name: tiny_config(run={"name": name, "rounds": 5}, train={"participation": 1.0}, algorithm=algo)
    )
    final = read_metrics(full.run_dir / "metrics.jsonl")[-1]
    assert final["test_acc"] > 0.8, final
    assert [r["test_acc"] for r in read_metrics(full.run_dir / "metrics.jsonl")] == [
        r["test_acc"] for r in read_metrics(resumed.run_dir / "metrics.jsonl")
    ]
    torch.testing.assert_close(full.algo.global_params, resumed.algo.global_params, rtol=0, atol=0)


def test_without_projector_the_representations_are_contrasted():
    algo, model, flat = make_moon(mu=1.5, temperature=0.5, projection_layers=0)
    assert not any(name.startswith("projector.") for name in flat.slices())
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    state: dict[str, torch.Tensor] = {}
    client_round(algo, model, flat, state, 1, x, y)
    previous = state["prev_params"][0].clone()
    ctx, _ = client_round(algo, model, flat, state, 2, x, y)
    reference = [algo.setup.build_model().eval() for _ in range(2)]
    FlatModel(reference[0]).set_params(ctx.global_params)
    FlatModel(reference[1]).set_params(previous)
    with torch.no_grad():
        z_glob, z_prev = (m.body(x) for m in reference)
        z = model.body(x)
    expected = F.cross_entropy(model(x), y).item() + 1.5 * naive_loss(z, z_glob, [z_prev], 0.5)
    assert algo.local_loss(ctx, x, y).item() == pytest.approx(expected, rel=1e-5)


def test_official_architecture_puts_the_classifier_on_the_projection():
    algo, model, flat = make_moon(classifier="projection", projection_layers=2)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters() if name.startswith("head.")}
    # ModelFedCon: l1 = Linear(f, f), l2 = Linear(f, out_dim), l3 = Linear(out_dim, C); f = 5, out_dim = 6, C = 3
    assert shapes == {
        "head.projector.0.weight": (5, 5),
        "head.projector.0.bias": (5,),
        "head.projector.2.weight": (6, 5),
        "head.projector.2.bias": (6,),
        "head.classifier.weight": (3, 6),
        "head.classifier.bias": (3,),
    }
    assert not hasattr(model, "projector")
    x = torch.randn(8, 4)
    h = model.body(x)
    l1, l2, l3 = model.head.projector[0], model.head.projector[2], model.head.classifier
    torch.testing.assert_close(model(x), l3(l2(F.relu(l1(h)))))  # what the engine evaluates
    assert model.head.projector(h).shape == (8, 6)


def test_official_architecture_contrasts_the_projection_its_classifier_reads():
    algo, model, flat = make_moon(mu=2.0, temperature=0.7, classifier="projection")
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    state: dict[str, torch.Tensor] = {}
    client_round(algo, model, flat, state, 1, x, y)
    previous = state["prev_params"][0].clone()
    ctx, _ = client_round(algo, model, flat, state, 2, x, y)
    flat.set_params(torch.randn(flat.num_params))
    reference = [algo.setup.build_model().eval() for _ in range(2)]
    FlatModel(reference[0]).set_params(ctx.global_params)
    FlatModel(reference[1]).set_params(previous)
    with torch.no_grad():
        z_glob, z_prev = (m.head.projector(m.body(x)) for m in reference)
        z = model.head.projector(model.body(x))
    ce = F.cross_entropy(model.head.classifier(z), y).item()
    assert ce == pytest.approx(F.cross_entropy(model(x), y).item())
    expected = ce + 2.0 * naive_loss(z, z_glob, [z_prev], 0.7)
    assert algo.local_loss(ctx, x, y).item() == pytest.approx(expected, rel=1e-5)


def test_official_architecture_needs_a_projector():
    with pytest.raises(ConfigError, match="classifier 'projection' needs projection_layers >= 1"):
        ALGORITHMS.parse("moon", {"classifier": "projection", "projection_layers": 0})
    with pytest.raises(ConfigError, match="embedding.*projection"):
        ALGORITHMS.parse("moon", {"classifier": "l3"})


def test_official_architecture_learns_on_digits(tiny_config):
    algo = {"name": "moon", "mu": 1.0, "classifier": "projection", "projection_dim": 32}
    # the deeper head (three layers on the representation) starts slower: 0.22 after round 1, 0.87 after round 10
    cfg = tiny_config(run={"rounds": 10}, train={"participation": 1.0}, algorithm=algo)
    summary = Simulation(cfg).run()
    assert summary["final"]["test_acc"] > 0.8, summary["final"]

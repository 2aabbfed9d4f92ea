"""FedDyn: local gradient, client gradient state, server h, the α = 0 limit, learning and resume."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fedhet.algorithms import ALGORITHMS, Reply, Setup
from fedhet.algorithms.base import ClientContext, ClientData
from fedhet.config import TrainSection
from fedhet.engine.simulation import Simulation
from fedhet.models import build_model
from fedhet.results.store import read_metrics
from fedhet.toolkit.flat import FlatModel


def make_feddyn(num_clients: int = 1, **params):
    setup = Setup(num_clients, 3, TrainSection(), lambda: build_model("logreg", (4,), 3))
    entry = ALGORITHMS.get("feddyn")
    return entry.obj(entry.params(**params), setup)


def make_ctx(train: TrainSection, n: int = 8, **params):
    torch.manual_seed(0)
    model = build_model("logreg", (4,), 3)
    flat = FlatModel(model)
    x, y = torch.randn(n, 4), torch.randint(0, 3, (n,))
    algo = make_feddyn(**params)
    w_global = torch.randn(flat.num_params)
    algo.init_server(w_global, flat.get_buffers())
    msg = algo.configure(1, [0], "train")[0]
    ctx = ClientContext(0, 1, "train", msg, ClientData(x, y, 3), {}, model, flat, train, torch.Generator())
    return algo, ctx, w_global


def ce_grad(ctx: ClientContext) -> torch.Tensor:
    ctx.flat.zero_grad()
    F.cross_entropy(ctx.model(ctx.data.x), ctx.data.y).backward()
    return ctx.flat.grad.clone()


def test_local_gradient_is_ce_minus_grad_state_plus_alpha_distance():
    algo, ctx, w_global = make_ctx(TrainSection(batch_size=8, local_steps=1), alpha=0.5)
    g_state = torch.randn_like(w_global)
    ctx.state["grad_state"] = g_state.clone()
    algo.before_local(ctx)
    w = w_global + torch.randn_like(w_global)
    ctx.flat.set_params(w)
    g = ce_grad(ctx)
    algo.after_backward(ctx)
    expected = g - g_state + 0.5 * (w - w_global)
    torch.testing.assert_close(ctx.flat.grad, expected)
    # the same through autograd on the written-out objective L(θ) − ⟨g_state, θ⟩ + α/2 ‖θ − θ_g‖²
    params = list(ctx.model.parameters())
    theta = torch.cat([p.reshape(-1) for p in params])
    loss = F.cross_entropy(ctx.model(ctx.data.x), ctx.data.y) - g_state @ theta + 0.25 * (theta - w_global).pow(2).sum()
    grads = torch.autograd.grad(loss, params)
    torch.testing.assert_close(torch.cat([q.reshape(-1) for q in grads]), expected)


def test_grad_state_starts_at_zero_and_follows_its_update():
    train = TrainSection(batch_size=8, local_steps=2, lr=0.1)
    algo, ctx, w_global = make_ctx(train, alpha=0.3)
    reply = algo.client_update(ctx)
    theta = reply.tensors["params"]
    torch.testing.assert_close(ctx.state["grad_state"], -0.3 * (theta - w_global))
    # a second round from the stored state: g ← g − α (θ_k − θ_g)
    before = ctx.state["grad_state"].clone()
    ctx.steps = 0
    reply = algo.client_update(ctx)
    torch.testing.assert_close(ctx.state["grad_state"], before - 0.3 * (reply.tensors["params"] - w_global))


def test_data_size_scaling_uses_the_servers_mean_size():
    algo, ctx, _ = make_ctx(TrainSection(), n=8, alpha=0.3, alpha_scaling="data_size")
    assert "mean_size" not in ctx.message.scalars  # nothing reported yet: weight 1
    assert algo.client_alpha(ctx) == 0.3
    algo.aggregate(1, {0: Reply({"params": algo.global_params.clone()}, num_examples=16)}, "train")
    ctx.message = algo.configure(2, [0], "train")[0]
    assert ctx.message.scalars["mean_size"] == 16
    torch.testing.assert_close(algo.client_alpha(ctx), 0.3 * 16 / 8)  # α / (n_k / n̄) with n_k = 8


def test_server_h_and_model_follow_the_formulas():
    alpha, m = 0.1, 4
    algo = make_feddyn(num_clients=m, alpha=alpha)
    x0 = torch.tensor([1.0, -1.0, 0.5])
    algo.init_server(x0, torch.zeros(0))
    a, b = torch.tensor([2.0, 0.0, 0.5]), torch.tensor([0.0, -3.0, 1.5])
    algo.aggregate(1, {0: Reply({"params": a}, num_examples=5), 1: Reply({"params": b}, num_examples=50)}, "train")
    h1 = -alpha / m * ((a - x0) + (b - x0))
    x1 = (a + b) / 2 - h1 / alpha  # uniform mean, whatever the sizes
    torch.testing.assert_close(algo.h, h1)
    torch.testing.assert_close(algo.global_params, x1)
    c = torch.tensor([1.0, 1.0, 1.0])
    algo.aggregate(2, {3: Reply({"params": c}, num_examples=5)}, "train")
    h2 = h1 - alpha / m * (c - x1)
    torch.testing.assert_close(algo.h, h2)
    torch.testing.assert_close(algo.global_params, c - h2 / alpha)
    restored = make_feddyn(num_clients=m, alpha=alpha)
    restored.init_server(x0, torch.zeros(0))
    restored.load_state_dict(algo.state_dict())
    torch.testing.assert_close(restored.h, h2)
    assert restored.client_sizes == {0: 5, 1: 50, 3: 5}


def test_alpha_zero_is_uniform_fedavg(tiny_config):
    dyn = Simulation(tiny_config(run={"name": "dyn", "rounds": 2}, algorithm={"name": "feddyn", "alpha": 0.0}))
    avg = Simulation(
        tiny_config(run={"name": "avg", "rounds": 2}, algorithm={"name": "fedavg", "weighting": "uniform"})
    )
    dyn.run(), avg.run()
    torch.testing.assert_close(dyn.algo.global_params, avg.algo.global_params)


def test_feddyn_learns_on_digits(tiny_config):
    cfg = tiny_config(run={"rounds": 8}, train={"participation": 1.0}, algorithm={"name": "feddyn", "alpha": 0.01})
    summary = Simulation(cfg).run()
    assert summary["final"]["test_acc"] > 0.8, summary["final"]


def test_feddyn_kill_and_resume_is_bit_exact(tiny_config, kill_and_resume):
    algo = {"name": "feddyn", "alpha": 0.1, "alpha_scaling": "data_size"}
    full, resumed = kill_and_resume(lambda name: tiny_config(run={"name": name, "rounds": 4}, algorithm=algo))
    assert (
        read_metrics(full.run_dir / "metrics.jsonl")[-1]["test_acc"]
        == (read_metrics(resumed.run_dir / "metrics.jsonl")[-1]["test_acc"])
    )
    torch.testing.assert_close(full.algo.global_params, resumed.algo.global_params, rtol=0, atol=0)
    torch.testing.assert_close(full.algo.h, resumed.algo.h, rtol=0, atol=0)
    for cid, state in full.executor.store.items():
        torch.testing.assert_close(
            state["grad_state"], dict(resumed.executor.store.items())[cid]["grad_state"], rtol=0, atol=0
        )


def test_average_evaluation_reports_the_client_mean_and_broadcasts_the_server_model():
    alpha, m = 0.1, 4
    algo = make_feddyn(num_clients=m, alpha=alpha, evaluate="average")
    x0 = torch.tensor([1.0, -1.0, 0.5])
    algo.init_server(x0, torch.zeros(0))
    a, b = torch.tensor([2.0, 0.0, 0.5]), torch.tensor([0.0, -3.0, 1.5])
    algo.aggregate(1, {0: Reply({"params": a}, num_examples=5), 1: Reply({"params": b}, num_examples=50)}, "train")
    h1 = -alpha / m * ((a - x0) + (b - x0))
    server = (a + b) / 2 - h1 / alpha
    torch.testing.assert_close(algo.global_params, (a + b) / 2)  # what the engine evaluates and checkpoints
    torch.testing.assert_close(algo.configure(2, [2], "train")[2].tensors["params"], server)  # what clients get
    c = torch.tensor([1.0, 1.0, 1.0])
    algo.aggregate(2, {3: Reply({"params": c}, num_examples=5)}, "train")
    h2 = h1 - alpha / m * (c - server)  # the drift is measured from the broadcast model, not the reported one
    torch.testing.assert_close(algo.h, h2)
    torch.testing.assert_close(algo.global_params, c)
    extra = algo.extra_eval_params()
    torch.testing.assert_close(extra["feddyn_server"], c - h2 / alpha)
    torch.testing.assert_close(extra["feddyn_average"], c)
    restored = make_feddyn(num_clients=m, alpha=alpha, evaluate="average")
    restored.init_server(x0, torch.zeros(0))
    restored.load_state_dict(algo.state_dict())
    torch.testing.assert_close(restored.configure(3, [0], "train")[0].tensors["params"], c - h2 / alpha)


def test_both_models_are_scored_every_evaluation_and_the_choice_picks_test_acc(tiny_config):
    runs = {}
    for evaluate in ("server", "average"):
        algo = {"name": "feddyn", "alpha": 0.1, "evaluate": evaluate}
        sim = Simulation(tiny_config(run={"name": evaluate, "rounds": 3}, algorithm=algo))
        sim.run()
        runs[evaluate] = read_metrics(sim.run_dir / "metrics.jsonl")
    for server_rec, average_rec in zip(runs["server"], runs["average"], strict=True):
        for rec in (server_rec, average_rec):
            assert {"feddyn_server_acc", "feddyn_server_loss", "feddyn_average_acc", "feddyn_average_loss"} <= set(rec)
        # the training is the same either way; only which model test_acc reports differs
        assert server_rec["feddyn_server_acc"] == average_rec["feddyn_server_acc"]
        assert server_rec["feddyn_average_acc"] == average_rec["feddyn_average_acc"]
        assert server_rec["test_acc"] == server_rec["feddyn_server_acc"]
        assert average_rec["test_acc"] == average_rec["feddyn_average_acc"]
        assert average_rec["test_loss"] == average_rec["feddyn_average_loss"]
    assert any(r["feddyn_server_acc"] != r["feddyn_average_acc"] for r in runs["server"])


def test_average_evaluation_kill_and_resume_is_bit_exact(tiny_config, kill_and_resume):
    algo = {"name": "feddyn", "alpha": 0.1, "evaluate": "average"}
    full, resumed = kill_and_resume(lambda name: tiny_config(run={"name": name, "rounds": 4}, algorithm=algo))
    assert (
        read_metrics(full.run_dir / "metrics.jsonl")[-1]["feddyn_server_acc"]
        == (read_metrics(resumed.run_dir / "metrics.jsonl")[-1]["feddyn_server_acc"])
    )
    torch.testing.assert_close(full.algo.server_params, resumed.algo.server_params, rtol=0, atol=0)
    torch.testing.assert_close(full.algo.global_params, resumed.algo.global_params, rtol=0, atol=0)

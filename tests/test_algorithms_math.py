"""Hand-computed checks of FedAvg, FedProx and the server optimisers."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fedhet.algorithms import ALGORITHMS, Message, Reply, Setup
from fedhet.algorithms.base import ClientContext, ClientData
from fedhet.algorithms.server_opt import AdaptiveParams, AvgMParams, FedAdam, FedAvgM, FedYogi
from fedhet.config import TrainSection
from fedhet.models import build_model
from fedhet.toolkit.flat import FlatModel


def make_ctx(algo_name: str, train: TrainSection, n: int = 8, seed: int = 0, **algo_params):
    torch.manual_seed(seed)
    model = build_model("logreg", (4,), 3)
    flat = FlatModel(model)
    x, y = torch.randn(n, 4), torch.randint(0, 3, (n,))
    setup = Setup(num_clients=1, num_classes=3, train=train, build_model=lambda: build_model("logreg", (4,), 3))
    entry = ALGORITHMS.get(algo_name)
    algo = entry.obj(entry.params(**algo_params), setup)
    w_global = torch.randn(flat.num_params)
    algo.init_server(w_global, flat.get_buffers())
    msg = algo.configure(1, [0], "train")[0]
    ctx = ClientContext(
        cid=0,
        round=1,
        phase="train",
        message=msg,
        data=ClientData(x, y, 3),
        state={},
        model=model,
        flat=flat,
        train=train,
        generator=torch.Generator().manual_seed(1),
    )
    return algo, ctx, x, y, w_global


def ce_grad(model, flat, x, y) -> torch.Tensor:
    flat.zero_grad()
    F.cross_entropy(model(x), y).backward()
    return flat.grad.clone()


def test_fedavg_one_client_one_full_batch_step_is_one_sgd_step():
    train = TrainSection(batch_size=8, local_steps=1, lr=0.1)
    algo, ctx, x, y, w_global = make_ctx("fedavg", train)
    reply = algo.client_update(ctx)
    ctx.flat.set_params(w_global)
    expected = w_global - 0.1 * ce_grad(ctx.model, ctx.flat, x, y)
    torch.testing.assert_close(reply.tensors["params"], expected)
    algo.aggregate(1, {0: reply}, "train")
    torch.testing.assert_close(algo.global_params, expected)


def test_fedprox_gradient_is_ce_gradient_plus_mu_times_distance():
    train = TrainSection(batch_size=8, local_steps=1, lr=0.1)
    algo, ctx, x, y, w_global = make_ctx("fedprox", train, mu=0.5)
    w = w_global + torch.randn_like(w_global)  # away from the global model so the term is non-zero
    ctx.flat.set_params(w)
    g = ce_grad(ctx.model, ctx.flat, x, y)
    algo.after_backward(ctx)
    torch.testing.assert_close(ctx.flat.grad, g + 0.5 * (w - w_global))
    # and the same through autograd on the written-out objective f(w) + mu/2 ||w - w_g||^2
    params = list(ctx.model.parameters())
    w_vec = torch.cat([p.reshape(-1) for p in params])  # differentiable, unlike the flat storage view
    loss = F.cross_entropy(ctx.model(x), y) + 0.25 * (w_vec - w_global).pow(2).sum()
    grads = torch.autograd.grad(loss, params)
    torch.testing.assert_close(torch.cat([q.reshape(-1) for q in grads]), g + 0.5 * (w - w_global))


def test_fedavg_weighting_samples_vs_uniform():
    train = TrainSection()
    for weighting, expected in (("samples", [0.25, 0.75]), ("uniform", [0.5, 0.5])):
        algo, *_ = make_ctx("fedavg", train, weighting=weighting)
        replies = {0: Reply(num_examples=10), 1: Reply(num_examples=30)}
        assert algo.aggregation_weights(replies) == expected


def test_fedavg_aggregate_is_weighted_mean():
    train = TrainSection()
    algo, *_ = make_ctx("fedavg", train)
    a, b = torch.ones(algo.global_params.numel()), 3 * torch.ones(algo.global_params.numel())
    algo.aggregate(1, {0: Reply({"params": a}, num_examples=1), 1: Reply({"params": b}, num_examples=3)}, "train")
    torch.testing.assert_close(algo.global_params, torch.full_like(a, 2.5))


def test_fedadam_matches_hand_computation():
    p = AdaptiveParams(lr=0.1, beta1=0.9, beta2=0.99, tau=0.01)
    opt = FedAdam(p)
    x = torch.tensor([1.0, -2.0])
    opt.init(x)
    # round 1: delta = target - x
    d1 = torch.tensor([0.5, -0.1])
    m1 = 0.1 * d1
    v1 = 0.99 * 0.01**2 + 0.01 * d1**2
    x1 = x + 0.1 * m1 / (v1.sqrt() + 0.01)
    got1 = opt.step(x, x + d1)
    torch.testing.assert_close(got1, x1)
    # round 2 uses the moments of round 1
    d2 = torch.tensor([-0.2, 0.3])
    m2 = 0.9 * m1 + 0.1 * d2
    v2 = 0.99 * v1 + 0.01 * d2**2
    torch.testing.assert_close(opt.step(got1, got1 + d2), x1 + 0.1 * m2 / (v2.sqrt() + 0.01))


def test_fedyogi_second_moment_uses_sign():
    opt = FedYogi(AdaptiveParams(lr=1.0, beta1=0.0, beta2=0.5, tau=1.0))
    x = torch.zeros(1)
    opt.init(x)
    d = torch.tensor([2.0])
    v = 1.0 - 0.5 * 4.0 * torch.sign(torch.tensor([1.0 - 4.0]))  # v0 = tau^2 = 1
    torch.testing.assert_close(opt.step(x, d), d / (v.sqrt() + 1.0))


def test_fedavgm_accumulates_momentum():
    opt = FedAvgM(AvgMParams(lr=1.0, momentum=0.5))
    x = torch.zeros(2)
    opt.init(x)
    x1 = opt.step(x, x + 1.0)  # v = 1
    torch.testing.assert_close(x1, torch.ones(2))
    x2 = opt.step(x1, x1 + 1.0)  # v = 0.5 * 1 + 1
    torch.testing.assert_close(x2, torch.full((2,), 2.5))


def test_momentum_and_weight_decay_follow_torch_sgd():
    """FlatSGD must take exactly the steps torch.optim.SGD takes."""
    from fedhet.toolkit.local import FlatSGD

    torch.manual_seed(0)
    model = build_model("mlp", (4,), 3, hidden=[5])
    ref = build_model("mlp", (4,), 3, hidden=[5])
    ref.load_state_dict(model.state_dict())
    flat = FlatModel(model)
    opt = FlatSGD(flat, lr=0.1, momentum=0.9, weight_decay=1e-2, nesterov=True)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-2, nesterov=True)
    step_both(model, flat, opt, ref, ref_opt, steps=3)
    torch.testing.assert_close(flat.params, torch.cat([p.detach().reshape(-1) for p in ref.parameters()]))


def test_message_is_not_mutated_by_local_training():
    train = TrainSection(batch_size=4, local_steps=3, lr=0.5)
    algo, ctx, *_ = make_ctx("fedprox", train, mu=0.1)
    before = ctx.message.tensors["params"].clone()
    algo.client_update(ctx)
    torch.testing.assert_close(ctx.message.tensors["params"], before)
    assert isinstance(ctx.message, Message)


def step_both(model, flat, opt, ref, ref_opt, steps: int) -> None:
    """``steps`` steps of a flat-vector optimiser on ``model`` and of its torch.optim twin on ``ref`` (a copy), on the
    same random batches of 6 four-feature samples with 3 classes."""
    for _ in range(steps):
        x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
        flat.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        ref_opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        ref_opt.step()

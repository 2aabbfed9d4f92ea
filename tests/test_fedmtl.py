"""FedMTL: the per-client message (own model, the other clients' Omega-weighted models, Omega_kk), the local steps
with the gradient of lam/2 tr(W Omega W^T) against hand computation and autograd, both Omega matrices, and
end-to-end learning with personalised accuracy that resumes bit for bit."""

from __future__ import annotations

import pytest
import torch
from quadratic import A, B, TwoParams, client_context, quadratic_loss

from fedhet.algorithms import Setup
from fedhet.algorithms.fedmtl import PERSONAL, FedMTL, FedMTLConfig, learned_omega, mean_omega
from fedhet.config import TrainSection
from fedhet.engine.simulation import Simulation
from fedhet.results.store import read_metrics

W0 = torch.tensor([[2.0, 1.0], [0.0, -1.0], [1.0, 3.0]])  # three clients' models, one per row (W^T)


class QuadraticFedMTL(FedMTL):
    def local_loss(self, ctx, x, y):
        return quadratic_loss(ctx.model)


def make(lam=0.5, omega="mean", lr=0.1, steps=2, momentum=0.0):
    train = TrainSection(batch_size=2, local_steps=steps, lr=lr, momentum=momentum)
    algo = QuadraticFedMTL(
        FedMTLConfig(lam=lam, omega=omega), Setup(3, num_classes=3, train=train, build_model=TwoParams)
    )
    algo.init_server(torch.zeros(2), torch.zeros(0))
    algo.models = W0.clone()
    return algo, train


def test_mean_omega_is_the_centring_matrix():
    m = 3
    expected = [[2 / 3, -1 / 3, -1 / 3], [-1 / 3, 2 / 3, -1 / 3], [-1 / 3, -1 / 3, 2 / 3]]
    torch.testing.assert_close(mean_omega(m), torch.tensor(expected, dtype=torch.float64))


def test_each_client_gets_its_own_model_and_the_others_weighted_by_omega():
    algo, _ = make()
    msgs = algo.configure(1, [0, 2], "train")
    # Omega = I - 11^T/3: Omega_kk = 2/3 and n_k = -(sum of the other two models)/3
    torch.testing.assert_close(msgs[0].tensors["params"], W0[0])
    torch.testing.assert_close(msgs[0].tensors["neighbours"], -(W0[1] + W0[2]) / 3)
    torch.testing.assert_close(msgs[2].tensors["neighbours"], -(W0[0] + W0[1]) / 3)
    assert msgs[0].scalars["omega_self"] == pytest.approx(2 / 3)
    assert 1 not in msgs


@pytest.mark.parametrize("momentum", [0.0, 0.5])
def test_local_steps_match_hand_computation(momentum):
    lam, lr = 0.5, 0.1
    algo, train = make(lam=lam, lr=lr, momentum=momentum)
    ctx = client_context(algo.configure(1, [1], "train")[1], TwoParams(), train, cid=1)
    reply = algo.client_update(ctx)

    w, buf = W0[1].clone(), None
    for _ in range(2):
        # lam (w_1 - mean of (W0[0], w_1, W0[2])): the pull toward the average with the current w_1 in it
        g = A * (w - B) + lam * (w - (W0[0] + w + W0[2]) / 3)
        buf = g if buf is None else momentum * buf + g
        w = w - lr * buf
    torch.testing.assert_close(reply.tensors["params"], w)
    torch.testing.assert_close(ctx.state[PERSONAL], w)
    torch.testing.assert_close(algo.personalize(ctx), w)

    algo.aggregate(1, {1: reply}, "train")
    expected = W0.clone()
    expected[1] = w
    torch.testing.assert_close(algo.models, expected)
    torch.testing.assert_close(algo.global_params, expected.mean(dim=0))


@pytest.mark.parametrize("omega", ["mean", "learned"])
def test_the_added_gradient_is_the_gradient_of_the_trace_regulariser(omega):
    """lam/2 tr(W Omega W^T) differentiated by autograd in one column equals the term the client adds."""
    algo, train = make(lam=0.7, omega=omega, steps=1)
    if omega == "learned":  # any symmetric Omega will do; this one is well conditioned
        algo.omega = learned_omega(torch.randn(3, 5, generator=torch.Generator().manual_seed(0)))
    cid = 2
    ctx = client_context(algo.configure(1, [cid], "train")[cid], TwoParams(), train, cid=cid)
    ctx.flat.set_params(W0[cid])
    ctx.flat.zero_grad()
    algo.after_backward(ctx)

    col = W0[cid].clone().double().requires_grad_(True)
    W = torch.cat([W0[:cid].double(), col[None], W0[cid + 1 :].double()]).T  # P x m, columns are clients
    (0.7 / 2 * torch.trace(W @ algo.omega @ W.T)).backward()
    torch.testing.assert_close(ctx.flat.grad.double(), col.grad, rtol=1e-6, atol=1e-6)


def test_learned_omega_matches_hand_computation():
    # Orthogonal models: W^T W = diag(9, 16), its square root diag(3, 4), Sigma = diag(3, 4)/7, Omega = Sigma^-1.
    omega = learned_omega(torch.tensor([[3.0, 0.0], [0.0, 4.0]]))
    torch.testing.assert_close(omega, torch.diag(torch.tensor([7 / 3, 7 / 4], dtype=torch.float64)))
    # In general Sigma = Omega^-1 has trace 1 and (tr(sqrtm) Sigma)^2 = W^T W (full rank: no eigenvalue floored).
    models = torch.randn(3, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    sigma = torch.linalg.inv(learned_omega(models))
    torch.testing.assert_close(torch.trace(sigma).item(), 1.0)
    gram = models @ models.T
    root = sigma * torch.linalg.eigvalsh(gram).clamp_min(0).sqrt().sum()
    torch.testing.assert_close(root @ root, gram)


def test_identical_models_keep_the_learned_omega_finite():
    omega = learned_omega(torch.ones(4, 5))  # rank one: three eigenvalues are zero, floored
    assert torch.isfinite(omega).all()


def test_learned_omega_starts_at_m_times_identity_and_is_re_estimated_after_a_round():
    algo, train = make(omega="learned")
    torch.testing.assert_close(algo.omega, 3 * torch.eye(3, dtype=torch.float64))  # run_mocha.m: Sigma = I/m
    ctx = client_context(algo.configure(1, [0], "train")[0], TwoParams(), train)
    algo.aggregate(1, {0: algo.client_update(ctx)}, "train")
    torch.testing.assert_close(algo.omega, learned_omega(algo.models))


# ------------------------------------------------------------------------------------------- end to end
def mtl_config(tiny_config, name, **algo):
    return tiny_config(
        run={"name": name, "rounds": 5},
        partition={"local_test_fraction": 0.2},
        train={"participation": 1.0},  # FedRANE's protocol: every client every round
        algorithm={"name": "fedmtl", **algo},
    )


def test_fedmtl_learns_personal_models_and_resumes_bit_exact(tiny_config, kill_and_resume):
    full, resumed = kill_and_resume(lambda name: mtl_config(tiny_config, name))
    records = read_metrics(full.run_dir / "metrics.jsonl")
    final = records[-1]
    assert final["personal_acc_micro"] > 0.7 and final["personal_clients"] == len(full.seen), final  # chance 0.1
    keys = ("round", "test_acc", "train_loss", "personal_acc_micro", "personal_acc_macro", "model_spread")
    assert [{k: r[k] for k in keys} for r in records] == [
        {k: r[k] for k in keys} for r in read_metrics(resumed.run_dir / "metrics.jsonl")
    ]
    torch.testing.assert_close(full.algo.models, resumed.algo.models, rtol=0, atol=0)
    assert full.executor.store.items()
    for cid, state in full.executor.store.items():
        torch.testing.assert_close(state[PERSONAL], full.algo.models[cid], rtol=0, atol=0)  # server copy = client's
        torch.testing.assert_close(state[PERSONAL], resumed.executor.store.get(cid)[PERSONAL], rtol=0, atol=0)


def test_the_regulariser_pulls_the_personal_models_together(tiny_config):
    spreads = {}
    for lam in (0.0, 1.0):
        sim = Simulation(mtl_config(tiny_config, f"lam{lam}", lam=lam))
        spreads[lam] = sim.run()["final"]["model_spread"]
    assert spreads[1.0] < 0.8 * spreads[0.0], spreads


def test_learned_omega_learns(tiny_config):
    final = Simulation(mtl_config(tiny_config, "learned", omega="learned", lam=0.001)).run()["final"]
    assert final["personal_acc_micro"] > 0.7, final

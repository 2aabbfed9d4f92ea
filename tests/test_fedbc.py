"""FedBC: dual and gamma updates, lambda-weighted aggregation, its all-zero fallback, the FedProx equivalence,
personalised evaluation (plain, fine-tuned, leaky, Per-FedBC), diagnostics, resume and the power-law config."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from quadratic import A, B, TwoParams, client_context, quadratic_loss

from fedhet.algorithms import Reply, Setup
from fedhet.algorithms.base import ClientData
from fedhet.algorithms.fedbc import FedBC, FedBCConfig
from fedhet.algorithms.fedprox import FedProx, FedProxConfig
from fedhet.config import TrainSection, load_config
from fedhet.engine.simulation import Simulation, build_federation, resolve_config
from fedhet.models import build_model
from fedhet.results.report import group_runs, load_runs, summary_table, to_markdown
from fedhet.results.store import read_metrics
from fedhet.toolkit.flat import FlatModel

POWER_LAW = Path(__file__).parents[1] / "benchmarks" / "reproduce" / "fedbc" / "cifar10_powerlaw.toml"


class QuadraticFedBC(FedBC):
    """Task loss 1/2 sum_j A_j (w_j - B_j)^2, gradient A (w - B)."""

    def local_loss(self, ctx, x, y):
        return quadratic_loss(ctx.model)


def make_algo(num_clients=4, train=None, cls=FedBC, **cfg) -> FedBC:
    train = train or TrainSection(batch_size=4, local_steps=3, lr=0.1)
    setup = Setup(num_clients, num_classes=3, train=train, build_model=lambda: build_model("logreg", (4,), 3))
    return cls(FedBCConfig(**cfg), setup)


def make_ctx(cid, msg, model, train, state, data=None):
    return client_context(msg, model, train, data=data, state=state, cid=cid)


def test_dual_and_gamma_steps_match_hand_computation():
    algo = make_algo(dual_lr=0.1, gamma_lr=0.05)
    algo.lam[1], algo.gamma[1] = 0.2, 0.1
    algo.update_dual(1, sq_dist=0.5)
    assert float(algo.lam[1]) == pytest.approx(0.2 + 0.1 * (0.5 - 0.1))  # Eq. 11
    assert float(algo.gamma[1]) == pytest.approx(0.1 + 0.05 * 0.2)  # gamma += eta * lambda (lambda before the step)
    assert float(algo.lam[0]) == 0.0 and float(algo.gamma[0]) == 0.0  # other clients untouched

    algo.update_dual(1, sq_dist=0.0)  # violation < 0 drives lambda down, projected onto lambda_min = 0
    assert float(algo.lam[1]) == pytest.approx(max(0.0, 0.24 + 0.1 * (0.0 - 0.11)))
    fixed = make_algo(dual_lr=1.0, learn_gamma=False, gamma=0.3, lambda_min=0.05, lambda_max=0.5)
    fixed.update_dual(0, sq_dist=2.0)
    assert float(fixed.lam[0]) == 0.5 and float(fixed.gamma[0]) == 0.3  # clipped at lambda_max; gamma fixed
    fixed.update_dual(0, sq_dist=0.0)
    assert float(fixed.lam[0]) == pytest.approx(0.2)
    fixed.update_dual(0, sq_dist=0.0)
    assert float(fixed.lam[0]) == 0.05  # clipped at lambda_min


def test_dual_momentum_keeps_one_buffer_per_client():
    algo = make_algo(dual_lr=0.1, dual_momentum=0.5)
    algo.update_dual(0, 1.0)  # buf_lam = 1, buf_gamma = 0 (lambda was 0)
    algo.update_dual(2, 4.0)  # another client's step must not move client 0
    assert float(algo.lam[0]) == pytest.approx(0.1)
    algo.update_dual(0, 1.0)
    # gamma_0 = 0 still (its first buffer was lambda = 0), so g_lam = 1 and buf = 0.5 * 1 + 1
    assert float(algo.lam[0]) == pytest.approx(0.1 + 0.1 * 1.5)
    assert float(algo.gamma[0]) == pytest.approx(0.1 * (0.5 * 0.0 + 0.1))  # buf_gamma = 0.5 * 0 + lambda_before
    assert float(algo.lam[2]) == pytest.approx(0.4)


def test_aggregation_uses_the_new_lambdas_of_the_replied_clients():
    algo = make_algo(dual_lr=0.5)
    algo.init_server(torch.zeros(2), torch.zeros(0))
    algo.lam[0], algo.lam[1], algo.lam[3] = 0.2, 0.0, 9.0  # client 3 did not reply: its lambda plays no part
    x0, x1 = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0])
    replies = {
        0: Reply({"params": x0}, {"sq_dist": 1.0}, num_examples=5),
        1: Reply({"params": x1}, {"sq_dist": 4.0}, num_examples=50),
    }
    algo.aggregate(1, replies, "train")
    lam0, lam1 = 0.2 + 0.5 * 1.0, 0.0 + 0.5 * 4.0  # Eq. 11 first, then Eq. 13 with lambda^{t+1}
    torch.testing.assert_close(algo.global_params, (lam0 * x0 + lam1 * x1) / (lam0 + lam1))
    assert algo.uniform_fallbacks == 0


def test_all_zero_lambdas_fall_back_to_uniform_averaging_and_are_counted():
    algo = make_algo(learn_gamma=False, gamma=1.0)
    algo.init_server(torch.zeros(2), torch.zeros(0))
    replies = {  # ||x - z||^2 <= gamma: lambda stays at 0 for both, so Eq. 13 would be 0/0
        0: Reply({"params": torch.tensor([0.5, 0.0])}, {"sq_dist": 0.25}, num_examples=3),
        2: Reply({"params": torch.tensor([0.0, 0.5])}, {"sq_dist": 0.25}, num_examples=30),
    }
    algo.aggregate(1, replies, "train")
    torch.testing.assert_close(algo.global_params, torch.tensor([0.25, 0.25]))
    assert algo.uniform_fallbacks == 1 and algo.round_metrics(1)["uniform_fallbacks"] == 1


@pytest.mark.parametrize("warm", [False, True])
def test_client_steps_add_two_lambda_times_the_distance(warm):
    train = TrainSection(batch_size=4, local_steps=3, lr=0.1, momentum=0.5)
    algo = make_algo(train=train, cls=QuadraticFedBC, warm_start=warm)
    z, prev = torch.tensor([2.0, 1.0]), torch.tensor([0.0, -3.0])
    algo.init_server(z, torch.zeros(0))
    algo.lam[1] = 0.3
    msg = algo.configure(1, [1], "train")[1]
    assert msg.scalars["lambda"] == pytest.approx(0.3) and msg.scalars["gamma"] == 0.0
    ctx = make_ctx(1, msg, TwoParams(), train, {"local": prev.clone()})
    reply = algo.client_update(ctx)

    w, buf = (prev if warm else z).clone(), None
    for _ in range(3):
        g = A * (w - B) + 2 * 0.3 * (w - z)  # lambda (||w - z||^2 - gamma) has gradient 2 lambda (w - z)
        buf = g if buf is None else 0.5 * buf + g
        w = w - 0.1 * buf
    torch.testing.assert_close(reply.tensors["params"], w)
    assert reply.scalars["sq_dist"] == pytest.approx(float((w - z).square().sum()))
    torch.testing.assert_close(ctx.state["local"], w)
    torch.testing.assert_close(algo.personalize(ctx), w)  # FedBC's personalised model is x_i


def test_constant_lambda_half_mu_gives_fedprox_local_update():
    train = TrainSection(batch_size=8, local_steps=4, lr=0.1)
    setup = Setup(3, num_classes=3, train=train, build_model=lambda: build_model("logreg", (4,), 3))
    fedbc, fedprox = FedBC(FedBCConfig(), setup), FedProx(FedProxConfig(mu=0.6), setup)
    torch.manual_seed(0)
    z = torch.randn(FlatModel(build_model("logreg", (4,), 3)).num_params)
    data = ClientData(torch.randn(20, 4), torch.randint(0, 3, (20,)), 3)
    for algo in (fedbc, fedprox):
        algo.init_server(z, torch.zeros(0))
    fedbc.lam[0] = 0.3  # lambda = mu / 2 (notes/fedbc.md A7)
    out = [
        algo.client_update(
            make_ctx(0, algo.configure(1, [0], "train")[0], build_model("logreg", (4,), 3), train, {}, data)
        )
        for algo in (fedbc, fedprox)
    ]
    torch.testing.assert_close(out[0].tensors["params"], out[1].tensors["params"])


def test_round_metrics_report_weight_share_against_data_share():
    algo = make_algo(num_clients=3, dual_lr=1.0)
    algo.init_server(torch.zeros(2), torch.zeros(0))
    replies = {
        0: Reply({"params": torch.ones(2)}, {"sq_dist": 1.0}, num_examples=10),
        1: Reply({"params": torch.ones(2)}, {"sq_dist": 3.0}, num_examples=90),
    }
    algo.aggregate(1, replies, "train")
    m = algo.round_metrics(1)
    assert m["data_share_smallest"] == pytest.approx(0.1) and m["data_share_largest"] == pytest.approx(0.9)
    assert m["weight_share_smallest"] == pytest.approx(0.25) and m["weight_share_largest"] == pytest.approx(0.75)
    assert m["lambda_mean"] == pytest.approx(4.0 / 3) and m["gamma_mean"] == 0.0  # gamma used lambda = 0


def personal_config(tiny_config, algorithm, rounds=4):
    return tiny_config(
        run={"rounds": rounds, "name": algorithm["name"]},
        partition={"local_test_fraction": 0.2},
        algorithm=algorithm,
    )


def test_fedbc_learns_and_reports_personal_and_fairness_metrics(tiny_config):
    sim = Simulation(personal_config(tiny_config, {"name": "fedbc", "dual_lr": 0.01}, rounds=6))
    final = sim.run()["final"]
    assert final["test_acc"] > 0.8, final
    assert final["personal_acc_macro"] > 0.6 and 0 < final["personal_acc_micro"] <= 1
    assert final["personal_clients"] + final["personal_never_sampled"] == sim.fed.num_clients
    assert final["personal_clients"] == len(sim.seen)  # never-sampled clients are counted, not evaluated
    assert {"weight_share_smallest", "data_share_largest", "acc_smallest_client", "client_acc_std"} <= set(final)
    assert final["lambda_mean"] > 0 and final["uniform_fallbacks"] == 0


@pytest.mark.parametrize("leaky", [False, True])
def test_fedbc_finetune_marks_the_test_data_variant(tiny_config, leaky):
    sim = Simulation(personal_config(tiny_config, {"name": "fedbc_finetune", "leaky": leaky}, rounds=2))
    final = sim.run()["final"]
    honest, marked = ("personal_leaky", "personal") if leaky else ("personal", "personal_leaky")
    assert final[f"{honest}_acc_macro"] > 0.3
    assert f"{marked}_acc_macro" not in final and f"{marked}_acc_micro" not in final
    table = to_markdown(summary_table(group_runs(load_runs([sim.run_dir]))))
    assert ("LEAKY personal acc" in table) == leaky and ("personal acc (macro)" in table) != leaky
    assert "acc smallest client" in table and "client acc std" in table


def test_per_fedbc_learns_and_personalises_from_the_global_model(tiny_config):
    sim = Simulation(personal_config(tiny_config, {"name": "per_fedbc", "dual_lr": 0.01, "inner_lr": 0.05}))
    final = sim.run()["final"]
    assert final["test_acc"] > 0.7, final
    assert final["personal_acc_macro"] > 0.7 and final["lambda_mean"] > 0


def test_kill_and_resume_is_bit_exact(tiny_config):
    algo = {"name": "fedbc", "dual_lr": 0.01, "dual_momentum": 0.5, "warm_start": True}
    full = Simulation(tiny_config(run={"name": "full", "rounds": 4}, algorithm=algo))
    full.run()
    cut_cfg = tiny_config(run={"name": "cut", "rounds": 4}, algorithm=algo)
    Simulation(cut_cfg).run(stop_after=2)
    resumed = Simulation(cut_cfg)
    resumed.run(resume=True)
    keys = ("round", "test_acc", "lambda_mean", "gamma_mean", "weight_share_largest")
    r_full, r_cut = (read_metrics(s.run_dir / "metrics.jsonl") for s in (full, resumed))
    assert [{k: r[k] for k in keys} for r in r_full] == [{k: r[k] for k in keys} for r in r_cut]
    for key in ("global_params", "lam", "gamma", "lam_buf", "gamma_buf"):
        torch.testing.assert_close(full.algo.state_dict()[key], resumed.algo.state_dict()[key], rtol=0, atol=0)


def test_power_law_config_merges_train_and_test_then_splits_each_client():
    cfg = load_config(
        POWER_LAW, ["dataset.name=digits", "model.name=mlp", "partition.num_clients=5", "train.clients_per_round=2"]
    )
    resolved = resolve_config(cfg)
    assert resolved["partition"]["name"] == "power_law" and resolved["partition"]["merge_test"] is True
    fed = build_federation(cfg)
    assert fed.test_source == "local-union"
    totals = [len(c.y) + len(c.y_test) for c in fed.clients]
    assert sum(totals) == 1797  # every digit, train and test alike, is dealt out once
    assert totals == sorted(totals, reverse=True) and totals[0] > 2 * totals[-1]  # power-law sizes, largest first
    assert all(abs(len(c.y_test) - 0.2 * n) <= 1 for c, n in zip(fed.clients, totals, strict=True))
    assert len(fed.y_test) == sum(len(c.y_test) for c in fed.clients)

"""Differential privacy (issue 31 parts 1-2): the accountant, DP-FedAvg's clip and noise, adaptive clipping, local
DP-SGD's per-sample clipping, the refusals, and runs on digits that learn and resume bit for bit."""

from __future__ import annotations

import math

import pytest
import torch
from torch.func import functional_call

from fedhet.algorithms import privacy as dp
from fedhet.config import build_config
from fedhet.engine.simulation import Simulation
from fedhet.errors import ConfigError
from fedhet.results.store import read_metrics
from fedhet.toolkit.local import derive_seed

dp_accounting = pytest.importorskip("dp_accounting")


def central_cfg(**privacy):
    return build_config({"privacy": {"mode": "central", "clip": 1.0, **privacy}})


def test_epsilon_is_the_librarys_for_sampling_without_replacement():
    # independent of privacy.py's cache: the library's own accountant on the same event (replace-one, so z / 2)
    acc = dp_accounting.rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    event = dp_accounting.SampledWithoutReplacementDpEvent(100, 10, dp_accounting.GaussianDpEvent(1.1 / 2))
    acc.compose(dp_accounting.SelfComposedDpEvent(event, 50))
    assert dp.epsilon(1.1, 100, 10, 50, 1e-5) == pytest.approx(acc.get_epsilon(1e-5), rel=1e-12)
    assert dp.epsilon(1.1, 100, 10, 0, 1e-5) == 0.0 and dp.epsilon(0.0, 100, 10, 3, 1e-5) == math.inf
    assert dp.epsilon(1.1, 100, 10, 100, 1e-5) > dp.epsilon(1.1, 100, 10, 50, 1e-5)  # more rounds cost more


def test_the_library_is_within_abadi_et_als_moments_accountant_example():
    # Abadi et al. 2016, Sec. 3.1: q = 0.01, sigma = 4, T = 10000 steps, delta = 1e-5 give epsilon about 1.26 with
    # the moments accountant; RDP over more orders is at least as tight
    acc = dp_accounting.rdp.RdpAccountant()
    acc.compose(
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(4.0)), 10000
        )
    )
    assert 0.9 < acc.get_epsilon(1e-5) <= 1.26


@pytest.mark.slow
def test_target_epsilon_gives_the_smallest_noise_that_reaches_it_and_refuses_the_unreachable():
    z = dp.noise_for_epsilon(8.0, 200, 100, 4, 1e-5)  # the end-to-end run's setting: its cached search is reused
    assert dp.epsilon(z, 200, 100, 4, 1e-5) <= 8.0 < dp.epsilon(z * 0.98, 200, 100, 4, 1e-5)
    with pytest.raises(ConfigError, match="privacy.target_epsilon=0.01 cannot be reached: 30 rounds of 10 of 100"):
        dp.noise_for_epsilon(0.01, 100, 10, 30, 1e-5)


@pytest.mark.slow
def test_an_unreachable_target_epsilon_gets_advice_that_fits_the_run():
    """One round cannot be made fewer; fewer rounds are advised only where they would reach the target."""
    with pytest.raises(ConfigError) as one_round:
        dp.noise_for_epsilon(0.001, 200, 100, 1, 1e-5)
    message = str(one_round.value)
    assert "1 round of 100 of 200 clients" in message and "fewer rounds" not in message
    assert "raise privacy.target_epsilon or privacy.delta" in message and "fewer clients per round" in message
    # one of 200 clients a round: one round with noise multiplier 1e4 reaches epsilon 0.001, a hundred do not
    with pytest.raises(ConfigError) as one_client:
        dp.noise_for_epsilon(0.001, 200, 1, 100, 1e-5)
    message = str(one_client.value)
    assert "run fewer rounds" in message and "fewer clients per round" not in message and "more clients" in message


def test_central_dp_clips_sums_noises_and_divides_by_the_fixed_denominator():
    updates = [torch.tensor([3.0, 4.0]), torch.tensor([0.3, 0.4]), torch.tensor([0.0, -2.0])]  # norms 5, 0.5, 2
    central = dp.CentralDP(central_cfg(noise_multiplier=0.7).privacy, 20, 4, 10, seed=3)
    out = central.mean(updates)
    clipped = torch.tensor([0.6, 0.8]) + torch.tensor([0.3, 0.4]) + torch.tensor([0.0, -1.0])
    gen = torch.Generator().manual_seed(derive_seed(3, dp.NOISE_STREAM, 1))
    noise = torch.randn(2, generator=gen, dtype=torch.float64).float() * 0.7
    torch.testing.assert_close(out, (clipped + noise) / 4)  # m = 4 configured, 3 replied
    assert central.releases == 1 and central.last["privacy/unclipped_fraction"] == pytest.approx(1 / 3)
    again = dp.CentralDP(central_cfg(noise_multiplier=0.7).privacy, 20, 4, 10, seed=3)
    assert torch.equal(again.mean(updates), out)  # the k-th release's noise depends on (seed, k) only


def test_a_round_without_replies_releases_the_noise_alone():
    central = dp.CentralDP(central_cfg(noise_multiplier=0.7).privacy, 20, 4, 10, seed=3)
    out = central.mean([], like=torch.zeros(3))
    gen = torch.Generator().manual_seed(derive_seed(3, dp.NOISE_STREAM, 1))
    torch.testing.assert_close(out, torch.randn(3, generator=gen, dtype=torch.float64).float() * 0.7 / 4)
    assert central.releases == 1 and "privacy/unclipped_fraction" not in central.last  # accounted, nothing clipped


@pytest.mark.parametrize("algorithm", ["fedavg", "scaffold"])
def test_central_dp_noises_and_accounts_a_round_in_which_every_client_failed(tiny_config, algorithm):
    # an unchanged model would tell that every sampled client failed: the round still releases a noised mean
    cfg = tiny_config(
        run={"name": algorithm, "rounds": 3},
        algorithm={"name": algorithm},
        privacy={"mode": "central", "clip": 1.0, "noise_multiplier": 1.0},
    )
    sim = Simulation(cfg)
    original, before = sim.algo.client_update, {}

    def fail_in_round_2(ctx):
        if ctx.round == 2:
            before.setdefault("params", sim.algo.global_params.clone())
            before.setdefault("c", getattr(sim.algo, "c", torch.zeros(0)).clone())
            raise RuntimeError("every client fails in round 2")
        if ctx.round == 3:
            before.setdefault("after", sim.algo.global_params.clone())
            before.setdefault("c after", getattr(sim.algo, "c", torch.zeros(0)).clone())
        return original(ctx)

    sim.algo.client_update = fail_in_round_2
    summary = sim.run()
    privacy = sim.algo.privacy
    assert privacy.releases == 3 and summary["empty_rounds"] == 1
    assert "central DP applied (and accounted) those rounds' noise alone" in " ".join(summary["warnings"])
    p, m = before["params"].numel(), privacy.per_round
    noise = torch.randn(
        p * (2 if algorithm == "scaffold" else 1),
        generator=torch.Generator().manual_seed(derive_seed(cfg.run.seed, dp.NOISE_STREAM, 2)),
        dtype=torch.float64,
    ).float()
    torch.testing.assert_close(before["after"] - before["params"], noise[:p] / m)  # the noise alone, over m
    if algorithm == "scaffold":  # c gets the joint vector's second half, as in a round with replies
        scale = sim.algo.round_lr(2) * privacy.mean_steps
        expected = noise[p:] / m * (m / scale) / sim.setup.num_clients
        torch.testing.assert_close(before["c after"] - before["c"], expected)
    last = read_metrics(sim.run_dir / "metrics.jsonl")[-1]
    n = sim.setup.num_clients
    assert last["privacy/epsilon"] == pytest.approx(dp.epsilon(1.0, n, m, 3, cfg.privacy.delta))


def test_adaptive_clip_follows_andrew_et_al():
    cfg = central_cfg(noise_multiplier=1.0, adaptive_clip=True, target_quantile=0.7, clip_lr=0.3).privacy
    central = dp.CentralDP(cfg, 50, 20, 10, seed=0)
    sigma_b = 20 / 20  # clients per round / 20
    assert central.update_noise == pytest.approx((1.0 - (2 * sigma_b) ** -2) ** -0.5)  # z_u of Andrew et al.
    updates = [torch.full((3,), v) for v in (0.1, 0.2, 2.0, 3.0)]  # two under C = 1
    central.mean(updates)
    gen = torch.Generator().manual_seed(derive_seed(0, dp.NOISE_STREAM, 1))
    torch.randn(3, generator=gen, dtype=torch.float64)  # the update noise comes first
    count = 2 + float(torch.randn(1, generator=gen, dtype=torch.float64)) * sigma_b
    assert central.clip == pytest.approx(math.exp(-0.3 * (count / 20 - 0.7)))
    with pytest.raises(ConfigError, match="clipped-count noise"):
        _ = dp.CentralDP(central_cfg(noise_multiplier=3.0, adaptive_clip=True).privacy, 50, 20, 10, 0).update_noise


def test_dp_sgd_clips_each_sample_like_a_loop_over_samples():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    x, y = torch.randn(5, 3) * 4, torch.tensor([0, 1, 1, 0, 1])
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])

    def loss_of(params, xb, yb):
        w, b = params[:6].view(2, 3), params[6:]
        return torch.nn.functional.cross_entropy(functional_call(model, {"weight": w, "bias": b}, (xb,)), yb)

    cfg = build_config({"privacy": {"mode": "local", "clip": 0.5, "noise_multiplier": 0.8}}).privacy
    gen = torch.Generator().manual_seed(7)
    grad, loss = dp.dp_sgd_gradient(loss_of, flat, x, y, cfg, 8, gen)
    manual = torch.zeros_like(flat)
    for i in range(5):
        p = flat.clone().requires_grad_(True)
        g = torch.autograd.grad(loss_of(p, x[i : i + 1], y[i : i + 1]), p)[0]
        manual += g * min(1.0, 0.5 / float(g.norm()))
    noise = torch.randn(flat.shape, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(grad, (manual + noise * 0.8 * 0.5) / 8)  # over the configured batch size
    torch.testing.assert_close(loss, loss_of(flat, x, y))


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"privacy": {"clip": 2.0}}, "privacy.clip applies only with privacy.mode='central' or 'local'"),
        ({"privacy": {"mode": "central"}}, "needs exactly one of privacy.noise_multiplier and target_epsilon"),
        ({"privacy": {"mode": "local", "target_epsilon": 3.0}}, "privacy.target_epsilon applies only with"),
        ({"privacy": {"mode": "central", "noise_multiplier": 1.0, "clip_lr": 0.1}}, "only with privacy.adaptive_clip"),
    ],
)
def test_inconsistent_privacy_settings_are_one_line(sections, message):
    with pytest.raises(ConfigError, match=message):
        build_config(sections)


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"algorithm": {"name": "fednova"}}, "fednova's server does not take; algorithms that accept it: .*scaffold"),
        # a weighted average, refused for what else its server reads (docs/privacy-robustness.md says the same)
        (
            {"algorithm": {"name": "fednh"}},
            r"^privacy.mode='central' privatises the weighted average of the client models only, and fednh's server "
            r"also uses the class prototype sums and counts in the replies, computed from the clients' data, which "
            r"would reach it unprivatised; algorithms that accept it: .*fedavg",
        ),
        ({"server": {"name": "sgd", "aggregation": "gne"}}, "cannot be combined with server.aggregation='gne'"),
        ({"train": {"sampling": "dynamic"}}, "drawn uniformly without replacement"),
        ({"algorithm": {"name": "centralized"}}, "centralized pools their data into one client"),
    ],
)
def test_central_dp_refuses_what_it_cannot_privatise(tiny_config, sections, message):
    cfg = tiny_config(privacy={"mode": "central", "noise_multiplier": 1.0}, **sections)
    with pytest.raises(ConfigError, match=message):
        Simulation(cfg)


def test_local_dp_refuses_a_batch_level_loss(tiny_config):
    with pytest.raises(ConfigError, match="fedrcl does not declare .*accept it: .*fedavg"):
        Simulation(tiny_config(algorithm={"name": "fedrcl"}, privacy={"mode": "local", "noise_multiplier": 1.0}))


def test_models_with_buffers_are_refused():
    from fedhet.algorithms.fedavg import FedAvg
    from fedhet.engine.training import attach_privacy
    from fedhet.toolkit.flat import FlatModel

    cfg = central_cfg(noise_multiplier=1.0)
    flat = FlatModel(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2)))
    with pytest.raises(ConfigError, match="has buffers"):
        attach_privacy(cfg, FedAvg.__new__(FedAvg), flat, None)


def test_a_missing_accountant_names_the_extra(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "dp_accounting", None)
    with pytest.raises(ConfigError, match=r"pip install 'fedhet\[privacy\]'"):
        dp.dp_accounting()


def many_clients(tiny_config, name, **privacy):
    # client-level DP needs many clients per round for the noise z C / m to be small: 200 clients of ~7 digits
    return tiny_config(
        run={"name": name, "rounds": 4},
        partition={"name": "iid", "num_clients": 200},
        model={"name": "mlp", "hidden": []},
        train={"participation": 0.5, "local_epochs": 1, "batch_size": 16, "lr": 0.3},
        privacy={"mode": "central", "clip": 1.0, **privacy},
    )


def test_central_dp_at_epsilon_8_learns_on_digits_and_resumes_bit_exact(tiny_config, kill_and_resume):
    full, resumed = kill_and_resume(lambda name: many_clients(tiny_config, name, target_epsilon=8.0))
    r_full, r_cut = (read_metrics(s.run_dir / "metrics.jsonl") for s in (full, resumed))
    assert r_full == [dict(r, elapsed_s=f["elapsed_s"]) for r, f in zip(r_cut, r_full, strict=True)]
    torch.testing.assert_close(full.algo.global_params, resumed.algo.global_params, rtol=0, atol=0)
    last = r_full[-1]
    assert 7.5 < last["privacy/epsilon"] <= 8.0  # the target is spent by the last round, not exceeded
    assert last["test_acc"] > 0.5, last  # 10 classes: chance is 0.1


def test_scaffold_takes_central_dp_on_its_joint_vector(tiny_config):
    sim = Simulation(
        tiny_config(algorithm={"name": "scaffold"}, privacy={"mode": "central", "noise_multiplier": 0.0, "clip": 1e6})
    )
    plain = Simulation(tiny_config(algorithm={"name": "scaffold"}, run={"name": "plain"}))
    sim.run(), plain.run()
    # no noise and no clipping: DP-FedAvg's uniform 1/m equals SCAFFOLD's uniform mean (every client replied)
    torch.testing.assert_close(sim.algo.global_params, plain.algo.global_params)
    torch.testing.assert_close(sim.algo.c, plain.algo.c)


def test_local_dp_sgd_learns_reports_per_client_epsilon_and_resumes_bit_exact(tiny_config, kill_and_resume):
    def make(name):
        return tiny_config(
            run={"name": name, "rounds": 3},
            train={"participation": 1.0, "local_epochs": 1, "batch_size": 16, "lr": 0.5},
            privacy={"mode": "local", "clip": 1.0, "noise_multiplier": 1.0},
        )

    full, resumed = kill_and_resume(make)
    r_full, r_cut = (read_metrics(s.run_dir / "metrics.jsonl") for s in (full, resumed))
    assert r_full == [dict(r, elapsed_s=f["elapsed_s"]) for r, f in zip(r_cut, r_full, strict=True)]
    last = r_full[-1]
    steps = full.algo.privacy.steps
    eps = [dp.epsilon(1.0, n, 16, k, 1e-5) for n, k in steps.values()]
    assert last["privacy/epsilon_max"] == pytest.approx(max(eps)) and len(steps) == 6
    assert last["privacy/epsilon_mean"] == pytest.approx(sum(eps) / 6)
    assert last["test_acc"] > 0.5, last


def test_the_summary_records_the_resolved_noise_and_every_evaluation_line_shows_epsilon(tiny_config):
    """config.json keeps target_epsilon as given (noise_multiplier null); summary.json records the z it resolved to
    and what the accountant used (N, m, delta), and the console's evaluation lines carry epsilon."""
    import io
    import json

    from rich.console import Console

    cfg = tiny_config(
        run={"name": "acct", "rounds": 2, "progress": True},
        partition={"name": "iid", "num_clients": 200},
        model={"name": "mlp", "hidden": []},
        train={"participation": 0.5, "local_epochs": 1, "batch_size": 16, "lr": 0.3},
        privacy={"mode": "central", "clip": 1.0, "target_epsilon": 8.0},
    )
    out = io.StringIO()
    sim = Simulation(cfg, console=Console(file=out, width=300))
    summary = sim.run()
    last = read_metrics(sim.run_dir / "metrics.jsonl")[-1]
    z, eps = last["privacy/noise_multiplier"], last["privacy/epsilon"]
    assert json.loads((sim.run_dir / "config.json").read_text())["privacy"]["noise_multiplier"] is None
    accounting = {"mode": "central", "noise_multiplier": z, "target_epsilon": 8.0, "delta": 1e-5, "clients": 200}
    assert summary["privacy"] == {**accounting, "clients_per_round": 100, "epsilon": eps} and 7.5 < eps <= 8.0
    assert json.loads((sim.run_dir / "summary.json").read_text())["privacy"] == summary["privacy"]
    lines = [line for line in out.getvalue().splitlines() if "test_acc" in line]
    assert len(lines) == 2 and all(", epsilon " in line for line in lines), out.getvalue()


def test_a_local_dp_evaluation_line_shows_the_largest_client_epsilon():
    import io

    from rich.console import Console

    from fedhet.engine.display import RunDisplay

    out = io.StringIO()
    record = {"round": 3, "test_acc": 0.5, "clients": 4, "elapsed_s": 1.0, "privacy/epsilon_max": 2.346}
    with RunDisplay(Console(file=out, width=300), "run", 5, enabled=True) as display:
        display.start(0)
        display.evaluated(record)
    assert "epsilon 2.35 (largest of a client)" in out.getvalue()

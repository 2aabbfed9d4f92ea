"""FedBuff (server.mode = "fedbuff"): the staleness-weighted buffered step against hand computations, the refusals,
learning on digits, and bit-identical repeats and kill-and-resume on the simulated clock."""

from __future__ import annotations

import math

import pytest
import torch

from fedhet.algorithms import Reply
from fedhet.config import build_config
from fedhet.engine.asynchronous import BufferedSimulation, Flight
from fedhet.engine.buffered import buffered_statistics, buffered_target, fedbuff_refusal, staleness_weight
from fedhet.engine.runs import build_simulation
from fedhet.engine.simulation import Simulation
from fedhet.engine.training import resolve_config
from fedhet.errors import ConfigError
from fedhet.results.store import read_metrics

FEDBUFF = {"name": "sgd", "mode": "fedbuff", "buffer_size": 2, "concurrency": 4}
SYSTEM = {"profiles": "lognormal", "spread": 1.0}


def fedbuff_config(tiny_config, server=None, system=None, **sections):
    return tiny_config(server={**FEDBUFF, **(server or {})}, system={**SYSTEM, **(system or {})}, **sections)


def stable(records):
    return [{k: v for k, v in r.items() if k != "elapsed_s"} for r in records]


# ------------------------------------------------------------------ the math
def test_staleness_weight_polynomial_and_constant():
    assert staleness_weight(0, "polynomial", 0.5) == 1.0
    assert staleness_weight(3, "polynomial", 0.5) == pytest.approx(0.5)  # (1 + 3)^-0.5
    assert staleness_weight(1, "polynomial", 2.0) == pytest.approx(0.25)  # (1 + 1)^-2
    assert staleness_weight(7, "constant", 0.5) == 1.0
    with pytest.raises(ValueError):
        staleness_weight(-1, "polynomial", 0.5)


def test_buffered_target_by_hand():
    x = torch.tensor([1.0, 2.0])
    updates = [torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0]), torch.tensor([2.0, 2.0])]
    # uniform weights 1/3 times s(staleness) for staleness 0, 1, 3 with a = 0.5: 1, 1/sqrt(2), 1/2
    weights = [1 / 3 * staleness_weight(s, "polynomial", 0.5) for s in (0, 1, 3)]
    target = buffered_target(x, updates, weights)
    expected = torch.tensor([1 + (1 + 1) / 3, 2 + (2 / math.sqrt(2) + 1) / 3])
    torch.testing.assert_close(target, expected)


def test_server_step_is_the_staleness_weighted_buffer_through_the_server_lr(tiny_config):
    """The engine's step over a buffer of three updates with staleness 0, 1 and 3, by hand: server lr 0.5, uniform
    weights (the paper's 1/K), polynomial weight with a = 0.5."""
    cfg = fedbuff_config(
        tiny_config, server={"lr": 0.5, "buffer_size": 3}, algorithm={"name": "fedavg", "weighting": "uniform"}
    )
    sim = BufferedSimulation(cfg)
    x = sim.algo.global_params.clone()
    n = x.numel()
    updates = [torch.full((n,), 1.0), torch.full((n,), -2.0), torch.full((n,), 4.0)]
    sim.schedule.version = 3
    for i, (version, update) in enumerate(zip((3, 2, 0), updates, strict=True)):
        flight = Flight(cid=i, dispatch=i, version=version, start=0.0, arrival=1.0, trained=True, update=update)
        flight.buffers = sim.algo.global_buffers.clone() if sim.algo.global_buffers.numel() else None
        flight.reply = Reply(num_examples=10 * (i + 1), metrics={"train_loss": 1.0})
        sim.buffer.append(flight)
    sim.server_step(1, [])
    mean = (1.0 * 1.0 + (-2.0) / math.sqrt(2) + 4.0 / 2) / 3  # sum_i s_i Delta_i / K
    torch.testing.assert_close(sim.algo.global_params, x + 0.5 * mean, rtol=0, atol=1e-6)
    assert sim.schedule.version == 4 and not sim.buffer


def test_buffered_statistics_by_hand_stay_a_convex_combination():
    """A running variance of 0.5 now; two buffered clients report 0.1 (downloaded when it was 1.0, staleness 3) and
    0.3 (staleness 0), weights 1/2 each, polynomial a = 0.5: coefficients 1/4 and 1/2."""
    c = [0.5 * staleness_weight(3, "polynomial", 0.5), 0.5 * staleness_weight(0, "polynomial", 0.5)]
    assert c == [0.25, 0.5]
    out = buffered_statistics(torch.tensor([0.5]), [torch.tensor([0.1]), torch.tensor([0.3])], c)
    torch.testing.assert_close(out, torch.tensor([0.25 * 0.5 + 0.25 * 0.1 + 0.5 * 0.3]))  # 0.3
    # the stale difference 0.1 - 1.0 applied to 0.5 would have given 0.5 + 0.25 (-0.9) + 0.5 (-0.2) = 0.175, and
    # with one buffered client (c = 1) 0.5 - 0.9 = -0.4; the reported statistic gives 0.1
    assert buffered_statistics(torch.tensor([0.5]), [torch.tensor([0.1])], [1.0]).item() == pytest.approx(0.1)
    # constant staleness, weights summing to 1: the synchronous rule, the weighted average of what was reported
    out = buffered_statistics(
        torch.tensor([9.0, 9.0]), [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])], [0.25, 0.75]
    )
    torch.testing.assert_close(out, torch.tensor([2.5, 3.5]))
    # weights outside the simplex (a plug-in's) are clipped and scaled: never an extrapolation
    out = buffered_statistics(torch.tensor([1.0]), [torch.tensor([0.0]), torch.tensor([2.0])], [3.0, -1.0])
    assert out.item() == 0.0


def test_fedbuff_keeps_batchnorm_variances_non_negative_after_every_step(tiny_config):
    """Buffer size 1, six clients in flight, constant staleness: stale clients report statistics of versions long
    gone. Moving the global statistics by their differences made a running variance negative by step 3 (seed 0)."""
    cfg = fedbuff_config(
        tiny_config,
        run={"rounds": 4, "eval_every": 4},
        model={"name": "cnn_bn", "channels": [4, 4, 8], "hidden": [16]},
        server={"buffer_size": 1, "concurrency": 6, "staleness": "constant"},
        system={"spread": 2.0},
    )
    sim = build_simulation(cfg)
    slices = [s for name, s in sim.flat.buffer_slices().items() if name.endswith("running_var")]
    lowest: list[float] = []
    sim.on_round = lambda rnd, record: lowest.append(min(float(sim.algo.global_buffers[s].min()) for s in slices))
    summary = sim.run()
    assert summary["status"] == "finished" and len(lowest) == 5  # before the first step, then after each
    assert slices and min(lowest) >= 0, lowest


# ------------------------------------------------------------------ what FedBuff accepts
def test_fedbuff_keeps_the_client_side_of_model_averaging_methods():
    from fedhet.algorithms import ALGORITHMS

    able = {e.name for e in ALGORITHMS.entries() if fedbuff_refusal(e.obj) is None}
    assert {"fedavg", "fedprox", "moon", "feddecorr", "fedlc", "fedntd"} <= able
    assert not able & {"scaffold", "feddyn", "fednova", "centralized", "fedbn", "qfedavg", "fedmeta"}


@pytest.mark.parametrize(
    ("sections", "words"),
    [
        (
            {"algorithm": {"name": "scaffold"}},
            "scaffold's clients and replaces its server, but its server sends the clients more",
        ),
        ({"algorithm": {"name": "centralized"}}, "every client's data"),
        ({"algorithm": {"name": "fedrane"}}, "fedrane averages with GNE's Nash-bargaining weights"),
        ({"server": {"concurrency": 9}}, "server.concurrency=9 exceeds partition.num_clients=6"),
        ({"server": {"aggregation": "median"}}, "server.aggregation='median' replaces the average"),
        ({"system": {"deadline": 5.0}}, "system.deadline acts on a synchronous round"),
        ({"system": {"over_selection": 0.5}}, "system.over_selection acts on a synchronous round"),
        ({"system": {"availability": "bernoulli"}}, "system.availability='bernoulli' acts on a synchronous round"),
        ({"train": {"sampling": "dynamic"}}, "train.sampling='dynamic' chooses a round's clients"),
        ({"privacy": {"mode": "central", "noise_multiplier": 1.0}}, "privacy.mode='central' is accounted"),
    ],
)
def test_unsound_settings_are_one_line(tiny_config, sections, words):
    server = {**FEDBUFF, **sections.pop("server", {})}
    system = {**SYSTEM, **sections.pop("system", {})}
    with pytest.raises(ConfigError) as err:
        resolve_config(tiny_config(server=server, system=system, **sections))
    assert words in str(err.value) and "\n" not in str(err.value)


def test_fedbuff_needs_the_clock(tiny_config):
    with pytest.raises(ConfigError, match="needs the clients' speeds: set system.profiles"):
        resolve_config(tiny_config(server=FEDBUFF))


@pytest.mark.parametrize(
    ("server", "words"),
    [
        ({"buffer_size": 3}, "server.buffer_size applies only with server.mode='fedbuff'"),
        ({"mode": "fedbuff", "staleness": "constant", "staleness_exponent": 1.0}, "staleness_exponent applies only"),
        ({"mode": "fedbuff", "buffer_size": 0}, "server.buffer_size: must be greater than or equal to 1"),
        ({"mode": "asap"}, "server.mode"),
    ],
)
def test_fedbuff_options_are_checked(server, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        build_config({"server": {"name": "sgd", **server}})


def test_flower_refuses_fedbuff(tiny_config):
    from fedhet.flower.app import check_synchronous

    with pytest.raises(ConfigError, match="the Flower server's rounds are synchronous"):
        check_synchronous(fedbuff_config(tiny_config))


def test_build_simulation_picks_the_loop(tiny_config):
    assert type(build_simulation(tiny_config())) is Simulation
    assert type(build_simulation(fedbuff_config(tiny_config))) is BufferedSimulation


# ------------------------------------------------------------------ runs
def test_fedbuff_learns_on_digits_and_logs_the_clock(tiny_config):
    cfg = fedbuff_config(tiny_config, run={"rounds": 30, "eval_every": 10}, train={"lr": 0.1})
    sim = build_simulation(cfg)
    summary = sim.run()
    records = read_metrics(sim.run_dir / "metrics.jsonl")
    assert summary["status"] == "finished" and summary["final"]["test_acc"] > 0.85, summary["final"]
    assert [r["async/version"] for r in records] == [10, 20, 30]
    assert [r["async/updates"] for r in records] == [20, 40, 60]  # K = 2 updates a step, no failure
    times = [r["sim/time"] for r in records]
    assert times == sorted(times) and times[0] > 0
    assert all(r["async/staleness_mean"] >= 0 and r["async/staleness_max"] >= 1 for r in records)
    assert all(r["clients"] <= 2 for r in records)


def test_fedbuff_is_bit_identical_when_repeated(tiny_config):
    def run(name):
        cfg = fedbuff_config(
            tiny_config,
            run={"name": name, "rounds": 10, "eval_every": 2},
            system={"stragglers": 0.5, "straggler_policy": "partial", "dropout": 0.3},
        )
        sim = build_simulation(cfg)
        sim.run()
        return sim, read_metrics(sim.run_dir / "metrics.jsonl")

    (a, ra), (b, rb) = run("a"), run("b")
    assert stable(ra) == stable(rb)
    assert torch.equal(a.algo.global_params, b.algo.global_params)
    assert sum(r["async/lost"] for r in ra) > 0  # the dropouts did happen


@pytest.mark.parametrize(
    ("store", "executor"), [("memory", "sequential"), ("disk", "sequential"), ("memory", "batched")]
)
def test_fedbuff_kill_and_resume_is_bit_exact(tiny_config, kill_and_resume, store, executor):
    """Stragglers keep partial work, dropouts, client-held optimiser state and server momentum: the in-flight
    clients, trained and not, come back from the checkpoint and the resumed run is the uninterrupted one, bit for
    bit."""

    def make(name):
        return fedbuff_config(
            tiny_config,
            run={
                "name": name,
                "rounds": 8,
                "eval_every": 2,
                "checkpoint_every": 3,
                "client_state": store,
                "executor": executor,
            },
            algorithm={"name": "fedprox", "mu": 0.1},
            server={"name": "fedavgm", "buffer_size": 3},
            train={"momentum": 0.5, "optimizer_state": "client"},
            system={"stragglers": 0.3, "straggler_policy": "partial", "dropout": 0.1},
        )

    full, resumed = kill_and_resume(make, stop_after=5)
    assert isinstance(resumed, BufferedSimulation)
    r_full = read_metrics(full.run_dir / "metrics.jsonl")
    r_cut = read_metrics(resumed.run_dir / "metrics.jsonl")
    assert stable(r_full) == stable(r_cut) and len(r_cut) == 4
    assert torch.equal(full.algo.global_params, resumed.algo.global_params)
    assert full.schedule.state_dict()["fedbuff"]["dispatched"] == resumed.schedule.state_dict()["fedbuff"]["dispatched"]


def test_a_checkpoint_with_batchnorm_differences_is_refused_in_one_line():
    """Checkpoints written before the statistics were kept as reported hold differences from a version now gone."""
    state = Flight(cid=0, dispatch=0, version=0, start=0.0, arrival=1.0).state()
    del state["buffers"]
    Flight.from_state({**state, "buffer_update": None}, torch.device("cpu"))  # a model without buffers: fine
    with pytest.raises(ConfigError, match="holds BatchNorm statistics as differences") as err:
        Flight.from_state({**state, "buffer_update": torch.zeros(3)}, torch.device("cpu"))
    assert "\n" not in str(err.value)

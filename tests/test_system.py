"""The system model (engine/system.py): profiles, the simulated clock, stragglers, the deadline, dropouts,
availability and over-selection, checked against hand-computed answers; then end to end on digits: the step budget
reaches both executors, a run repeats bit for bit and resumes bit-exact, and bad settings are one line."""

from __future__ import annotations

import hashlib
import json
import math
import os
import threading
import warnings

import numpy as np
import pytest
import torch

from fedhet.algorithms.contract import STEP_BUDGET, Message, step_budget
from fedhet.config import build_config
from fedhet.engine.checkpoint import read_checkpoint
from fedhet.engine.runs import build_simulation
from fedhet.engine.simulation import Simulation, resolve_config
from fedhet.engine.system import (
    FAILED,
    KEPT,
    LATE,
    MAX_ROUND_SECONDS,
    MAX_TRACE_BYTES,
    STRAGGLER,
    SURPLUS,
    SystemModel,
    draw_profiles,
    read_trace,
    samples_processed,
    steps_within,
)
from fedhet.errors import ConfigError, RunFailed


def model(system: dict, sizes: list[int], model_bytes: int = 1000, **train) -> SystemModel:
    """A system model over clients of ``sizes`` samples (batch size 4, one local epoch unless ``train`` says)."""
    n = len(sizes)
    cfg = build_config(
        {
            "partition": {"num_clients": n},
            "train": {"batch_size": 4, "clients_per_round": n, **train},
            "system": {"profiles": "constant", "speed": 10.0, "bandwidth": 1000.0, **system},
        }
    )
    return SystemModel(cfg, sizes, model_bytes)


def every(rnd: int, pool: list[int], k: int) -> list[int]:
    return sorted(pool)[:k]


# ---------------------------------------------------------------------------------------------------- the clock
def test_samples_processed_counts_full_passes_then_batches():
    # n = 10, B = 4: a pass is 3 steps (4 + 4 + 2 samples); 5 steps = one pass (10) + 2 batches (8)
    assert samples_processed(3, 10, 4) == 10
    assert samples_processed(5, 10, 4) == 18
    assert samples_processed(1, 3, 4) == 3  # one short batch is the whole pass


def test_steps_within_is_the_most_steps_that_fit():
    # speed 10: 1 s holds 10 samples = 3 steps of (4, 4, 2); a 4th step would make 14
    assert steps_within(1.0, 10, 4, 10.0, most=100) == 3
    assert steps_within(0.39, 10, 4, 10.0, most=100) == 0
    assert steps_within(5.0, 10, 4, 10.0, most=2) == 2  # capped


def test_arrival_is_compute_plus_two_transfers_and_latency():
    sm = model({"latency": 0.5}, [10, 20])
    # client 1: 20 samples, B 4 -> 5 steps, 20 samples / 10 per s = 2 s; 2 x 1000 B / 1000 B/s = 2 s; + 0.5 s
    assert sm.full == [3, 5]
    assert sm.arrival(1, 5) == pytest.approx(4.5)
    assert sm.arrival(0, 3) == pytest.approx(1.0 + 2.0 + 0.5)


def test_a_round_without_trouble_lasts_until_the_slowest_reply_and_the_clock_adds_up():
    sm = model({}, [10, 20])
    first = sm.plan(1, every)
    assert first.participants == [0, 1] and first.budgets() == {}
    assert first.duration == pytest.approx(4.0)  # client 1: 2 s compute + 2 s transfer
    sm.finish(first)
    second = sm.plan(2, every)
    assert second.start == pytest.approx(4.0)
    sm.finish(second)
    assert sm.time == pytest.approx(8.0)
    assert second.metrics()["sim/time"] == pytest.approx(8.0)


# ---------------------------------------------------------------------------------------------------- profiles
def test_profiles_constant_uniform_lognormal_tiers():
    n = 10
    constant = draw_profiles(build_config({"system": {"profiles": "constant", "speed": 5.0}}).system, n, 0)
    assert np.all(constant.speed == 5.0) and np.all(constant.bandwidth == 1e6)
    uniform = draw_profiles(build_config({"system": {"profiles": "uniform", "spread": 0.5}}).system, 1000, 0)
    assert uniform.speed.min() >= 50.0 and uniform.speed.max() <= 150.0
    assert abs(uniform.speed.mean() - 100.0) < 3.0
    lognormal = draw_profiles(build_config({"system": {"profiles": "lognormal", "spread": 1.0}}).system, 4000, 0)
    assert abs(np.median(lognormal.speed) / 100.0 - 1) < 0.1  # the median is speed
    assert abs(np.log(lognormal.speed).std() - 1.0) < 0.05  # the log's standard deviation is spread
    tiers = draw_profiles(build_config({"system": {"profiles": "tiers"}}).system, n, 0)
    # the default tiers: half at 200 samples/s, 30 % at 50, 20 % at 10, each with its bandwidth
    assert sorted(tiers.speed.tolist()) == [10.0] * 2 + [50.0] * 3 + [200.0] * 5
    assert set(zip(tiers.speed.tolist(), tiers.bandwidth.tolist(), strict=True)) == {
        (200.0, 2e6),
        (50.0, 5e5),
        (10.0, 1e5),
    }
    again = draw_profiles(build_config({"system": {"profiles": "tiers"}}).system, n, 0)
    assert np.array_equal(tiers.speed, again.speed)  # seeded


def test_trace_is_read_and_bad_traces_are_one_line(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text("client,speed,bandwidth,availability\n1,20,2000,0.5\n0,10,1000,1\n")
    prof = read_trace(path, 2)
    assert prof.speed.tolist() == [10.0, 20.0] and prof.availability.tolist() == [1.0, 0.5]
    cases = {
        "client,speed,bandwidth,availability\n0,10,1000,1\n": "no row for client(s) 1",
        "client,speed,bandwidth,availability\n0,10,1000,1\n1,fast,1000,1\n": "line 3: speed 'fast' is not a positive",
        "client,speed,bandwidth,availability\n0,10,1000,1\n1,10,1000,1.5\n": "availability '1.5' is not a number in",
        "client,speed,bandwidth,availability\n0,10,1000,1\n0,10,1000,1\n": "line 3: client 0 has a second row",
        "client,speed,bandwidth,availability\n0,10,1000,1\n7,10,1000,1\n": "client 7 is not one of",
        "client,speed,bandwidth,availability\n0,10,1000\n": "line 2: expected 4 values",
        "id,speed,bandwidth,availability\n": "the first row must be the header",
    }
    for text, words in cases.items():
        path.write_text(text)
        with pytest.raises(ConfigError) as err:
            read_trace(path, 2)
        assert words in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="cannot be read"):
        read_trace(tmp_path / "absent.csv", 2)


def refusal(path, num_clients: int = 2) -> str:
    """read_trace's error, from a thread given 10 s: a trace that blocks the reader fails the test, not the suite."""
    out: list[str] = []

    def read() -> None:
        try:
            read_trace(path, num_clients)
        except ConfigError as err:
            out.append(str(err))

    worker = threading.Thread(target=read, daemon=True)
    worker.start()
    worker.join(10)
    assert out, f"read_trace({path}) blocked or raised no ConfigError"
    assert "\n" not in out[0]
    return out[0]


def test_traces_that_are_not_small_regular_csv_files_are_one_line(tmp_path):
    long = tmp_path / "long.csv"  # a field beyond the csv module's limit (131072 characters)
    long.write_text("client,speed,bandwidth,availability\n0,10,1000,1\n1," + "9" * 200_000 + ",1000,1\n")
    assert "line 3: not a CSV row (field larger than field limit" in refusal(long)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # no writer: reading it would wait forever
    assert refusal(fifo).endswith("fifo' is a FIFO; it must be a regular CSV file")
    assert "'/dev/null' is a character device" in refusal("/dev/null")  # /dev/zero too, which would never end
    huge = tmp_path / "huge.csv"
    with huge.open("wb") as f:
        f.truncate(MAX_TRACE_BYTES + 1)  # sparse: refused by its size, never read
    assert "is larger than 64 MiB, the most a trace" in refusal(huge)


# ---------------------------------------------------------------------------------------------------- a round
def test_stragglers_are_dropped_or_keep_a_uniform_share_of_their_steps():
    sizes = [40] * 10  # 10 steps each
    drop = model({"stragglers": 0.35}, sizes).plan(3, every)
    # round(0.35 x 10) = 4 stragglers (half up), dropped under the default policy
    assert sum(c.straggler for c in drop.clients) == 4
    assert sorted(c.status for c in drop.clients) == [KEPT] * 6 + [STRAGGLER] * 4
    partial = model({"stragglers": 0.35, "straggler_policy": "partial"}, sizes).plan(3, every)
    stragglers = [c for c in partial.clients if c.straggler]
    assert [c.cid for c in stragglers] == [c.cid for c in drop.clients if c.straggler]  # the same draw
    assert all(c.status == KEPT and 1 <= c.steps <= 10 for c in stragglers)
    assert partial.budgets() == {c.cid: c.steps for c in stragglers if c.steps < 10}
    # the round lasts until the slowest reply: a full client's 4 s + 2 s transfer
    assert partial.duration == pytest.approx(6.0)
    # over many rounds the step counts cover [1, 10] evenly
    sm = model({"stragglers": 1.0, "straggler_policy": "partial"}, sizes)
    counts = [c.steps for r in range(1, 201) for c in sm.plan(r, every).clients]
    assert min(counts) == 1 and max(counts) == 10 and abs(np.mean(counts) - 5.5) < 0.2


def test_stragglers_can_draw_whole_epochs_as_fedprox_code_does():
    """straggler_steps = "epochs": randint(1, E) whole epochs (FedProx's trainer), here E = 3: 1 or 2 passes of
    ceil(40 / 4) = 10 steps, never the full 30."""
    sm = model(
        {"stragglers": 1.0, "straggler_policy": "partial", "straggler_steps": "epochs"}, [40] * 10, local_epochs=3
    )
    assert sm.full == [30] * 10
    counts = [c.steps for r in range(1, 41) for c in sm.plan(r, every).clients]
    assert set(counts) == {10, 20} and abs(counts.count(10) / len(counts) - 0.5) < 0.1
    uniform = model({"stragglers": 1.0, "straggler_policy": "partial"}, [40] * 10, local_epochs=3)
    assert len({c.steps for r in range(1, 41) for c in uniform.plan(r, every).clients}) > 2  # the default: any step


def test_epoch_stragglers_need_whole_epochs_to_draw_from(tiny_config):
    epochs = {"profiles": "constant", "stragglers": 0.5, "straggler_steps": "epochs"}
    for train, got in (({"local_epochs": 1}, "local_epochs=1"), ({"local_epochs": 2.5}, "local_epochs=2.5")):
        with pytest.raises(ConfigError, match=rf"needs a whole train.local_epochs >= 2 .*\(got train.{got}\)"):
            resolve_config(tiny_config(train=train, system=epochs))
    with pytest.raises(ConfigError, match=r"\(got train.local_steps=5\); or use 'uniform'"):
        resolve_config(tiny_config(train={"local_epochs": 2, "local_steps": 5}, system=epochs))
    resolve_config(tiny_config(train={"local_epochs": 2}, system=epochs))


def test_deadline_drops_late_clients_or_keeps_the_steps_that_fit():
    sizes = [8, 40]  # 2 and 10 steps: arrivals 0.8 + 2 = 2.8 s and 4 + 2 = 6 s
    drop = model({"deadline": 4.0}, sizes).plan(1, every)
    assert [c.status for c in drop.clients] == [KEPT, LATE]
    assert drop.duration == pytest.approx(4.0)  # the server waited until the deadline for client 1
    partial = model({"deadline": 4.0, "straggler_policy": "partial"}, sizes).plan(1, every)
    # client 1 has 4 - 2 = 2 s of compute: 20 samples = 5 steps, arriving at 2 + 2 = 4 s
    assert partial.budgets() == {1: 5}
    assert partial.clients[1].arrival == pytest.approx(4.0) and partial.duration == pytest.approx(4.0)


@pytest.mark.parametrize(
    ("system", "words"),
    [
        ({"speed": 1e-320}, "computing at 1e-320 samples/s"),
        ({"bandwidth": 1e-320}, "moving the model at 1e-320 bytes/s"),
        ({"speed": 1e-12}, "; raise system.speed or system.bandwidth"),
        ({"profiles": "lognormal", "spread": 400.0}, "or lower system.spread"),
        ({"latency": 1e300}, "; lower system.latency"),
    ],
)
def test_a_clock_that_would_overflow_is_refused_with_the_bound(system, words):
    """Speeds or bandwidths near zero made sim/time inf (logged as null) with a numpy overflow warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no RuntimeWarning on the way
        with pytest.raises(ConfigError) as err:
            model(system, [40] * 50)
    text = str(err.value)
    assert words in text and f"more than the {MAX_ROUND_SECONDS:.0e} s a round may last" in text and "\n" not in text


def test_a_client_without_data_computes_nothing_whatever_its_speed(monkeypatch):
    """A log-normal speed can underflow to 0: a client with no samples then computes 0 s, not 0 / 0."""
    from fedhet.engine import system

    speeds = system.Profiles(np.array([0.0, 10.0]), np.array([1000.0, 1000.0]))
    monkeypatch.setattr(system, "draw_profiles", lambda *args: speeds)
    assert model({}, [0, 40]).arrival(0, 1) == pytest.approx(2.0)  # the transfers only
    with pytest.raises(ConfigError, match=r"client 0 would take inf simulated seconds"):
        model({}, [8, 40])


def test_a_trace_or_tier_that_would_overflow_the_clock_names_what_to_fix(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text("client,speed,bandwidth,availability\n0,10,1000,1\n1,1e-310,1000,1\n")
    cfg = build_config({"partition": {"num_clients": 2}, "system": {"profiles": "trace", "trace": str(path)}})
    with pytest.raises(ConfigError, match=r"client 1 would take .* fix client 1's row in system.trace"):
        SystemModel(cfg, [8, 8], 1000)
    tiers = {"profiles": "tiers", "tiers": [[0.5, 10.0, 1e6], [0.5, 1e-300, 1e6]]}
    cfg = build_config({"partition": {"num_clients": 2}, "system": tiers})
    with pytest.raises(ConfigError, match=r"1e\+12 s a round may last .*; raise that tier's speed or bandwidth"):
        SystemModel(cfg, [8, 8], 1000)


def test_a_deadline_no_client_can_meet_is_one_line():
    # the fastest client needs 0.4 s for one step of 4 samples and 2 s for the transfers
    with pytest.raises(ConfigError, match=r"system.deadline=2 s .* at least 2\.4") as err:
        model({"deadline": 2.0}, [8, 40])
    assert "\n" not in str(err.value)


def test_dropouts_fail_after_training_and_the_server_waits_for_them():
    sizes = [8, 40]
    every_one = model({"dropout": 1.0}, sizes).plan(1, every)
    assert [c.status for c in every_one.clients] == [FAILED, FAILED] and every_one.participants == []
    assert every_one.duration == pytest.approx(6.0)  # without a deadline: until their replies were due
    with_deadline = model({"dropout": 1.0, "deadline": 10.0}, sizes).plan(1, every)
    assert with_deadline.duration == pytest.approx(10.0)  # a lost reply is only known at the deadline
    sm = model({"dropout": 0.3}, [8] * 50)
    rate = np.mean([c.status == FAILED for r in range(1, 41) for c in sm.plan(r, every).clients])
    assert abs(rate - 0.3) < 0.05


def test_over_selection_keeps_the_first_replies_to_arrive():
    sizes = [40, 8, 24, 16]  # arrivals 6, 2.8, 4.4, 3.6 s
    cfg = build_config(
        {
            "partition": {"num_clients": 4},
            "train": {"batch_size": 4, "clients_per_round": 2},
            "system": {"profiles": "constant", "speed": 10.0, "bandwidth": 1000.0, "over_selection": 0.5},
        }
    )
    plan = SystemModel(cfg, sizes, 1000).plan(1, every)  # 2 x 1.5 = 3 asked: clients 0, 1, 2
    assert [c.cid for c in plan.clients] == [0, 1, 2]
    assert [c.status for c in plan.clients] == [SURPLUS, KEPT, KEPT]
    assert plan.duration == pytest.approx(4.4)  # the second reply
    assert plan.metrics()["sim/surplus"] == 1 and plan.metrics()["sim/dropped"] == 0


def test_availability_bernoulli_daily_and_trace(tmp_path):
    sizes = [8] * 200
    bern = model({"availability": "bernoulli", "online": 0.25}, sizes)
    assert abs(len(bern.online(1)) / 200 - 0.25) < 0.08
    assert bern.online(1) == bern.online(1) and bern.online(1) != bern.online(2)
    daily = model({"availability": "daily", "online": 0.5, "day": 100.0}, sizes)
    now = set(daily.online(1))
    daily.time = 50.0  # half a day later, the other half of each client's day
    assert now.isdisjoint(daily.online(2)) and len(now) + len(daily.online(2)) == 200
    path = tmp_path / "trace.csv"
    path.write_text("client,speed,bandwidth,availability\n0,10,1000,0\n1,10,1000,1\n")
    cfg = build_config(
        {
            "partition": {"num_clients": 2},
            "system": {"profiles": "trace", "trace": str(path), "availability": "trace"},
        }
    )
    assert SystemModel(cfg, [8, 8], 1000).online(1) == [1]


def test_the_sampler_draws_from_the_online_clients_and_unchanged_when_all_are(tiny_config):
    sim = Simulation(tiny_config())
    assert sim.sampler.sample(4) == sim.sampler.sample(4, list(range(6)), 3)
    assert set(sim.sampler.sample(4, [1, 3, 5], 2)) <= {1, 3, 5}
    assert sim.sampler.sample(4, [2, 4], 3) == [2, 4]


def test_step_budget_caps_the_full_count():
    assert step_budget(Message(), 7) == 7
    assert step_budget(Message(scalars={STEP_BUDGET: 3}), 7) == 3
    assert step_budget(Message(scalars={STEP_BUDGET: 30}), 7) == 7


# ---------------------------------------------------------------------------------------------------- settings
@pytest.mark.parametrize(
    ("system", "words"),
    [
        ({"profiles": "constant", "stragglers": 1.5}, "system.stragglers: must be less than or equal to 1 (got 1.5)"),
        ({"profiles": "constant", "dropout": -0.1}, "system.dropout: must be greater than or equal to 0"),
        ({"stragglers": 0.5}, "system.stragglers needs a system model: set system.profiles"),
        ({"profiles": "uniform", "spread": 1.0}, "system.spread must be below 1"),
        ({"profiles": "constant", "spread": 0.2}, "system.spread applies only with system.profiles='uniform' or"),
        ({"profiles": "tiers", "tiers": [[0.5, 1, 1], [0.2, 1, 1]]}, "shares must sum to 1"),
        ({"profiles": "trace"}, "needs system.trace"),
        ({"profiles": "constant", "availability": "trace"}, "needs system.profiles='trace'"),
        ({"profiles": "constant", "online": 0.5}, "system.online applies only with system.availability="),
        ({"profiles": "constant", "straggler_policy": "partial"}, "applies only with system.stragglers > 0"),
        ({"profiles": "constant", "straggler_steps": "epochs"}, "straggler_steps applies only with system.strag"),
        ({"profiles": "fast"}, "system.profiles"),
    ],
)
def test_bad_settings_are_one_line(system, words):
    with pytest.raises(ConfigError) as err:
        build_config({"system": system})
    assert words in str(err.value) and "\n" not in str(err.value)


def test_refused_combinations(tiny_config):
    with pytest.raises(ConfigError, match="trains one client holding every client's data"):
        resolve_config(tiny_config(algorithm={"name": "centralized"}, system={"profiles": "constant"}))
    for system in ({"availability": "bernoulli"}, {"over_selection": 0.5}):
        cfg = tiny_config(
            privacy={"mode": "central", "noise_multiplier": 1.0}, system={"profiles": "constant", **system}
        )
        with pytest.raises(ConfigError, match="privacy.mode='central' is accounted for m of the N clients"):
            resolve_config(cfg)
    # stragglers, the deadline and dropouts only remove replies: the fixed denominator allows for them
    resolve_config(
        tiny_config(
            privacy={"mode": "central", "noise_multiplier": 1.0},
            system={"profiles": "constant", "stragglers": 0.5, "dropout": 0.2},
        )
    )


def test_flower_refuses_the_system_model(tiny_config):
    from fedhet.flower.app import RunOptions, run_server

    with pytest.raises(ConfigError, match="simulates devices in fedhet run; a Flower deployment has real ones"):
        run_server(None, tiny_config(system={"profiles": "constant"}), RunOptions())


# ---------------------------------------------------------------------------------------------------- end to end
SYSTEM = {
    "profiles": "lognormal",
    "stragglers": 0.5,
    "straggler_policy": "partial",
    "dropout": 0.2,
    "availability": "bernoulli",
    "online": 0.9,
    "over_selection": 0.5,
}


def lines(sim) -> list[dict]:
    text = (sim.run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k != "elapsed_s"} for line in text]


def test_digits_run_logs_the_clock_and_trains_the_budgeted_steps(tiny_config):
    cfg = tiny_config(run={"rounds": 4}, system=SYSTEM)
    sim = Simulation(cfg)
    seen: list[tuple[int, list[int], dict[int, int]]] = []
    run_phase = sim.run_phase

    def spy(rnd, phase_idx, phase, cids, budgets=None):
        result = run_phase(rnd, phase_idx, phase, cids, budgets)
        seen.append((rnd, cids, dict(budgets or {})))
        for cid, reply in result.replies.items():  # a budgeted client trained exactly its budget
            full = sim.system.full[cid]
            assert reply.metrics["steps"] == (budgets or {}).get(cid, full)
        return result

    sim.run_phase = spy
    sim.run()
    records = lines(sim)
    assert [r["round"] for r in records] == [1, 2, 3, 4]
    times = [r["sim/time"] for r in records]
    assert all(b > a for a, b in zip(times, times[1:], strict=False))
    assert math.isclose(sum(r["sim/round_time"] for r in records), times[-1], rel_tol=1e-12)
    assert any(budgets for _, _, budgets in seen)  # some partial work happened
    assert all(r["clients"] <= 3 for r in records)  # at most clients per round replies are kept


@pytest.mark.parametrize("store", ["memory", "disk"])
def test_a_system_run_repeats_and_resumes_bit_exact(tiny_config, kill_and_resume, store):
    def make(name):
        return tiny_config(
            run={"rounds": 4, "name": name, "client_state": store},
            algorithm={"name": "scaffold"},  # client state: the control variates
            train={"optimizer_state": "client", "momentum": 0.5},
            system={**SYSTEM, "availability": "daily", "online": 0.7, "day": 20.0},
        )

    full, resumed = kill_and_resume(make)
    again = Simulation(make("again"))
    again.run()
    assert lines(full) == lines(resumed) == lines(again)
    last = [read_checkpoint(s.checkpoint_path) for s in (full, resumed, again)]
    assert torch.equal(last[0]["algo"]["global_params"], last[1]["algo"]["global_params"])
    assert torch.equal(last[0]["algo"]["global_params"], last[2]["algo"]["global_params"])
    assert last[0]["system"] == last[1]["system"] and last[0]["system"]["time"] > 0


def test_a_run_whose_trace_changed_is_not_resumed(tiny_config, tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("client,speed,bandwidth,availability\n" + "".join(f"{c},{10 + c},1000,1\n" for c in range(6)))

    def make(rounds):
        return tiny_config(run={"rounds": rounds, "name": "traced"}, system={"profiles": "trace", "trace": str(trace)})

    first = Simulation(make(2))
    first.run()
    assert (
        read_checkpoint(first.checkpoint_path)["system"]["trace_sha256"]
        == hashlib.sha256(trace.read_bytes()).hexdigest()
    )
    before = {p: p.read_bytes() for p in first.run_dir.rglob("*") if p.is_file() and p.name != ".fedhet.lock"}
    trace.write_text(trace.read_text().replace("0,10,1000", "0,99,1000"))
    with pytest.raises(ConfigError, match=r"system.trace .* has changed since the run was checkpointed"):
        Simulation(make(3)).run(resume=True)
    after = {p: p.read_bytes() for p in first.run_dir.rglob("*") if p.is_file() and p.name != ".fedhet.lock"}
    assert after == before  # the run folder is untouched


def test_the_batched_executor_honours_the_step_budgets(tiny_config):
    """Varying budgets in one batched group: the same steps as the sequential loop, the same model to rounding."""

    def run(executor):
        cfg = tiny_config(
            run={"rounds": 3, "name": executor, "executor": executor},
            train={"clients_per_round": 6},
            system={"profiles": "constant", "stragglers": 0.5, "straggler_policy": "partial"},
        )
        sim = Simulation(cfg)
        sim.run()
        return sim, lines(sim)

    seq, seq_lines = run("sequential")
    bat, bat_lines = run("batched")
    assert bat.executor.last_phase_batched
    for a, b in zip(seq_lines, bat_lines, strict=True):
        assert a["clients/steps/mean"] == b["clients/steps/mean"] and a["sim/time"] == b["sim/time"]
        assert a["sim/partial"] == b["sim/partial"] and a["sim/partial"] > 0
    p_seq = read_checkpoint(seq.checkpoint_path)["algo"]["global_params"]
    p_bat = read_checkpoint(bat.checkpoint_path)["algo"]["global_params"]
    assert torch.allclose(p_seq, p_bat, atol=1e-5)


@pytest.mark.slow
def test_worker_processes_honour_the_step_budgets(tiny_config):
    """The budget travels in the message to a worker process: the same bits as in-process clients."""

    def run(workers):
        cfg = tiny_config(run={"rounds": 2, "name": f"w{workers}", "workers": workers}, system=SYSTEM)
        sim = Simulation(cfg)
        sim.run()
        return lines(sim), read_checkpoint(sim.checkpoint_path)["algo"]["global_params"]

    (one, p_one), (two, p_two) = run(1), run(2)
    assert one == two and torch.equal(p_one, p_two)
    assert any(r["sim/partial"] for r in one)


@pytest.mark.parametrize(
    ("system", "server", "words"),
    [
        ({"dropout": 1.0}, {}, "(run.max_empty_rounds=3); why: 9 updates lost to system.dropout=1"),
        ({"stragglers": 1.0}, {}, "why: 9 stragglers dropped (system.stragglers=1, straggler_policy='drop')"),
        (
            {"dropout": 1.0},
            {"name": "sgd", "mode": "fedbuff", "buffer_size": 2, "concurrency": 3},
            "none of the last 6 client updates reached the server (run.max_empty_rounds x server.buffer_size) during "
            "server step 1; why: 6 updates lost to system.dropout=1",
        ),
    ],
)
def test_a_run_that_loses_every_update_to_the_system_model_says_so(tiny_config, system, server, words):
    """No failures.jsonl is written (no client erred), and the error points at none."""
    sim = build_simulation(
        tiny_config(system={"profiles": "constant", **system}, **({"server": server} if server else {}))
    )
    with pytest.raises(RunFailed) as err:
        sim.run()
    assert words in str(err.value) and "failures.jsonl" not in str(err.value), str(err.value)
    assert not (sim.run_dir / "failures.jsonl").exists()


def test_empty_rounds_say_what_took_the_updates():
    from fedhet.engine.health import RunHealth, describe_losses

    cfg = build_config({"run": {"rounds": 5, "max_empty_rounds": 2}})
    health = RunHealth(cfg, None, None)
    health.record_round(1, ["train"], {"updates lost to system.dropout=0.5": 2})
    health.record_round(2, [], {})  # a round that trained: the count starts again
    health.record_round(3, ["train"], {"updates lost to system.dropout=0.5": 1, "clients failed while training": 1})
    with pytest.raises(RunFailed) as err:
        health.record_round(4, ["train"], {"clients failed while training": 2})
    assert str(err.value).endswith(
        "(run.max_empty_rounds=2); why: 1 updates lost to system.dropout=0.5, 3 clients failed while training"
    )
    assert describe_losses({}) == "why: no client was sampled"


def test_without_a_system_model_nothing_changes(tiny_config):
    sim = Simulation(tiny_config(run={"rounds": 1}))
    sim.run()
    assert sim.system is None
    assert not any(key.startswith("sim/") for key in lines(sim)[0])
    assert "system" not in read_checkpoint(sim.checkpoint_path)


COMPOSE = {"profiles": "uniform", "stragglers": 0.5, "straggler_policy": "partial", "dropout": 0.2}


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", __import__("fedhet.algorithms", fromlist=["ALGORITHMS"]).ALGORITHMS.names())
def test_every_algorithm_takes_the_system_model_or_refuses_it_in_one_line(tiny_config, algorithm):
    params = {"pfedme": {"inner_steps": 2}}.get(algorithm, {})
    cfg = tiny_config(
        run={"rounds": 2, "name": algorithm},
        partition={"local_test_fraction": 0.2},
        train={"clients_per_round": 4},
        algorithm={"name": algorithm, **params},
        system={**COMPOSE, "over_selection": 0.5},
    )
    try:
        resolve_config(cfg)
    except ConfigError as err:
        assert algorithm == "centralized" and "\n" not in str(err)
        return
    sim = Simulation(cfg)
    assert sim.run()["status"] == "finished"
    assert all("sim/time" in r for r in lines(sim))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("server", "privacy"),
    [
        ({"name": "fedadam", "lr": 0.01}, {}),
        ({"name": "sgd", "aggregation": "median"}, {}),
        ({"name": "sgd", "aggregation": "krum", "byzantine": 0}, {}),
        ({"name": "sgd"}, {"mode": "central", "noise_multiplier": 0.5, "clip": 1.0}),
        ({"name": "sgd"}, {"mode": "local", "noise_multiplier": 0.5, "clip": 1.0}),
    ],
)
def test_server_optimisers_robust_rules_and_dp_take_the_system_model(tiny_config, server, privacy):
    cfg = tiny_config(
        run={"rounds": 2},
        train={"clients_per_round": 4},
        server=server,
        **({"privacy": privacy} if privacy else {}),
        system=COMPOSE,
    )
    sim = Simulation(cfg)
    summary = sim.run()
    assert summary["status"] == "finished"
    if privacy.get("mode") == "local":  # the ledger counts the steps each client really trained
        ledger = sim.algo.privacy.steps
        assert sum(steps for _, steps in ledger.values()) == sum(
            r["clients/steps/mean"] * r["clients"] for r in lines(sim)
        )


def test_report_plots_against_simulated_time(tiny_config, tmp_path):
    from typer.testing import CliRunner

    from fedhet.cli import app
    from fedhet.results.plots import seed_curve
    from fedhet.results.report import load_runs

    sims = []
    for seed in (0, 1):
        sim = Simulation(tiny_config(run={"rounds": 3, "seed": seed}, system={"profiles": "lognormal"}))
        sim.run()
        sims.append(sim)
    runs = load_runs([sims[0].run_dir.parent])
    x, mean, _ = seed_curve(runs, "test_acc", x="sim/time")
    times = [[r["sim/time"] for r in lines(s)] for s in sims]
    assert x.tolist() == pytest.approx([(a + b) / 2 for a, b in zip(*times, strict=True)])  # the seeds' mean
    acc = [[r["test_acc"] for r in lines(s)] for s in sims]
    assert mean.tolist() == pytest.approx([(a + b) / 2 for a, b in zip(*acc, strict=True)])
    rounds, _, _ = seed_curve(runs, "test_acc")
    assert rounds.tolist() == [1, 2, 3]
    runner = CliRunner()
    out = runner.invoke(
        app, ["report", str(sims[0].run_dir.parent), "--x", "sim/time", "--plot", str(tmp_path / "t.png")]
    )
    assert out.exit_code == 0 and (tmp_path / "t.png").stat().st_size > 0
    bad = runner.invoke(app, ["report", str(sims[0].run_dir.parent), "--x", "time"])
    # a ConfigError: the command line prints it as one line and exits 2
    assert isinstance(bad.exception, ConfigError)
    assert str(bad.exception) == "unknown --x 'time'; choose one of: round, sim/time"

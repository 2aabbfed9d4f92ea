"""clients.jsonl (each round's sampled clients and, with [system], their plans) and system_profiles.json (the
clients' profiles): a round's simulated time and late count are recomputed from these files alone and compared with
metrics.jsonl; after a kill mid-round and a resume the file holds each round once, as an uninterrupted run's does."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from fedhet.engine.simulation import Simulation
from fedhet.results.store import read_metrics

SYSTEM = {
    "profiles": "lognormal",
    "spread": 1.0,
    "latency": 0.01,
    "stragglers": 0.2,
    "straggler_policy": "drop",
    "dropout": 0.15,
    "availability": "bernoulli",
    "online": 0.9,
    "over_selection": 1.0,
}


def system_config(tiny_config, name, **run):
    """10 clients, 3 a round, 6 asked; the deadline at the 70th percentile of the clients' full-work arrivals, so
    some rounds have late clients and end at the deadline, and others end at their third reply."""
    clients = {"partition": {"num_clients": 10}, "train": {"clients_per_round": 3}}
    probe = Simulation(tiny_config(run={"name": "probe"}, system=SYSTEM, **clients))
    arrivals = [probe.system.arrival(c, full) for c, full in enumerate(probe.system.full)]
    deadline = float(np.quantile(arrivals, 0.7))
    return tiny_config(run={"name": name, "rounds": 6, **run}, system={**SYSTEM, "deadline": deadline}, **clients)


def read_lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def recompute_round(profiles: dict, line: dict, deadline: float) -> tuple[int, float, list[str]]:
    """(late clients, the round's duration, each sampled client's fate) from system_profiles.json and the round's
    line of clients.jsonl, by the rules of docs/system-heterogeneity.md (straggler_policy "drop")."""
    by_client = {c["client"]: c for c in profiles["clients"]}
    batch, target = profiles["batch_size"], profiles["clients_per_round"]
    fates, arrivals = {}, {}
    for entry in line["clients"]:
        cid, steps, client = entry["client"], entry["steps"], by_client[entry["client"]]
        per_pass = math.ceil(client["samples"] / batch)
        processed = (steps // per_pass) * client["samples"] + (steps % per_pass) * batch
        transfer = profiles["phases"] * (2 * profiles["model_bytes"] / client["bandwidth"] + profiles["latency"])
        arrivals[cid] = processed / client["speed"] + transfer
        assert math.isclose(arrivals[cid], entry["arrival"], rel_tol=1e-12)
        assert entry["full"] == client["full_steps"] and (entry["straggler"] or steps == entry["full"])
        if entry["straggler"]:
            fates[cid] = "straggler"  # dropped, whenever it would have arrived
        elif arrivals[cid] > deadline:
            fates[cid] = "late"
        else:  # whether it failed after training is a random draw: only the file knows
            fates[cid] = "failed" if entry["status"] == "failed" else "arrived"
    arrived = sorted((arrivals[c], c) for c, fate in fates.items() if fate == "arrived")
    for i, (_, cid) in enumerate(arrived):
        fates[cid] = "kept" if i < target else "surplus"
    waited = [arrival for arrival, _ in arrived[:target]]
    if len(waited) < target:  # short of clients: the server waited for the failed and the late until the deadline
        waited += [deadline for fate in fates.values() if fate in ("failed", "late")]
    late = sum(fate == "late" for fate in fates.values())
    return late, max(waited, default=0.0), [fates[e["client"]] for e in line["clients"]]


def test_round_times_and_late_counts_are_recomputed_from_the_run_files(tiny_config):
    sim = Simulation(system_config(tiny_config, "audit"))
    sim.run()
    folder, deadline = sim.run_dir, sim.cfg.system.deadline
    profiles = json.loads((folder / "system_profiles.json").read_text())
    lines = read_lines(folder / "clients.jsonl")
    records = read_metrics(folder / "metrics.jsonl")
    assert [line["round"] for line in lines] == [r["round"] for r in records] == list(range(1, 7))
    clock, late_total, durations = 0.0, 0, []
    for line, record in zip(lines, records, strict=True):
        late, duration, fates = recompute_round(profiles, line, deadline)
        assert fates == [entry["status"] for entry in line["clients"]]
        assert late == record["sim/late"] and len(line["sampled"]) == record["sim/sampled"]
        assert line["online"] == record["sim/online"] and math.isclose(line["start"], clock, rel_tol=1e-12)
        assert math.isclose(duration, record["sim/round_time"], rel_tol=1e-12)
        clock += duration
        assert math.isclose(clock, record["sim/time"], rel_tol=1e-12)
        late_total, durations = late_total + late, [*durations, duration]
    # the deadline bit, some rounds waited until it and others ended at their third reply, every fate happened
    assert late_total > 0 and deadline in durations and min(durations) < deadline
    assert {entry["status"] for line in lines for entry in line["clients"]} == {
        "kept", "straggler", "late", "failed", "surplus"
    }  # fmt: skip
    assert [c["client"] for c in profiles["clients"]] == list(range(sim.fed.num_clients))


def test_without_a_system_model_each_round_lists_the_clients_the_sampler_drew(tiny_config):
    sim = Simulation(tiny_config(run={"name": "plain", "rounds": 3}))
    sim.run()
    lines = read_lines(sim.run_dir / "clients.jsonl")
    assert lines == [{"round": r, "sampled": sim.sampler.sample(r)} for r in (1, 2, 3)]
    assert [r["clients"] for r in read_metrics(sim.run_dir / "metrics.jsonl")] == [3, 3, 3]
    assert not (sim.run_dir / "system_profiles.json").exists()


@pytest.mark.parametrize("system", [False, True])
def test_a_run_killed_mid_round_and_resumed_has_each_round_once(tiny_config, system):
    def make(name):
        if system:
            return system_config(tiny_config, name, checkpoint_every=2)
        return tiny_config(run={"name": name, "rounds": 6, "checkpoint_every": 2})

    full = Simulation(make("full"))
    full.run()
    cut = Simulation(make("cut"))
    run_phase = cut.run_phase

    def killed_in_round_5(rnd, *args):
        if rnd == 5:  # round 5's line is written; the last checkpoint is round 4's
            raise KeyboardInterrupt
        return run_phase(rnd, *args)

    cut.run_phase = killed_in_round_5
    with pytest.raises(KeyboardInterrupt):
        cut.run()
    assert [line["round"] for line in read_lines(cut.run_dir / "clients.jsonl")] == [1, 2, 3, 4, 5]
    Simulation(make("cut")).run(resume=True)
    assert read_lines(cut.run_dir / "clients.jsonl") == read_lines(full.run_dir / "clients.jsonl")
    assert [line["round"] for line in read_lines(full.run_dir / "clients.jsonl")] == list(range(1, 7))
    if system:
        profiles = [json.loads((s.run_dir / "system_profiles.json").read_text()) for s in (full, cut)]
        assert profiles[0] == profiles[1]

"""The simulation engine: learning, determinism, resume, failures, evaluation protocols."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fedhet.engine.checkpoint import read_checkpoint
from fedhet.engine.simulation import Simulation, config_changes
from fedhet.errors import ConfigError
from fedhet.results.store import read_metrics

STABLE = (
    "round",
    "test_acc",
    "test_loss",
    "train_loss",
    "client_dist_acc",
    "client_acc_mean",
    "test_acc_ema",
)


def stable(records):
    return [{k: r[k] for k in STABLE if k in r} for r in records]


def test_fedavg_learns_on_digits(tiny_config):
    cfg = tiny_config(run={"rounds": 8, "progress": False}, train={"participation": 1.0, "lr": 0.1})
    sim = Simulation(cfg)
    summary = sim.run()
    accs = [r["test_acc"] for r in read_metrics(sim.run_dir / "metrics.jsonl")]
    assert summary["final"]["test_acc"] > 0.85, summary["final"]
    assert accs[-1] > accs[0] + 0.2
    assert summary["status"] == "finished" and summary["rounds_done"] == 8


def test_same_seed_same_metrics_whatever_the_client_order(tiny_config):
    a = Simulation(tiny_config(run={"name": "a"}))
    a.run()
    b = Simulation(tiny_config(run={"name": "b"}))
    b.executor.order = lambda cids: list(reversed(cids))
    b.run()
    ra, rb = read_metrics(a.run_dir / "metrics.jsonl"), read_metrics(b.run_dir / "metrics.jsonl")
    assert stable(ra) == stable(rb)
    torch.testing.assert_close(a.algo.global_params, b.algo.global_params, rtol=0, atol=0)


def test_different_seed_changes_the_run(tiny_config):
    a = Simulation(tiny_config(run={"name": "a", "seed": 0}))
    b = Simulation(tiny_config(run={"name": "b", "seed": 1}))
    a.run(), b.run()
    assert not torch.equal(a.algo.global_params, b.algo.global_params)


@pytest.mark.parametrize("server", [{"name": "sgd"}, {"name": "fedadam", "lr": 0.01}])
def test_kill_and_resume_is_bit_exact(tiny_config, kill_and_resume, server):
    algo = {"name": "fedprox", "mu": 0.1}
    full, resumed = kill_and_resume(
        lambda name: tiny_config(run={"name": name, "rounds": 4}, algorithm=algo, server=server)
    )
    assert json.loads((resumed.run_dir / "summary.json").read_text())["rounds_done"] == 4
    r_full = read_metrics(full.run_dir / "metrics.jsonl")
    r_cut = read_metrics(resumed.run_dir / "metrics.jsonl")
    assert stable(r_full) == stable(r_cut)
    torch.testing.assert_close(full.algo.global_params, resumed.algo.global_params, rtol=0, atol=0)
    elapsed = [r["elapsed_s"] for r in r_cut]  # the training time so far: it goes on across the resume
    assert elapsed == sorted(elapsed)


def test_crash_between_metrics_and_checkpoint_resumes_cleanly(tiny_config):
    cfg = tiny_config(run={"name": "x", "rounds": 4})
    sim = Simulation(cfg)
    real_save = sim.save_checkpoint

    def crash_at_3(rnd, wall):
        if rnd == 3:
            raise KeyboardInterrupt  # killed after round 3's metrics line, before its checkpoint
        real_save(rnd, wall)

    sim.save_checkpoint = crash_at_3
    with pytest.raises(KeyboardInterrupt):
        sim.run()
    assert read_checkpoint(sim.checkpoint_path)["round"] == 2
    assert [r["round"] for r in read_metrics(sim.run_dir / "metrics.jsonl")] == [1, 2, 3]
    resumed = Simulation(cfg)
    resumed.run(resume=True)
    assert [r["round"] for r in read_metrics(resumed.run_dir / "metrics.jsonl")] == [1, 2, 3, 4]
    reference = Simulation(tiny_config(run={"name": "ref", "rounds": 4}))
    reference.run()
    assert stable(read_metrics(reference.run_dir / "metrics.jsonl")) == stable(
        read_metrics(resumed.run_dir / "metrics.jsonl")
    )


def test_existing_run_folder_needs_resume_or_overwrite(tiny_config):
    cfg = tiny_config(run={"name": "dup", "rounds": 1})
    Simulation(cfg).run()
    with pytest.raises(ConfigError, match="--resume"):
        Simulation(cfg).run()
    Simulation(cfg).run(overwrite=True)


def test_resume_with_a_changed_config_is_refused(tiny_config):
    Simulation(tiny_config(run={"name": "r", "rounds": 2})).run(stop_after=1)
    changed = tiny_config(run={"name": "r", "rounds": 2}, train={"lr": 0.5})
    with pytest.raises(ConfigError, match=r"differs from this one in train\.lr: 0\.1 -> 0\.5"):
        Simulation(changed).run(resume=True)


def test_a_parameter_added_after_the_run_was_saved_resumes_at_its_default():
    saved = {"algorithm": {"name": "feddyn", "alpha": 0.01, "alpha_scaling": "none"}, "server": {"name": "fedadam"}}
    current = {
        "algorithm": {"name": "feddyn", "alpha": 0.01, "alpha_scaling": "none", "evaluate": "server"},
        "server": {"name": "fedadam", "form": "reddi"},
    }
    assert config_changes(saved, current) == []  # keys the saved run lacks, at the values it ran with
    current["algorithm"]["evaluate"] = "average"
    current["server"]["form"] = "flower"
    assert config_changes(saved, current) == [
        "algorithm.evaluate: None -> 'average'",
        "server.form: None -> 'flower'",
    ]


def test_an_unset_partition_seed_equals_the_run_seed_on_resume():
    saved = {"run": {"seed": 3}, "partition": {"name": "dirichlet", "seed": None}}
    assert config_changes(saved, {"run": {"seed": 3}, "partition": {"name": "dirichlet", "seed": 3}}) == []
    assert config_changes(saved, {"run": {"seed": 3}, "partition": {"name": "dirichlet", "seed": 0}}) == [
        "partition.seed: 3 -> 0"
    ]


def test_a_finished_run_extended_to_more_rounds_equals_the_longer_run(tiny_config):
    Simulation(tiny_config(run={"name": "short", "rounds": 2})).run()
    extended = Simulation(tiny_config(run={"name": "short", "rounds": 4, "progress": False}))
    summary = extended.run(resume=True)
    assert summary["status"] == "finished" and summary["rounds_done"] == 4
    assert json.loads((extended.run_dir / "config.json").read_text())["run"]["rounds"] == 4  # report sees 4
    reference = Simulation(tiny_config(run={"name": "long", "rounds": 4}))
    reference.run()
    assert stable(read_metrics(reference.run_dir / "metrics.jsonl")) == stable(
        read_metrics(extended.run_dir / "metrics.jsonl")
    )
    torch.testing.assert_close(reference.algo.global_params, extended.algo.global_params, rtol=0, atol=0)


def test_failing_and_non_finite_clients_are_dropped_and_recorded(tiny_config):
    cfg = tiny_config(run={"name": "faulty", "rounds": 2}, train={"participation": 1.0})
    sim = Simulation(cfg)
    original = sim.algo.client_update

    def flaky(ctx):
        if ctx.cid == 1:
            raise RuntimeError("disk on fire")
        reply = original(ctx)
        if ctx.cid == 2:
            reply.tensors["params"][0] = float("nan")
        return reply

    sim.algo.client_update = flaky
    summary = sim.run()
    assert np.isfinite(summary["final"]["test_acc"])
    records = read_metrics(sim.run_dir / "metrics.jsonl")
    assert all(r["dropped"] == 2 and r["clients"] == 4 for r in records)
    failures = [json.loads(line) for line in (sim.run_dir / "failures.jsonl").read_text().splitlines()]
    assert {f["client"] for f in failures} == {1, 2}
    assert any("disk on fire" in f["error"] for f in failures)
    assert any("non-finite" in f["error"] for f in failures)
    assert torch.isfinite(sim.algo.global_params).all()


def test_evaluation_protocols_are_logged(tiny_config):
    cfg = tiny_config(run={"name": "ev", "rounds": 2}, partition={"local_test_fraction": 0.25})
    sim = Simulation(cfg)
    sim.run()
    rec = read_metrics(sim.run_dir / "metrics.jsonl")[-1]
    for key in (
        "test_acc",
        "test_loss",
        "client_dist_acc",
        "client_acc_mean",
        "client_acc_std",
        "client_acc_min",
        "client_acc_worst10",
        "acc_smallest_client",
        "acc_largest_client",
        "test_acc_ema",
    ):
        assert key in rec and np.isfinite(rec[key]), key
    assert rec["client_acc_min"] <= rec["client_acc_worst10"] <= rec["client_acc_mean"] <= rec["client_acc_max"]
    written = json.loads((sim.run_dir / "config.json").read_text())
    assert written["algorithm"] == {"name": "fedavg", "weighting": "samples"}  # defaults are filled in
    assert written["partition"]["alpha"] == 0.5


def test_lr_decays_per_round_for_every_algorithm(tiny_config):
    cfg = tiny_config(run={"name": "lr", "rounds": 3}, train={"lr": 0.1, "lr_decay": 0.5})
    sim = Simulation(cfg)
    sim.run()
    assert [r["lr"] for r in read_metrics(sim.run_dir / "metrics.jsonl")] == [0.1, 0.05, 0.025]


def test_client_sampling_is_seeded_and_sized(tiny_config):
    sim = Simulation(tiny_config(train={"clients_per_round": 2}))
    picks = [sim.sample_clients(r) for r in range(1, 6)]
    assert all(len(p) == 2 and p == sorted(set(p)) for p in picks)
    assert picks == [Simulation(tiny_config(train={"clients_per_round": 2})).sample_clients(r) for r in range(1, 6)]
    assert len({tuple(p) for p in picks}) > 1


def test_personalised_accuracy_covers_only_clients_that_trained(tiny_config):
    from fedhet.algorithms.fedavg import FedAvg

    class KeepLocal(FedAvg):
        """FedAvg whose personalised model is the client's last local model."""

        personalized = True

        def after_local(self, ctx):
            ctx.state["local"] = ctx.flat.get_params()
            return super().after_local(ctx)

        def personalize(self, ctx):
            return ctx.state.get("local")

    cfg = tiny_config(
        run={"name": "pers", "rounds": 1}, partition={"local_test_fraction": 0.25}, train={"clients_per_round": 2}
    )
    sim = Simulation(cfg)
    sim.algo.__class__ = KeepLocal
    sim.run()
    rec = read_metrics(sim.run_dir / "metrics.jsonl")[-1]
    assert rec["personal_clients"] == 2 and rec["personal_never_sampled"] == 4
    # micro = pooled correct / pooled total, recomputed here from the clients' own local models
    correct = total = 0
    for cid in sorted(sim.seen):
        sim.flat.set_params(sim.executor.store.get(cid)["local"])
        data = sim.fed.clients[cid]
        hits = (sim.model(data.x_test).argmax(1) == data.y_test).sum().item()
        correct, total = correct + hits, total + len(data.y_test)
    assert rec["personal_acc_micro"] == pytest.approx(correct / total)
    assert 0.0 <= rec["personal_acc_macro"] <= 1.0

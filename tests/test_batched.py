"""The batched executor against the sequential one: same replies to float tolerance, resume, failures, fallback.

Tolerance. Every per-client operation of the batched loop (hooks, clipping, the SGD update, batch order and
augmentation) is the sequential one on the client's row; only the vmapped forward/backward rounds differently.
Measured (1 torch thread, x86-64, the tests below): after 3 rounds of 6 clients with momentum 0.9, weight decay
and clipping, the largest global-parameter difference is 0.7-3.1e-7 of the largest parameter for every algorithm
(train loss: 1-5e-8 relative); one phase's replies differ by at most 5.4e-7 of their largest entry on the conv
nets, and are bit-identical on some MLP/logistic-regression cases. The tests allow 1e-5, a margin of about 20x.
"""

from __future__ import annotations

import json

import pytest
import torch

from fedhet.algorithms.fedacd import FedACD
from fedhet.engine.batched import (
    BatchedExecutor,
    _GroupData,
    algorithm_unbatchable,
    batching_pays_off,
    choose_executor,
    model_unbatchable,
)
from fedhet.engine.client import LocalExecutor
from fedhet.engine.simulation import Simulation
from fedhet.results.store import read_metrics

REL = 1e-5  # allowed difference, relative to the largest parameter / the value compared

ALGORITHMS = [
    {"name": "fedavg"},
    {"name": "fedprox", "mu": 0.1},
    {"name": "scaffold"},
    {"name": "feddyn", "alpha": 0.1},
    {"name": "feddyn", "alpha": 0.1, "alpha_scaling": "data_size"},
    {"name": "fednova", "mu": 0.01},
    {"name": "fedbc"},
    {"name": "fedper"},
    {"name": "fedper", "personal_layers": 2},
    {"name": "fedbabu"},
    {"name": "fedmtl", "lam": 0.5},
    {"name": "fedmtl", "lam": 0.01, "omega": "learned"},
    {"name": "fedmeta"},  # FedAvg's clients; the server's fine-tuning is the same on both executors
    # their own loss (algorithms/functional.py)
    {"name": "fedlc"},
    {"name": "fedntd", "beta": 0.5},
    {"name": "feddecorr"},
    {"name": "moon", "projection_dim": 16},
    {"name": "moon", "projection_dim": 16, "classifier": "projection", "pool_size": 2},
    {"name": "fedrcl", "variant": "official"},
    {"name": "fedrcl", "variant": "paper"},
    {"name": "fedbc_finetune"},
    {"name": "fedrod"},
    {"name": "fedrod", "personal_head": "hyper", "personal_optimizer": "shared"},
    # fixed classifiers as model buffers (fixed_buffers), after_local through the loaded row
    {"name": "fednh", "personal_eval": True},
    {"name": "fednh", "learn_scale": False, "weighting": "samples"},
    {"name": "spherefed"},  # the train phase batched, the calibration (its own client_update) sequential
    {"name": "spherefed", "loss": "ce", "ce_scale": 5.0, "calibrate": False},
    # loss inputs read per step (step_inputs): the mixup draw from each client's generator, P refreshed per epoch
    {"name": "fedacd"},
    {"name": "fedacd", "p_estimate": "clean_pass", "weighting": "uniform"},
    {"name": "fedacd", "p_init": "mixup", "l1_detach_target": True},
    {"name": "fedacd", "mixup": False},
]
# momentum and weight decay, unequal client sizes (Dirichlet), every client of the federation in the round
TRAIN = {"participation": 1.0, "momentum": 0.9, "weight_decay": 1e-3, "grad_clip": 2.0}


def run_both(tiny_config, run: dict | None = None, **sections) -> tuple[Simulation, Simulation]:
    sims = {}
    for executor in ("sequential", "batched"):
        sim = Simulation(
            tiny_config(run={"name": executor, "rounds": 3, "executor": executor, **(run or {})}, **sections)
        )
        sim.run()
        sims[executor] = sim
    seq, bat = sims["sequential"], sims["batched"]
    assert type(seq.executor) is LocalExecutor
    assert type(bat.executor) is BatchedExecutor
    expected = {phase: phase != "calibrate" for phase in bat.algo.phases}  # SphereFed's calibration is sequential
    assert bat.executor.phase_batched == expected
    return seq, bat


def assert_close_runs(seq: Simulation, bat: Simulation) -> float:
    """Metrics and final global model equal within the tolerance; returns the largest parameter difference."""
    scale = float(seq.algo.global_params.abs().max())
    diff = float((seq.algo.global_params - bat.algo.global_params).abs().max())
    assert diff <= REL * scale, (diff, scale)
    r_seq, r_bat = (read_metrics(s.run_dir / "metrics.jsonl") for s in (seq, bat))
    assert len(r_seq) == len(r_bat) == 3
    n_test = len(seq.fed.y_test)
    for a, b in zip(r_seq, r_bat, strict=True):
        assert a["clients"] == b["clients"] and a["dropped"] == b["dropped"] == 0
        for key in ("train_loss", "test_loss", *(k for k in a if k.startswith("clients/"))):  # replies' metrics too
            assert b[key] == pytest.approx(a[key], rel=REL, abs=1e-12), key
        assert abs(a["test_acc"] - b["test_acc"]) <= 1 / n_test + 1e-12  # at most one test sample on a near-tie
    return diff


@pytest.mark.parametrize("algorithm", ALGORITHMS, ids=lambda a: "-".join(str(v) for v in a.values()))
def test_batched_matches_sequential(tiny_config, algorithm, monkeypatch):
    vmapped = []  # an algorithm with its own loss: its full batches went through the vmapped call
    stack = BatchedExecutor._loss_inputs
    monkeypatch.setattr(BatchedExecutor, "_loss_inputs", lambda self, ks, m: vmapped.append(ks) or stack(self, ks, m))
    seq, bat = run_both(tiny_config, train=TRAIN, algorithm=dict(algorithm))
    assert_close_runs(seq, bat)
    assert bool(vmapped) == bat.executor._own_loss
    # client-held state (SCAFFOLD's c_i, FedDyn's gradient state, FedBC's local model) agrees too
    states_seq, states_bat = dict(seq.executor.store.items()), dict(bat.executor.store.items())
    assert states_seq.keys() == states_bat.keys()
    for cid, state in states_seq.items():
        for name, t in state.items():
            scale = float(t.abs().max()) if t.numel() else 0.0  # MOON's prev_buffers: empty for a model without any
            torch.testing.assert_close(states_bat[cid][name], t, rtol=REL, atol=REL * scale)


@pytest.mark.parametrize(
    ("model", "train"),
    [
        ({"name": "mlp", "hidden": [32]}, {}),
        ({"name": "logreg"}, {"nesterov": True}),
        ({"name": "mlp", "hidden": [32]}, {"augment": "crop_flip", "momentum": 0.5}),  # the same augmented batches
        ({"name": "convnet", "channels": [8, 16], "hidden": 32}, {"local_epochs": 2}),
        ({"name": "convnet", "channels": [8, 16], "hidden": 0}, {"grad_clip": 0.5, "batch_size": 7}),
    ],
    ids=["mlp", "logreg-nesterov", "mlp-augment", "convnet-2-epochs", "convnet-clip-odd-batch"],
)
def test_replies_are_the_sequential_replies(tiny_config, model, train):
    """One phase, client by client: every client's reply is the one the sequential executor gives.

    (A single phase, because through ReLU and max-pooling a last-bit difference can flip which input a gradient
    flows to; the sequential run itself then diverges the same way from a copy whose start differs by one ulp.)"""
    sim = Simulation(tiny_config(model=model, train={**TRAIN, **train}, algorithm={"name": "scaffold"}))
    runner = sim.executor.runner
    sim.algo.c = torch.randn(sim.flat.num_params, generator=torch.Generator().manual_seed(0)) * 0.01
    msgs = sim.algo.configure(1, list(range(sim.fed.num_clients)), "train")
    seq, _ = LocalExecutor(runner, sim.fed.clients).run_phase(1, 0, "train", msgs)
    batched = BatchedExecutor(runner, sim.fed.clients, max_group=4)  # two groups
    bat, failures = batched.run_phase(1, 0, "train", msgs)
    assert batched.last_phase_batched and not failures and seq.keys() == bat.keys()
    assert len({r.metrics["steps"] for r in seq.values()}) > 1  # unequal client sizes: unequal step counts
    for cid, reply in seq.items():
        assert bat[cid].num_examples == reply.num_examples
        assert bat[cid].metrics["steps"] == reply.metrics["steps"]
        assert bat[cid].metrics["train_loss"] == pytest.approx(reply.metrics["train_loss"], rel=REL)
        for name, t in reply.tensors.items():
            torch.testing.assert_close(bat[cid].tensors[name], t, rtol=REL, atol=REL * float(t.abs().max()))


@pytest.mark.parametrize(
    "algorithm",
    [{"name": "scaffold"}, {"name": "moon", "projection_dim": 16}, {"name": "fedacd"}],
    ids=["scaffold", "moon-own-loss", "fedacd-draws-per-step"],
)
def test_gathering_a_step_at_once_is_loading_client_by_client(tiny_config, algorithm, monkeypatch):
    """The group's batches of a step gathered at once (``_GroupData``: one index copy, one gather for inputs and
    one for labels) give exactly, bit for bit, the replies and states of loading them client by client: the same
    samples, the same draws from each client's generator in the same order (FedACD draws its Mixup partners per
    step from it), short last batches and a client dropped in the middle of the phase included."""
    model = {"name": "convnet", "channels": [8, 16], "hidden": 32}
    train = {**TRAIN, "batch_size": 7, "local_epochs": 2}
    sim = Simulation(tiny_config(model=model, train=train, algorithm=algorithm))
    runner, clients = sim.executor.runner, sim.fed.clients
    original = type(sim.algo).after_backward

    def faulty(ctx):
        original(sim.algo, ctx)
        if ctx.cid == 2 and ctx.steps == 3:
            raise RuntimeError("disk on fire")

    sim.algo.after_backward = faulty
    msgs = sim.algo.configure(1, list(range(sim.fed.num_clients)), "train")
    gathered = BatchedExecutor(runner, clients, max_group=4)
    fused, failures = gathered.run_phase(1, 0, "train", msgs)
    monkeypatch.setattr(_GroupData, "build", classmethod(lambda cls, members, device: None))
    one_by_one = BatchedExecutor(runner, clients, max_group=4)
    loaded, failures_loaded = one_by_one.run_phase(1, 0, "train", msgs)
    assert gathered.last_phase_batched and one_by_one.last_phase_batched
    assert [f["client"] for f in failures] == [f["client"] for f in failures_loaded] == [2]
    assert fused.keys() == loaded.keys() and len(fused) == sim.fed.num_clients - 1
    for cid, reply in loaded.items():
        assert fused[cid].metrics == reply.metrics
        for name, t in reply.tensors.items():
            assert torch.equal(fused[cid].tensors[name], t), (cid, name)
    for (cid, state), (cid2, state2) in zip(gathered.store.items(), one_by_one.store.items(), strict=True):
        assert cid == cid2 and all(torch.equal(state[n], state2[n]) for n in state2)


def one_phase(sim: Simulation, **executor) -> tuple[dict, list]:
    msgs = sim.algo.configure(1, list(range(sim.fed.num_clients)), "train")
    return BatchedExecutor(sim.executor.runner, sim.fed.clients, **executor).run_phase(1, 0, "train", msgs)


@pytest.mark.parametrize(
    ("model", "algorithm"),
    [
        ({"name": "convnet", "channels": [8, 16], "hidden": 32}, {"name": "scaffold"}),
        ({"name": "mlp", "hidden": [32]}, {"name": "moon", "projection_dim": 16}),  # its own loss, extra outputs
    ],
    ids=["convnet-scaffold", "mlp-moon"],
)
def test_the_compiled_step_traces_the_same_computation(tiny_config, model, algorithm, monkeypatch):
    """run.compile: the vmapped step goes through torch.compile (here its graph capture with the same kernels,
    backend "aot_eager", since the CPU's code generation takes minutes) and gives the uncompiled replies bit for
    bit, compiled at most twice (a fixed, then a dynamic count of active rows); "off" compiles nothing."""
    import torch._dynamo

    from fedhet.toolkit import compiled as compiled_module

    monkeypatch.setattr(compiled_module, "COMPILE_BACKEND", "aot_eager")
    sim = Simulation(tiny_config(model=model, train={**TRAIN, "batch_size": 7}, algorithm=algorithm))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    plain, _ = one_phase(sim, max_group=4)
    assert not torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled, failures = one_phase(sim, max_group=4, compile_mode="reduce-overhead")  # no CUDA graphs on a CPU
    assert not failures and compiled.keys() == plain.keys()
    assert 1 <= torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 2
    for cid, reply in plain.items():
        assert compiled[cid].metrics == reply.metrics
        for name, t in reply.tensors.items():
            assert torch.equal(compiled[cid].tensors[name], t), (cid, name)


def test_a_failing_compiled_step_runs_uncompiled_after_one_warning(tiny_config, failing_compile):
    sim = Simulation(tiny_config(train=TRAIN))
    plain, _ = one_phase(sim, max_group=4)
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler here.*runs uncompiled") as caught:
        compiled, failures = one_phase(sim, max_group=4, compile_mode="default")
    assert len(caught) == 1 and not failures  # once, not once per step
    for cid, reply in plain.items():
        assert torch.equal(compiled[cid].tensors["params"], reply.tensors["params"])


def test_per_client_messages_and_unreadable_state(tiny_config):
    """Messages with different learning rates train each row at its own rate; a client whose stored state cannot be
    read, or whose before_local raises, is dropped like by the sequential executor, the others are unaffected."""
    from fedhet.algorithms.base import Message

    sim = Simulation(tiny_config(train=TRAIN, algorithm={"name": "fedprox", "mu": 0.1}))
    runner, n = sim.executor.runner, sim.fed.num_clients
    base = sim.algo.global_message(1)
    msgs = {cid: Message(base.tensors, {**base.scalars, "lr": 0.02 * (cid + 1)}) for cid in range(n)}
    real_get = sim.executor.store.get
    sim.executor.store.get = lambda cid: (_ for _ in ()).throw(OSError("bad file")) if cid == 2 else real_get(cid)
    real_before = sim.algo.before_local

    def before_local(ctx):
        if ctx.cid == 5:
            raise ValueError("no")
        real_before(ctx)

    sim.algo.before_local = before_local
    seq, f_seq = LocalExecutor(runner, sim.fed.clients, sim.executor.store).run_phase(1, 0, "train", msgs)
    bat, f_bat = BatchedExecutor(runner, sim.fed.clients, sim.executor.store).run_phase(1, 0, "train", msgs)
    assert [f["client"] for f in f_seq] == [f["client"] for f in f_bat] == [2, 5]
    assert seq.keys() == bat.keys() == {0, 1, 3, 4}
    for cid, reply in seq.items():
        t = reply.tensors["params"]
        torch.testing.assert_close(bat[cid].tensors["params"], t, rtol=REL, atol=REL * float(t.abs().max()))


def test_kill_and_resume_is_bit_exact(tiny_config, kill_and_resume):
    algo = {"name": "scaffold"}
    full, resumed = kill_and_resume(
        lambda name: tiny_config(run={"name": name, "rounds": 3, "executor": "batched"}, train=TRAIN, algorithm=algo),
        stop_after=1,
    )
    assert type(full.executor) is BatchedExecutor and type(resumed.executor) is BatchedExecutor
    keys = ("round", "test_acc", "test_loss", "train_loss", "c_norm")
    r_full, r_cut = (read_metrics(s.run_dir / "metrics.jsonl") for s in (full, resumed))
    assert [{k: r[k] for k in keys} for r in r_full] == [{k: r[k] for k in keys} for r in r_cut]
    torch.testing.assert_close(full.algo.global_params, resumed.algo.global_params, rtol=0, atol=0)
    torch.testing.assert_close(full.algo.c, resumed.algo.c, rtol=0, atol=0)


def test_resuming_with_another_executor_warns(tiny_config, capsys):
    Simulation(tiny_config(run={"name": "r", "rounds": 2, "executor": "batched"})).run(stop_after=1)
    from rich.console import Console

    console = Console(stderr=True, width=400)
    Simulation(tiny_config(run={"name": "r", "rounds": 2, "executor": "sequential"}), console=console).run(resume=True)
    err = capsys.readouterr().err
    assert "trained batched and now train sequential" in err and "not match an uninterrupted run bit for bit" in err


def test_a_resume_names_every_rounding_change_in_one_warning(tiny_config, capsys):
    """Another executor and another processor (as provenance.json records it): one warning names both."""
    first = Simulation(tiny_config(run={"name": "m", "rounds": 2, "executor": "batched"}))
    first.run(stop_after=1)
    path = first.run_dir / "provenance.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "cpu": "Some Other CPU"}))
    from rich.console import Console

    console = Console(stderr=True, width=1000)
    Simulation(tiny_config(run={"name": "m", "rounds": 2, "executor": "sequential"}), console=console).run(resume=True)
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, warnings
    assert "trained batched and now train sequential" in warnings[0]
    assert "it continues on cpu: Some Other CPU -> " in warnings[0]
    assert warnings[0].endswith("not match an uninterrupted run bit for bit")


def test_failing_and_non_finite_clients_are_dropped_with_state_untouched(tiny_config):
    """A client whose hook raises, or whose model turns non-finite, is dropped and recorded, its stored state is
    left as it was, and the other clients of the same batched computation are unaffected."""
    sims = {}
    for executor in ("sequential", "batched"):
        run = {"name": executor, "rounds": 2, "executor": executor}
        sim = Simulation(tiny_config(run=run, train=TRAIN, algorithm={"name": "scaffold"}))
        original = sim.algo.after_backward

        def faulty(ctx, original=original):
            original(ctx)
            if ctx.round == 2 and ctx.cid == 1 and ctx.steps == 2:
                raise RuntimeError("disk on fire")
            if ctx.round == 2 and ctx.cid == 4:
                ctx.flat.grad[0] = float("nan")  # its model, reply and c_i turn non-finite

        sim.algo.after_backward = faulty  # an instance hook: the batched executor calls it on each row
        sim.run(stop_after=1)
        before = {cid: {k: v.clone() for k, v in s.items()} for cid, s in sim.executor.store.items()}
        sim.run(resume=True)
        sims[executor] = (sim, before)
    for executor, (sim, before) in sims.items():
        records = read_metrics(sim.run_dir / "metrics.jsonl")
        assert (records[-1]["clients"], records[-1]["dropped"]) == (4, 2), executor
        failures = [json.loads(line) for line in (sim.run_dir / "failures.jsonl").read_text().splitlines()]
        assert [f["client"] for f in failures] == [1, 4]
        assert "disk on fire" in failures[0]["error"] and "non-finite" in failures[1]["error"]
        for cid in (1, 4):  # state from round 1, untouched
            after = dict(sim.executor.store.items())[cid]
            for name, t in before[cid].items():
                torch.testing.assert_close(after[name], t, rtol=0, atol=0)
        assert torch.isfinite(sim.algo.global_params).all()
    seq, bat = sims["sequential"][0], sims["batched"][0]
    assert type(bat.executor) is BatchedExecutor
    scale = float(seq.algo.global_params.abs().max())
    assert float((seq.algo.global_params - bat.algo.global_params).abs().max()) <= REL * scale


def test_unsupported_algorithms_and_models_fall_back_to_sequential(tiny_config, capsys):
    fml = Simulation(tiny_config(run={"name": "fml", "executor": "batched"}, algorithm={"name": "fml"}))
    assert type(fml.executor) is LocalExecutor
    reason = algorithm_unbatchable(fml.algo)
    assert reason.startswith("algorithm 'fml' ") and reason in capsys.readouterr().err
    dropout = Simulation(tiny_config(run={"name": "drop"}, model={"name": "mlp", "hidden": [32], "dropout": 0.5}))
    assert "dropout" in model_unbatchable(dropout.flat)
    assert choose_executor(dropout.cfg, dropout.executor.runner)[0] == "sequential"
    batchnorm = Simulation(
        tiny_config(run={"name": "bn"}, model={"name": "resnet18", "norm": "batch", "width": 4}),
    )
    assert "buffers" in model_unbatchable(batchnorm.flat)


def test_batched_executor_runs_unsupported_phases_sequentially(tiny_config):
    """Handed an unsupported algorithm anyway, it gives the sequential executor's results bit for bit."""
    seq = Simulation(tiny_config(run={"name": "seq"}, algorithm={"name": "fml"}))
    seq.run()
    bat = Simulation(tiny_config(run={"name": "bat"}, algorithm={"name": "fml"}))
    bat.executor = BatchedExecutor(bat.executor.runner, bat.fed.clients, bat.executor.store)
    bat.run()
    assert not bat.executor.last_phase_batched
    torch.testing.assert_close(bat.algo.global_params, seq.algo.global_params, rtol=0, atol=0)


def test_a_failing_batched_computation_runs_the_group_sequentially(tiny_config):
    seq = Simulation(tiny_config(run={"name": "seq", "executor": "sequential"}, train=TRAIN))
    seq.run()
    bat = Simulation(tiny_config(run={"name": "bat", "executor": "batched"}, train=TRAIN))

    def broken(*args, **kwargs):
        raise RuntimeError("vmap: no batching rule")

    bat.executor._grad_fn = broken
    with pytest.warns(RuntimeWarning, match="no batching rule"):
        bat.run()
    torch.testing.assert_close(bat.algo.global_params, seq.algo.global_params, rtol=0, atol=0)


def test_choose_executor(tiny_config):
    sim = Simulation(tiny_config(run={"executor": "sequential"}))
    assert choose_executor(sim.cfg, sim.executor.runner)[0] == "sequential"
    sim = Simulation(tiny_config(run={"executor": "batched"}))
    assert choose_executor(sim.cfg, sim.executor.runner)[0] == "batched"
    assert type(sim.executor) is BatchedExecutor


def test_auto_batches_only_where_it_was_measured_to_pay_off(tiny_config):
    """docs/performance.md: fully connected models with params x batch size <= 1e6 and >= 20 clients per round."""
    many = {"name": "dirichlet", "alpha": 0.5, "num_clients": 20, "min_size": 10}

    def executor(run=None, train=None, **sections):
        train = {"participation": 1.0, **(train or {})}
        sim = Simulation(tiny_config(run=run or {}, partition=many, train=train, **sections))
        kind = choose_executor(sim.cfg, sim.executor.runner)[0]
        assert type(sim.executor) is {"batched": BatchedExecutor, "sequential": LocalExecutor}[kind]
        return kind

    assert executor() == "batched"  # MLP 64-32-10 (2410 parameters), batch 16, 20 clients
    assert executor(model={"name": "logreg"}, train={"batch_size": 64}) == "batched"
    assert executor(run={"executor": "sequential"}) == "sequential"
    assert executor(train={"participation": 0.5}) == "sequential"  # 10 clients
    assert executor(model={"name": "convnet", "channels": [8, 16], "hidden": 32}) == "sequential"
    assert executor(model={"name": "mlp", "hidden": [200, 200]}, train={"batch_size": 64}) == "sequential"  # 3.5e6
    sim = Simulation(tiny_config())
    assert batching_pays_off(sim.flat, 16, 20, torch.device("cpu"))
    assert not batching_pays_off(sim.flat, 16, 19, torch.device("cpu"))
    assert not batching_pays_off(sim.flat, 16, 20, torch.device("mps"))  # not measured: sequential under auto
    # CUDA: measured on an H200, batched from 8 clients a round (tests/test_gpu_path.py)


def test_personalised_metrics_agree(tiny_config):
    seq, bat = run_both(tiny_config, partition={"local_test_fraction": 0.25}, train=TRAIN, algorithm={"name": "fedbc"})
    a, b = (read_metrics(s.run_dir / "metrics.jsonl")[-1] for s in (seq, bat))
    assert a["personal_clients"] == b["personal_clients"] > 0
    assert abs(a["personal_acc_micro"] - b["personal_acc_micro"]) <= 0.01


def test_every_algorithm_is_batchable_or_says_why_not(tiny_config):
    """Every registered algorithm either declares batchable or gives a one-line reason (``unbatchable_reason``)."""
    from fedhet.algorithms.base import ALGORITHMS

    for name in ALGORITHMS.names():
        cls = ALGORITHMS.get(name).obj
        if cls.__dict__.get("batchable", False):
            continue
        reason = getattr(cls, "unbatchable_reason", None)
        assert reason and "\n" not in reason and len(reason) <= 120, name
        assert algorithm_unbatchable(cls.__new__(cls)) == f"algorithm {name!r} {reason}"


@pytest.mark.parametrize("p_estimate", ["train_outputs", "clean_pass"])
def test_fedacd_refreshes_its_estimate_per_epoch_like_the_sequential_loop(tiny_config, p_estimate, monkeypatch):
    """Two local epochs: P is refreshed at the epoch boundary inside the round, from the accumulated training
    outputs or from a clean pass of the client's current row, and the later batches' loss inputs follow it."""
    refreshed = []
    original = FedACD.refresh_p
    monkeypatch.setattr(FedACD, "refresh_p", lambda self, ctx: refreshed.append(ctx.cid) or original(self, ctx))
    seq, bat = run_both(
        tiny_config, train={**TRAIN, "local_epochs": 2}, algorithm={"name": "fedacd", "p_estimate": p_estimate}
    )
    assert refreshed and len(refreshed) % 2 == 0  # every client of every round, once per executor
    assert_close_runs(seq, bat)


def test_fixed_buffers_are_shared_by_a_group_or_it_runs_sequentially(tiny_config, monkeypatch):
    """FedNH's prototypes (a ``fixed_buffers`` module) are loaded once per group from the messages; a group whose
    messages carry different buffers cannot share them and runs sequentially, with the sequential replies."""
    from fedhet.algorithms.contract import Message

    sim = Simulation(tiny_config(train={"participation": 1.0}, algorithm={"name": "fednh"}))
    assert model_unbatchable(sim.flat) is None and sim.flat.buffers.numel()
    runner = sim.executor.runner
    msgs = sim.algo.configure(1, list(range(sim.fed.num_clients)), "train")
    other = msgs[0].tensors["buffers"].flip(0)  # other prototypes for client 0
    msgs[0] = Message(tensors={**msgs[0].tensors, "buffers": other}, scalars=dict(msgs[0].scalars))
    seq, _ = LocalExecutor(runner, sim.fed.clients).run_phase(1, 0, "train", msgs)
    batched = BatchedExecutor(runner, sim.fed.clients, max_group=3)
    groups = []
    run_group = BatchedExecutor._run_group
    monkeypatch.setattr(BatchedExecutor, "_run_group", lambda self, *a: groups.append(set(a[3])) or run_group(self, *a))
    bat, failures = batched.run_phase(1, 0, "train", msgs)
    assert not failures and seq.keys() == bat.keys()
    assert len(groups) == 1 and 0 not in groups[0]  # client 0's group ran sequentially, the other was batched
    for cid, reply in seq.items():
        exact = cid not in groups[0]
        for name, t in reply.tensors.items():
            tol = 0.0 if exact else REL * float(t.abs().max())
            torch.testing.assert_close(bat[cid].tensors[name], t, rtol=0.0 if exact else REL, atol=tol)


def test_spherefed_batches_its_train_phase_only(tiny_config):
    sim = Simulation(tiny_config(run={"executor": "batched"}, algorithm={"name": "spherefed"}))
    assert algorithm_unbatchable(sim.algo) is None and algorithm_unbatchable(sim.algo, "train") is None
    reason = algorithm_unbatchable(sim.algo, "calibrate")
    assert reason == "algorithm 'spherefed' overrides client_update (batched phases: train)"

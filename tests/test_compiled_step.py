"""run.compile in the sequential loop: the gradient of the algorithm's ``loss`` through ``torch.compile``
(``algorithms.loop.CompiledGradient``) against ``local_loss`` and ``backward()`` as written.

The compiled tests use torch.compile's graph capture with the eager kernels (backend "aot_eager"): the CPU's code
generation takes minutes, and with the same kernels the replies must be the uncompiled ones bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from fedhet.engine.client import LocalExecutor
from fedhet.engine.simulation import Simulation
from fedhet.toolkit import compiled as compiled_module

BATCHNORM_MODEL = {"name": "cnn_bn", "channels": [4, 4, 8], "hidden": [16]}  # conftest's
TRAIN = {"batch_size": 7, "lr": 0.05, "momentum": 0.9}


def one_phase(sim: Simulation) -> tuple[dict, list]:
    msgs = sim.algo.configure(1, list(range(sim.fed.num_clients)), "train")
    executor = LocalExecutor(sim.executor.runner, sim.fed.clients)
    return executor.run_phase(1, 0, "train", msgs)


def assert_same_replies(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for cid, reply in expected.items():
        assert got[cid].metrics == reply.metrics, cid
        for name, t in reply.tensors.items():
            assert torch.equal(got[cid].tensors[name], t), (cid, name)


CONVNET = {"name": "convnet", "channels": [8, 16], "hidden": 32}


@pytest.mark.parametrize(
    ("model", "algorithm", "train"),
    [
        (CONVNET, {"name": "scaffold"}, {}),
        ({"name": "mlp", "hidden": [32]}, {"name": "moon", "projection_dim": 16}, {}),  # its own loss, extra outputs
        ({"name": "mlp", "hidden": [32]}, {"name": "fedrod"}, {}),  # two heads' losses summed, aux values read later
        (BATCHNORM_MODEL, {"name": "fedavg"}, {}),  # batch-norm statistics updated in place inside the compiled step
        # frozen base weights, and each client training the first lora_ranks[c] adapter slots
        ({"name": "mlp", "hidden": [32], "lora_rank": 2, "lora_ranks": [1, 2, 1, 2, 2, 1]}, {"name": "fedavg"}, {}),
        (CONVNET, {"name": "fedavg"}, {"precision": "bf16"}),  # autocast around the compiled step
        # the same dropout masks; each batch size compiled apart
        ({"name": "mlp", "hidden": [32], "dropout": 0.5}, {"name": "fedavg"}, {}),
    ],
    ids=["convnet-scaffold", "mlp-moon", "mlp-fedrod", "bn-fedavg", "lora-ranks", "bf16", "dropout"],
)
def test_the_compiled_local_step_gives_the_uncompiled_replies(tiny_config, model, algorithm, train, monkeypatch):
    """Every client's reply (parameters, buffers, control variates, train loss and the loss's extra outputs) equals
    the uncompiled loop's bit for bit, and a phase of clients with short last batches of several sizes compiles at
    most three graphs (a fixed batch, then a dynamic one, and a batch of one sample, which torch specialises), as
    many per LoRA rank where clients train different ranks."""
    monkeypatch.setattr(compiled_module, "COMPILE_BACKEND", "aot_eager")
    cfg = {"model": model, "train": {**TRAIN, **train}, "algorithm": algorithm}
    plain_sim = Simulation(tiny_config(**cfg, run={"executor": "sequential"}))
    assert plain_sim.executor.runner.compiled is None
    plain, _ = one_phase(plain_sim)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    sim = Simulation(tiny_config(**cfg, run={"executor": "sequential", "compile": "reduce-overhead"}))
    step = sim.executor.runner.compiled
    assert step is not None
    compiled, failures = one_phase(sim)
    assert not failures and step.step.on  # no fallback
    ranks = len(set(model.get("lora_ranks", [0])))  # a client's LoRA rank is a constant of the graph
    # dropout cannot be traced with a dynamic batch size under torch.func: each size compiled apart, up to the limit
    limit = torch._dynamo.config.recompile_limit if model.get("dropout") else 3 * ranks
    assert 1 <= torch._dynamo.utils.counters["stats"]["unique_graphs"] <= limit
    assert step.step.static == bool(model.get("dropout"))
    assert_same_replies(compiled, plain)


def test_a_whole_run_with_the_sequential_step_compiled_equals_the_uncompiled_run(tiny_config, monkeypatch):
    from fedhet.results.store import read_metrics

    monkeypatch.setattr(compiled_module, "COMPILE_BACKEND", "aot_eager")
    runs = {}
    for mode in ("off", "default"):
        sim = Simulation(tiny_config(train=TRAIN, run={"executor": "sequential", "compile": mode, "name": mode}))
        sim.run()
        rows = read_metrics(sim.run_dir / "metrics.jsonl")
        runs[mode] = [(r["round"], r.get("test_acc"), r.get("train_loss")) for r in rows]
    assert runs["default"] == runs["off"] and len(runs["off"]) == 3


def test_a_failing_compiled_local_step_runs_uncompiled_after_one_warning(tiny_config, failing_compile):
    plain, _ = one_phase(Simulation(tiny_config(train=TRAIN, run={"executor": "sequential"})))
    sim = Simulation(tiny_config(train=TRAIN, run={"executor": "sequential", "compile": "default"}))
    with pytest.warns(RuntimeWarning, match="the local step failed.*no C\\+\\+ compiler here.*uncompiled") as caught:
        compiled, failures = one_phase(sim)
    assert len(caught) == 1 and not failures  # once, not once per step
    assert not sim.executor.runner.compiled.step.on
    assert_same_replies(compiled, plain)


@pytest.mark.parametrize(
    ("sections", "reason"),
    [
        ({"algorithm": {"name": "fedufo"}}, "FedUFO has its own local_loss hook"),
        ({"privacy": {"mode": "local", "noise_multiplier": 1.0, "clip": 1.0}}, "local DP-SGD"),
    ],
    ids=["own-local-loss", "local-dp"],
)
def test_what_the_sequential_loop_cannot_compile_is_said_once_and_runs_uncompiled(
    tiny_config, sections, reason, capsys
):
    sim = Simulation(tiny_config(**sections, run={"executor": "sequential", "compile": "default"}))
    assert type(sim.executor) is LocalExecutor and sim.executor.runner.compiled is None
    err = capsys.readouterr().err
    assert f"run.compile = 'default': {reason}" in err and "local steps run uncompiled" in err


def test_a_compilable_sequential_run_says_nothing(tiny_config, capsys):
    sim = Simulation(tiny_config(run={"executor": "sequential", "compile": "default"}))
    assert sim.executor.runner.compiled is not None
    assert "run.compile" not in capsys.readouterr().err

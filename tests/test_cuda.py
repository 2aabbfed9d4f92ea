"""Every algorithm on a GPU: no tensor left on the CPU where the model lives on the GPU.

CI has no GPU, so these run only where torch sees one. They were written after FedMTL's server mixed its CPU
Omega with GPU models (``RuntimeError: Expected all tensors to be on the same device``) in a reproduction run on an
H100: nothing on a CPU-only machine can catch that.
"""

from __future__ import annotations

import math

import pytest
import torch

from fedhet.algorithms import ALGORITHMS
from fedhet.engine.simulation import Simulation
from fedhet.results.store import read_metrics

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("algorithm", ALGORITHMS.names())
def test_every_algorithm_runs_on_a_gpu(tiny_config, algorithm):
    params = {"pfedme": {"inner_steps": 2}}.get(algorithm, {})
    sim = Simulation(
        tiny_config(
            run={"name": "gpu", "rounds": 2, "device": "cuda"},
            partition={"local_test_fraction": 0.2},
            train={"participation": 1.0, "momentum": 0.5},
            algorithm={"name": algorithm, **params},
        )
    )
    sim.run()
    assert sim.algo.global_params.is_cuda
    last = read_metrics(sim.run_dir / "metrics.jsonl")[-1]
    assert last["round"] == 2 and math.isfinite(last["test_acc"]) and math.isfinite(last["train_loss"])


# ---------------------------------------------------------------------- the batched executor on a GPU (issue 29)
# cuDNN convolutions use TF32 by default (10-bit mantissa): the conv net is compared at that precision
GPU_REL = {"mlp": 1e-4, "convnet": 1e-2}
GPU_MODELS = {"mlp": {"name": "mlp", "hidden": [32]}, "convnet": {"name": "convnet", "channels": [8, 16], "hidden": 32}}


def one_phase(tiny_config, executor: str, model: dict, steps: int | None = None, algorithm: str = "fedavg"):
    from fedhet.engine.batched import BatchedExecutor
    from fedhet.engine.client import LocalExecutor

    sim = Simulation(
        tiny_config(
            run={"name": f"gpu-{executor}", "device": "cuda"},
            model=model,
            train={"participation": 1.0, "momentum": 0.9, "grad_clip": 2.0, "local_steps": steps},
            algorithm={"name": algorithm},
        )
    )
    runner = sim.executor.runner
    msgs = sim.algo.configure(1, list(range(sim.fed.num_clients)), "train")
    ex = BatchedExecutor(runner, sim.fed.clients) if executor == "batched" else LocalExecutor(runner, sim.fed.clients)
    return ex, msgs


@pytest.mark.parametrize("name", GPU_MODELS)
def test_batched_equals_sequential_on_a_gpu(tiny_config, name):
    seq_ex, msgs = one_phase(tiny_config, "sequential", GPU_MODELS[name])
    seq, _ = seq_ex.run_phase(1, 0, "train", msgs)
    bat_ex, msgs = one_phase(tiny_config, "batched", GPU_MODELS[name])
    bat, failures = bat_ex.run_phase(1, 0, "train", msgs)
    assert bat_ex.last_phase_batched and not failures and bat.keys() == seq.keys()
    rel = GPU_REL[name]
    for cid, reply in seq.items():
        t = reply.tensors["params"]
        assert t.is_cuda and bat[cid].tensors["params"].is_cuda
        torch.testing.assert_close(bat[cid].tensors["params"], t, rtol=rel, atol=rel * float(t.abs().max()))


@pytest.mark.parametrize("executor", ["sequential", "batched"])
def test_no_host_sync_per_step_on_a_gpu(tiny_config, executor):
    """torch.cuda's sync debug mode warns at every host synchronisation: a phase warns as often with 16 local
    steps as with 4 (what is read once per client stays; nothing is read per step)."""
    import warnings

    def syncs(steps: int) -> int:
        ex, msgs = one_phase(tiny_config, executor, GPU_MODELS["mlp"], steps, "scaffold")
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                ex.run_phase(1, 0, "train", msgs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return sum("synchroniz" in str(w.message) for w in caught)

    assert syncs(4) == syncs(16)

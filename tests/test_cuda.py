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

from __future__ import annotations

import os

import pytest
import torch

from fedhet.config import build_config


@pytest.fixture(autouse=True)
def _few_threads():
    # CI has two cores; pinning threads keeps timings and reductions stable across machines.
    torch.set_num_threads(1)
    yield


# What decides which packages a process this one starts imports: a test (or a library under it) that leaves one of
# them changed breaks later tests in the same worker (Flower's Ray backend once left PYTHONPATH set to sys.path, and
# the wheel test's install into a fresh environment then found everything "already satisfied" and installed nothing)
IMPORT_ENVIRONMENT = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PATH")


@pytest.fixture(autouse=True)
def _import_environment_kept():
    before = {key: os.environ.get(key) for key in IMPORT_ENVIRONMENT}
    yield
    changed = [key for key, value in before.items() if os.environ.get(key) != value]
    assert not changed, f"the test left {', '.join(changed)} changed in os.environ"


# FedBN's digit CNN, narrowed so a run on digits takes about a second: tiny_config's model for fedbn
BATCHNORM_MODEL = {"name": "cnn_bn", "channels": [4, 4, 8], "hidden": [16]}
# CReFF's official 100 feature-matching steps and 300 retraining epochs over 100 features per class cost 5-15 s a
# run on digits, in every test that runs every algorithm: tiny_config gives creff named without parameters these
# (the same code, fewer iterations; tests/test_creff.py sets its own)
CREFF_TINY = {"num_features": 10, "match_epochs": 5, "retrain_epochs": 5, "real_repeats": 2}


@pytest.fixture
def tiny_config(tmp_path):
    """A federated run on sklearn digits that takes about a second (fedbn gets ``BATCHNORM_MODEL``, creff named
    without parameters ``CREFF_TINY``)."""

    def make(**sections):
        raw = {
            # in-process clients by default: several tests replace an algorithm's hooks in this process
            "run": {"rounds": 3, "out_dir": str(tmp_path / "runs"), "progress": False, "seed": 0, "workers": 1},
            "dataset": {"name": "digits"},
            "partition": {"name": "dirichlet", "alpha": 0.5, "num_clients": 6, "min_size": 20},
            "model": {"name": "mlp", "hidden": [32]},
            "train": {"participation": 0.5, "local_epochs": 1, "batch_size": 16, "lr": 0.1},
            "algorithm": {"name": "fedavg"},
        }
        if sections.get("algorithm", {}).get("name") == "fedbn" and "model" not in sections:
            raw["model"] = BATCHNORM_MODEL  # FedBN refuses a model without BatchNorm layers
        if sections.get("algorithm") == {"name": "creff"}:
            sections = {**sections, "algorithm": {"name": "creff", **CREFF_TINY}}
        for name, values in sections.items():
            # a component given by a new name starts from its own defaults, not the previous one's parameters
            replace = name in ("algorithm", "server") or (name in ("partition", "model") and "name" in values)
            raw[name] = values if replace else {**raw.get(name, {}), **values}
        return build_config(raw)

    return make


@pytest.fixture
def kill_and_resume():
    """Run a config to the end, and the same config killed after round ``stop_after`` and resumed.

    ``make(name)`` builds the config for a run name; returns ``(full, resumed)`` simulations for comparison."""
    from fedhet.engine.runs import build_simulation

    def run(make, stop_after: int = 2):
        full = build_simulation(make("full"))
        full.run()
        build_simulation(make("cut")).run(stop_after=stop_after)  # the "kill": the process ends after a checkpoint
        resumed = build_simulation(make("cut"))
        resumed.run(resume=True)
        return full, resumed

    return run


@pytest.fixture
def failing_compile(monkeypatch):
    """torch.compile replaced by one whose compiled functions raise at every call, as where no C++ compiler is."""

    def broken(fn, **options):
        def call(*args):
            raise RuntimeError("no C++ compiler here")

        return call

    monkeypatch.setattr(torch, "compile", broken)

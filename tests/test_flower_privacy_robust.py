"""Client-level DP and robust aggregation on Flower's runtime (``LoopbackGrid``: every message crosses Flower's wire
encoding): they live in the server's aggregation path, which the ServerApp shares with the simulation, and attacks
and local DP-SGD in the client's, which the ClientApp shares; so the Flower run must equal the in-process one
exactly. And SecAgg+ refuses what needs each client's update.
"""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # no calls home from Flower in tests (read when flwr loads)
pytest.importorskip("flwr")
pytest.importorskip("dp_accounting")

from fedhet.engine.simulation import Simulation  # noqa: E402
from fedhet.errors import ConfigError  # noqa: E402
from fedhet.flower.app import RunOptions, run_server  # noqa: E402
from fedhet.flower.client import make_client_app  # noqa: E402
from fedhet.flower.loopback import LoopbackGrid  # noqa: E402
from fedhet.flower.secagg import SecAggSettings  # noqa: E402

NODES = {10 + c: {"partition-id": c} for c in range(4)}
CENTRAL_DP = {"mode": "central", "clip": 1.0, "noise_multiplier": 0.5}


def make_cfg(tiny_config, name: str, **sections):
    return tiny_config(
        run={"rounds": 2, "name": name}, partition={"num_clients": 4}, train={"participation": 1.0}, **sections
    )


def records(run_dir) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k != "elapsed_s"} for line in lines]


@pytest.mark.parametrize(
    "sections",
    [
        {"privacy": CENTRAL_DP},
        {"privacy": {"mode": "local", "clip": 1.0, "noise_multiplier": 1.0}},
        {"server": {"name": "sgd", "aggregation": "median"}, "attack": {"kind": "sign_flip", "fraction": 0.25}},
    ],
    ids=["central_dp", "local_dp", "median_under_sign_flip"],
)
def test_privacy_and_robust_aggregation_on_flower_match_the_simulation(tiny_config, sections):
    local = Simulation(make_cfg(tiny_config, "local", **sections))
    local.run()
    cfg = make_cfg(tiny_config, "flower", **sections)
    summary = run_server(LoopbackGrid(make_client_app(lambda _: cfg), NODES), cfg, RunOptions())
    assert summary["status"] == "finished"
    got, want = records(local.run_dir.parent / "flower"), records(local.run_dir)
    assert got == want
    if "privacy" in sections:  # the accountant's epsilon is logged on Flower too
        assert any("epsilon" in key for key in got[-1])


@pytest.mark.parametrize(
    ("sections", "why"),
    [
        ({"privacy": CENTRAL_DP}, "central DP clips each client's update"),
        ({"server": {"name": "sgd", "aggregation": "median"}}, "needs each client's update"),
    ],
)
def test_secaggplus_refuses_central_dp_and_robust_aggregators(tiny_config, sections, why):
    cfg = make_cfg(tiny_config, "refused", **sections)
    with pytest.raises(ConfigError, match=why):
        run_server(
            LoopbackGrid(make_client_app(lambda _: cfg), NODES), cfg, RunOptions(secure_aggregation=SecAggSettings())
        )


@pytest.mark.parametrize(
    "sections",
    [{"privacy": {"mode": "local", "clip": 1.0, "noise_multiplier": 1.0}}, {"attack": {"kind": "sign_flip"}}],
    ids=["local_dp", "sign_flip"],
)
def test_secaggplus_runs_with_local_dp_sgd_and_with_attacks(tiny_config, sections):
    """Both act on the client, before its update is masked."""
    cfg = make_cfg(tiny_config, "secure", **sections)
    options = RunOptions(secure_aggregation=SecAggSettings())
    assert run_server(LoopbackGrid(make_client_app(lambda _: cfg), NODES), cfg, options)["status"] == "finished"

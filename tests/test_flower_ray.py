"""fedhet on Flower's simulation runtime (Ray backend): one virtual SuperNode per client, ClientApps in Ray actors.

SCAFFOLD keeps its control variates in each virtual node's Context.state; the run folder must hold exactly the
metrics of the in-process simulation of the same config and seed.
"""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # no calls home from Flower in tests (read when flwr loads)
pytest.importorskip("flwr")
pytest.importorskip("ray")

from fedhet.engine.simulation import Simulation  # noqa: E402
from fedhet.flower.raysim import run_ray_simulation  # noqa: E402


def records(run_dir) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k != "elapsed_s"} for line in lines]


@pytest.mark.slow  # Ray start-up (runs in `make test`; `-m "not slow"` skips it)
def test_ray_simulation_matches_the_in_process_simulation(tiny_config, tmp_path):
    def cfg(name):
        return tiny_config(
            run={"rounds": 2, "name": name}, partition={"num_clients": 4}, algorithm={"name": "scaffold"}
        )

    summary = run_ray_simulation(cfg("ray"), num_cpus=2, client_cpus=1.0)  # two Ray workers share the 4 nodes
    sim = Simulation(cfg("local"))
    sim.run()
    assert summary["status"] == "finished" and summary["rounds_done"] == 2
    got, want = records(sim.run_dir.parent / "ray"), records(sim.run_dir)
    assert [r["clients"] for r in got] == [2, 2]  # participation 0.5 of 4 clients, none dropped
    assert got == want

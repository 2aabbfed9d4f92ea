"""fedhet on Flower's simulation runtime (Ray backend): one virtual SuperNode per client, ClientApps in Ray actors.

SCAFFOLD keeps its control variates in each virtual node's state folder (under the run folder's node_state); the
run folder must hold exactly the metrics of the in-process simulation of the same config and seed, also after a
kill and resume.
"""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # no calls home from Flower in tests (read when flwr loads)
pytest.importorskip("flwr")
pytest.importorskip("ray")

from fedhet.engine.simulation import Simulation  # noqa: E402
from fedhet.flower.app import RunOptions  # noqa: E402
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

    before = os.environ.get("PYTHONPATH")
    summary = run_ray_simulation(cfg("ray"), num_cpus=2, client_cpus=1.0)  # two Ray workers share the 4 nodes
    # Flower sets PYTHONPATH for Ray's workers; left so, a later pip --python into a fresh env would install nothing
    assert os.environ.get("PYTHONPATH") == before
    sim = Simulation(cfg("local"))
    sim.run()
    assert summary["status"] == "finished" and summary["rounds_done"] == 2
    got, want = records(sim.run_dir.parent / "ray"), records(sim.run_dir)
    assert [r["clients"] for r in got] == [2, 2]  # participation 0.5 of 4 clients, none dropped
    assert got == want


@pytest.mark.slow
def test_ray_simulation_killed_between_checkpoints_resumes_exactly(tiny_config, monkeypatch):
    """Killed after round 3's clients trained (checkpoint at round 2): each virtual node already holds a round-3
    version of its client's state in its folder under the run folder's node_state; the resume reads the round-2 ones
    and ends with the in-process simulation's metrics."""

    class Killed(Exception):
        pass

    def cfg(name):
        return tiny_config(
            run={"rounds": 4, "name": name, "checkpoint_every": 2},
            partition={"num_clients": 4},
            train={"participation": 1.0},
            algorithm={"name": "scaffold"},
        )

    sim = Simulation(cfg("local"))
    sim.run()
    evaluate = Simulation.evaluate

    def die_in_round_3(self, rnd, *args):
        if rnd == 3:
            raise Killed("the ServerApp dies before logging round 3")
        return evaluate(self, rnd, *args)

    with monkeypatch.context() as patch:
        patch.setattr(Simulation, "evaluate", die_in_round_3)  # the ServerApp runs in this process
        with pytest.raises(Killed):
            run_ray_simulation(cfg("ray"), num_cpus=2, client_cpus=1.0)
    run_dir = sim.run_dir.parent / "ray"
    assert len(list((run_dir / "node_state").rglob("r00000003-*.pt"))) == 4
    summary = run_ray_simulation(cfg("ray"), RunOptions(resume=True), num_cpus=2, client_cpus=1.0)
    assert summary["status"] == "finished"
    assert records(run_dir) == records(sim.run_dir)
    assert not (run_dir / "notices.jsonl").exists()

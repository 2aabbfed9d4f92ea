"""Seconds per round: fedhet's in-process simulation against the same run in Flower's Ray simulation.

FedAvg on Fashion-MNIST, 100 clients (Dirichlet 0.5), 10 per round, 1 local epoch, batch 64, the simple CNN. Both
runtimes use the same ``Simulation`` round loop; only the executor differs (in-process clients vs ClientApps in Ray
actors behind Flower's in-memory Grid, one virtual SuperNode per client). A round is timed from the server's
configure to the end of aggregation (evaluation excluded; it runs on the server either way and only once, at the
end). Flower's one-off costs (Ray start, actors loading the data, asking the 100 nodes which client they hold) are
reported separately. Both runs must reach the same final accuracy (the client updates are the same).

    nice -n 10 python benchmarks/flower_overhead.py [--rounds 5] [--workers 1 2] [--threads 1]

With one worker both runtimes use one core, so the ratio is Flower's overhead; with more workers Flower trains
several clients at once. Each round is reported in wall seconds and in CPU seconds of this process and its children
(Ray's processes included), the steadier number on a shared machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # no calls home from Flower (read when flwr loads)

import torch  # noqa: E402

from fedhet.config import build_config  # noqa: E402
from fedhet.engine.simulation import Simulation, build_federation  # noqa: E402


def make_config(rounds: int, name: str):
    return build_config(
        {
            "run": {"rounds": rounds, "out_dir": "/tmp/fedhet-flower-bench", "progress": False, "name": name},
            "dataset": {"name": "fmnist"},
            "partition": {"name": "dirichlet", "alpha": 0.5, "num_clients": 100},
            "model": {"name": "cnn"},
            "train": {"clients_per_round": 10, "local_epochs": 1, "batch_size": 64, "lr": 0.01},
            "algorithm": {"name": "fedavg"},
            "server": {"name": "sgd"},
        }
    )


def tree_cpu_s(root: int | None = None) -> float:
    """CPU seconds (user + system) used so far by this process and every live process below it (Ray's raylet,
    GCS and ClientApp workers are started by this process). On a shared machine CPU time is a steadier measure
    than wall time, which grows with everyone else's load."""
    root = root or os.getpid()
    stats, children = {}, defaultdict(list)
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                fields = Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            stats[int(entry.name)] = fields
            children[int(fields[1])].append(int(entry.name))
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            total += int(stats[pid][11]) + int(stats[pid][12])  # utime, stime in clock ticks
        todo.extend(children.get(pid, []))
    return total / os.sysconf("SC_CLK_TCK")


class TimedSimulation(Simulation):
    """Records wall and CPU seconds of each round's phases (configure, clients, aggregate); not evaluation."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.round_s: dict[int, float] = defaultdict(float)
        self.round_cpu_s: dict[int, float] = defaultdict(float)

    def run_phase(self, rnd, phase_idx, phase, cids, budgets=None):
        start, cpu = time.perf_counter(), tree_cpu_s()
        result = super().run_phase(rnd, phase_idx, phase, cids, budgets)
        self.round_s[rnd] += time.perf_counter() - start
        self.round_cpu_s[rnd] += tree_cpu_s() - cpu
        return result

    def times(self) -> tuple[list[float], list[float]]:
        rounds = sorted(self.round_s)
        return [self.round_s[r] for r in rounds], [self.round_cpu_s[r] for r in rounds]


def fedhet_rounds(rounds: int) -> tuple[tuple[list[float], list[float]], float]:
    cfg = make_config(rounds, "fedhet")
    sim = TimedSimulation(cfg, fed=build_federation(cfg))
    summary = sim.run(overwrite=True)
    return sim.times(), summary["final"]["test_acc"]


def flower_rounds(rounds: int, workers: int) -> tuple[tuple[list[float], list[float]], float, dict[str, float]]:
    from flwr.app import Context
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation

    from fedhet.flower.app import make_client_app
    from fedhet.flower.server import Exchange, FlowerExecutor, discover, server_federation

    cfg = make_config(rounds, "flower")
    out: dict = {}
    server = ServerApp()

    @server.main()
    def _main(grid: Grid, context: Context) -> None:
        # fedhet.flower.app.run_server, with the timed Simulation and the start-up steps timed
        nodes = discover(grid, cfg.partition.num_clients, 600.0)
        out["discovered"] = time.perf_counter()
        sim = TimedSimulation(
            cfg, fed=server_federation(cfg, nodes), executor=FlowerExecutor(grid, nodes, Exchange(grid))
        )
        out["summary"] = sim.run(overwrite=True)
        out["times"] = sim.times()

    start = time.perf_counter()
    run_simulation(
        server_app=server,
        client_app=make_client_app(lambda _: cfg),
        num_supernodes=cfg.partition.num_clients,
        backend_config={"client_resources": {"num_cpus": 1.0, "num_gpus": 0.0}, "init_args": {"num_cpus": workers}},
    )
    one_off = {  # Ray starts while the ServerApp asks the nodes, so the discovery time includes Ray and its actors
        "ray_start_and_node_discovery_s": out["discovered"] - start,
        "total_wall_s": time.perf_counter() - start,
    }
    return out["times"], out["summary"]["final"]["test_acc"], one_off


def median_later(values: list[float]) -> float:
    """Median over rounds 2.. (round 1 warms caches up)."""
    return statistics.median(values[1:] or values)


def describe(name: str, times: tuple[list[float], list[float]]) -> str:
    wall, cpu = times
    return (
        f"{name:<26} wall s/round: round 1 {wall[0]:6.2f}, median of 2..{len(wall)} {median_later(wall):6.2f} | "
        f"CPU s/round: round 1 {cpu[0]:6.2f}, median of 2..{len(cpu)} {median_later(cpu):6.2f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="Ray ClientApp workers (1 CPU each)")
    # One thread, like each Ray worker (1 CPU): the same float reductions (so the same accuracy), and no OpenMP
    # threads spinning against each other on a busy machine.
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the in-process simulation")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    fed_times, fed_acc = fedhet_rounds(args.rounds)
    lines = [describe(f"fedhet simulation ({args.threads} thr)", fed_times)]
    for workers in args.workers:
        flw_times, flw_acc, one_off = flower_rounds(args.rounds, workers)
        wall_ratio = median_later(flw_times[0]) / median_later(fed_times[0])
        cpu_ratio = median_later(flw_times[1]) / median_later(fed_times[1])
        lines += [
            describe(f"Flower Ray ({workers} workers)", flw_times),
            f"    ratio Flower / fedhet: wall {wall_ratio:.2f}x, CPU {cpu_ratio:.2f}x",
            "    one-off: " + ", ".join(f"{k} {v:.1f}" for k, v in one_off.items()),
            f"    final test accuracy: fedhet {fed_acc:.4f}, Flower {flw_acc:.4f}",
        ]
    print(f"\nFedAvg, Fashion-MNIST, 100 clients, 10 per round, 1 local epoch, {args.rounds} rounds")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

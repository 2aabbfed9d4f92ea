"""Seconds per round, side by side: the compute floor, fedhet in-process, fedhet with worker processes, fedhet
batched, and the same job written the plain way in Flower's Ray simulation; then a 10,000-client SCAFFOLD run.

The job: FedAvg on Fashion-MNIST, 100 IID clients, 10 per round, 1 local epoch, batch 64, a CNN with conv 32/64 and
fc 128 (fedhet's ``convnet`` with ``hidden=128``), SGD lr 0.05 momentum 0.9. A round is timed from sending the
messages to the end of aggregation (no evaluation). The floor is the same clients' same batches trained one after
another by a bare PyTorch loop (torch.optim.SGD) in this process. Floor, in-process, workers and batched are
interleaved round by round on the same clients, so machine noise hits them alike; the first round is left out
(allocator and kernel warm-up, worker start-up). Flower's run comes after them; its one-off start (Ray, actors) is
left out of its rounds too.

    python benchmarks/throughput.py [--rounds 6] [--no-flower] [--scale-rounds 20]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from fedhet.config import RunSection, build_config  # noqa: E402
from fedhet.engine.simulation import Simulation, build_federation  # noqa: E402
from fedhet.toolkit.local import batch_indices, num_local_steps  # noqa: E402

OUT = Path(tempfile.gettempdir()) / "fedhet-throughput"
FLOOR = f"floor (bare torch, 1 process, {torch.get_num_threads()} threads)"
LR, MOMENTUM, BATCH = 0.05, 0.9, 64


def job(name: str, rounds: int, clients: int = 100, per_round: int = 10, algorithm: str = "fedavg", **run) -> dict:
    return {
        "run": {"rounds": rounds, "out_dir": str(OUT), "progress": False, "eval_every": 10**6, "name": name, **run},
        "dataset": {"name": "fmnist"},
        "partition": {"name": "iid", "num_clients": clients},
        "model": {"name": "convnet", "hidden": 128},
        "train": {
            "clients_per_round": per_round,
            "local_epochs": 1,
            "batch_size": BATCH,
            "lr": LR,
            "momentum": MOMENTUM,
        },
        "algorithm": {"name": algorithm},
    }


def floor_round(sim: Simulation, cids: list[int], rnd: int, threads: int | None = None) -> float:
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        return _floor_round(sim, cids, rnd)
    finally:
        torch.set_num_threads(before)


def _floor_round(sim: Simulation, cids: list[int], rnd: int) -> float:
    model = sim.setup.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    start = time.perf_counter()
    for cid in cids:
        data = sim.fed.clients[cid]
        opt.state.clear()  # a fresh momentum buffer per client, as every FL client has
        steps = num_local_steps(len(data), BATCH, 1.0, None)
        for idx in batch_indices(len(data), BATCH, steps, torch.Generator().manual_seed(rnd * 1000 + cid)):
            opt.zero_grad()
            F.cross_entropy(model(data.x[idx]), data.y[idx]).backward()
            opt.step()
    return time.perf_counter() - start


def fedhet_round(sim: Simulation, cids: list[int], rnd: int) -> float:
    start = time.perf_counter()
    sim.run_phase(rnd, 0, "train", cids)
    return time.perf_counter() - start


def interleaved(rounds: int) -> dict[str, list[float]]:
    fed = build_federation(build_config(job("floor", rounds)))
    runners = {"fedhet in-process": Simulation(build_config(job("seq", rounds, workers=1)), fed=fed)}
    runners["fedhet 2 workers"] = Simulation(build_config(job("workers", rounds, workers=2)), fed=fed)
    if "executor" in RunSection.model_fields:  # the batched executor
        runners["fedhet batched"] = Simulation(
            build_config(job("batched", rounds, workers=1, executor="batched")), fed=fed
        )
    for sim in runners.values():
        sim.prepare_dir(resume=False, overwrite=True)
    floor_sim = runners["fedhet in-process"]
    times: dict[str, list[float]] = {FLOOR: [], "floor, 1 thread": [], **{k: [] for k in runners}}
    for rnd in range(1, rounds + 1):
        cids = floor_sim.sample_clients(rnd)
        times[FLOOR].append(floor_round(floor_sim, cids, rnd))
        times["floor, 1 thread"].append(floor_round(floor_sim, cids, rnd, threads=1))
        for label, sim in runners.items():
            times[label].append(fedhet_round(sim, cids, rnd))
        print(f"round {rnd}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()), flush=True)
    return times


# ------------------------------------------------------------------ the same job, the plain Flower way
def flower_plain(rounds: int) -> list[float]:
    """Flower 1.41's message API as its tutorials write it: a ServerApp running the FedAvg strategy, a ClientApp that
    loads its partition and trains a torch model with a DataLoader; Ray simulation with 2 workers."""
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    fed = build_federation(build_config(job("flower", rounds)))
    parts = OUT / "flower-parts.npz"
    OUT.mkdir(parents=True, exist_ok=True)
    arrays = {f"x{i}": c.x.numpy() for i, c in enumerate(fed.clients)}
    np.savez(parts, **arrays, **{f"y{i}": c.y.numpy() for i, c in enumerate(fed.clients)})

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1, self.conv2 = nn.Conv2d(1, 32, 5, padding=2), nn.Conv2d(32, 64, 5, padding=2)
            self.fc1, self.fc2 = nn.Linear(64 * 7 * 7, 128), nn.Linear(128, 10)

        def forward(self, x):
            x = F.max_pool2d(F.relu(self.conv1(x)), 2)
            x = F.max_pool2d(F.relu(self.conv2(x)), 2)
            return self.fc2(F.relu(self.fc1(x.flatten(1))))

    client = ClientApp()

    @client.train()
    def train(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        with np.load(parts) as data:
            ds = TensorDataset(torch.from_numpy(data[f"x{pid}"]), torch.from_numpy(data[f"y{pid}"]).long())
        model = Net()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        for x, y in DataLoader(ds, batch_size=BATCH, shuffle=True):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        content = RecordDict(
            {"arrays": ArrayRecord(model.state_dict()), "metrics": MetricRecord({"num-examples": len(ds)})}
        )
        return Message(content=content, reply_to=msg)

    marks: list[float] = []
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        def mark(rnd: int, arrays: ArrayRecord) -> MetricRecord:
            marks.append(time.perf_counter())  # before round 1, then after each round
            return MetricRecord({})

        strategy = FedAvg(fraction_train=0.1, fraction_evaluate=0.0, min_available_nodes=100)
        strategy.start(grid, ArrayRecord(Net().state_dict()), num_rounds=rounds, evaluate_fn=mark)

    run_simulation(
        server_app=server,
        client_app=client,
        num_supernodes=100,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}, "init_args": {"num_cpus": 2}},
    )
    return list(np.diff(marks))


# ------------------------------------------------------------------ 10,000 clients
def scale_child(clients: int, rounds: int) -> None:
    """One SCAFFOLD run (in a fresh process, so its peak memory is its own): prints seconds per round and peak RSS.

    Every client takes one step on 6 of its samples, so a round trains the same amount whatever the number of
    clients (1,000 clients hold 60 samples each, 10,000 hold 6): what grows with the client count is only the
    engine's own cost. Client states (SCAFFOLD's c_i, 1.8 MB each) spill to disk past 512 MB."""
    raw = job(f"scale-{clients}", rounds, clients=clients, per_round=100, algorithm="scaffold")
    raw["run"]["client_state_budget_mb"] = 512
    raw["train"].update(local_steps=1, batch_size=6)
    cfg = build_config(raw)
    sim = Simulation(cfg)
    sim.prepare_dir(resume=False, overwrite=True)
    times = []
    for rnd in range(1, rounds + 1):
        times.append(fedhet_round(sim, sim.sample_clients(rnd), rnd))
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    state_mb = sum(p.stat().st_size for p in (sim.run_dir / "client_state").rglob("*.pt")) / 2**20
    print(f"RESULT {statistics.median(times[1:]):.3f} {peak_mb:.0f} {len(sim.executor.store)} {state_mb:.0f}")


def scale(rounds: int) -> list[tuple[int, float, float, int, float]]:
    rows = []
    for clients in (1_000, 10_000):
        proc = subprocess.run(
            [sys.executable, __file__, "--scale-child", str(clients), "--scale-rounds", str(rounds)],
            capture_output=True,
            text=True,
            check=True,
        )
        line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
        s, peak, states, mb = line.split()[1:]
        rows.append((clients, float(s), float(peak), int(states), float(mb)))
        print(f"{clients} clients: {s} s/round, peak RSS {peak} MB, {states} client states ({mb} MB)", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--no-flower", action="store_true")
    ap.add_argument("--scale-rounds", type=int, default=20)
    ap.add_argument("--no-scale", action="store_true")
    ap.add_argument("--scale-child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.scale_child:
        return scale_child(args.scale_child, args.scale_rounds)
    print(f"torch threads in this process: {torch.get_num_threads()}; cores: {len(os.sched_getaffinity(0))}")
    times = interleaved(args.rounds)
    if not args.no_flower:
        times["Flower 1.41 Ray simulation, plain ClientApp, 2 workers"] = flower_plain(args.rounds)
    median = {k: statistics.median(v[1:]) for k, v in times.items()}
    floor = median[FLOOR]
    flower = next((v for k, v in median.items() if k.startswith("Flower")), None)
    print("\n| runner | s/round (median of rounds 2+) | vs floor | Flower / this |\n|---|---:|---:|---:|")
    for k, v in median.items():
        print(f"| {k} | {v:.2f} | {v / floor:.2f}x | {'' if flower is None else f'{flower / v:.2f}x'} |")
    if not args.no_scale:
        rows = scale(args.scale_rounds)
        print("\n| SCAFFOLD, 100 per round, 1 step of 6 | s/round | peak RSS (MB) | client states | on disk (MB) |")
        print("|---|---:|---:|---:|---:|")
        for clients, s, peak, states, mb in rows:
            print(f"| {clients} clients | {s:.2f} | {peak:.0f} | {states} | {mb:.0f} |")


if __name__ == "__main__":
    main()

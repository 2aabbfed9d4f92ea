"""Sequential against batched clients: seconds per round and their ratio over model x batch size x clients per round.

FedAvg (or ``--algorithm``) on Fashion-MNIST, 500 small clients (Dirichlet 0.5, about 120 samples each, so client
sizes and step counts differ), 1 local epoch, momentum 0.9. For every cell, ``--rounds`` rounds each sample their
clients, and each round's phase is run by both executors on the same messages, in alternating order, repeated
``--repeats`` times; the cell's ratio is the median over rounds of (median sequential time / median batched time),
so machine noise (other jobs on the cores) affects both alike. Training only: no evaluation, no aggregation.

    python benchmarks/batched.py [--threads 1] [--models logreg,mlp,lenet5,convnet16,cnn] [--batch-sizes 16,64]
                                 [--clients 5,10,20] [--rounds 3] [--repeats 3] [--device cpu] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from fedhet.config import build_config
from fedhet.engine.batched import BatchedExecutor
from fedhet.engine.client import LocalExecutor
from fedhet.engine.simulation import Simulation, build_federation

MODELS = {
    "logreg": {"name": "logreg"},
    "mlp": {"name": "mlp"},  # 784-200-200-10, McMahan et al. 2017's 2NN
    "mlp32": {"name": "mlp", "hidden": [32]},
    "mlp64": {"name": "mlp", "hidden": [64]},
    "lenet5": {"name": "lenet5"},
    "convnet16": {"name": "convnet", "channels": [16, 32], "hidden": 0},  # FedRANE's CNNModel
    "cnn": {"name": "cnn"},
}


def make_config(model: str, batch_size: int, clients: int, algorithm: str, data_dir: str | None, device: str = "cpu"):
    return build_config(
        {
            "run": {
                "rounds": 1,
                "out_dir": "/tmp/fedhet-bench-batched",
                "progress": False,
                "executor": "sequential",
                "device": device,
            },
            "dataset": {"name": "fmnist", "data_dir": data_dir},
            "partition": {"name": "dirichlet", "alpha": 0.5, "num_clients": 500},
            "model": MODELS[model],
            "train": {
                "clients_per_round": clients,
                "local_epochs": 1,
                "batch_size": batch_size,
                "lr": 0.01,
                "momentum": 0.9,
            },
            "algorithm": {"name": algorithm},
        }
    )


def time_phase(executor, rnd: int, msgs) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    executor.run_phase(rnd, 0, "train", msgs)
    sync()
    return time.perf_counter() - start


def measure_cell(sim: Simulation, rounds: int, repeats: int) -> dict[str, float]:
    runner = sim.executor.runner
    seq = LocalExecutor(runner, sim.fed.clients)
    bat = BatchedExecutor(runner, sim.fed.clients)
    assert bat.unsupported() is None, bat.unsupported()
    ratios, t_seq, t_bat = [], [], []
    for rnd in range(1, rounds + 1):
        msgs = sim.algo.configure(rnd, sim.sample_clients(rnd), "train")
        time_phase(bat, rnd, msgs)  # warm-up (allocator, vmap tracing caches)
        s, b = [], []
        for rep in range(repeats):
            pair = (seq, bat) if rep % 2 == 0 else (bat, seq)
            for ex in pair:
                (s if ex is seq else b).append(time_phase(ex, rnd, msgs))
        ratios.append(statistics.median(s) / statistics.median(b))
        t_seq.append(statistics.median(s))
        t_bat.append(statistics.median(b))
    return {
        "seq_s": statistics.median(t_seq),
        "batched_s": statistics.median(t_bat),
        "ratio": statistics.median(ratios),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--models", default="logreg,mlp,lenet5,convnet16,cnn", help=f"any of {', '.join(MODELS)}")
    ap.add_argument("--batch-sizes", default="16,64")
    ap.add_argument("--clients", default="5,10,20")
    ap.add_argument("--algorithm", default="fedavg")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    models = args.models.split(",")
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    counts = [int(k) for k in args.clients.split(",")]
    fed = build_federation(make_config(models[0], sizes[0], counts[0], args.algorithm, args.data_dir, args.device))
    results = []
    print(f"{args.algorithm}, {args.threads} torch thread(s); seconds per round (sequential / batched) and ratio")
    print(f"{'model':<10} {'params':>8} {'B':>3} {'K':>3} {'seq s':>8} {'batched s':>9} {'ratio':>6}")
    for model in models:
        for b in sizes:
            for k in counts:
                sim = Simulation(make_config(model, b, k, args.algorithm, args.data_dir, args.device), fed=fed)
                cell = measure_cell(sim, args.rounds, args.repeats)
                cell.update(model=model, params=sim.flat.num_params, batch_size=b, clients=k, threads=args.threads)
                results.append(cell)
                print(
                    f"{model:<10} {sim.flat.num_params:>8} {b:>3} {k:>3} {cell['seq_s']:>8.3f} "
                    f"{cell['batched_s']:>9.3f} {cell['ratio']:>6.2f}",
                    flush=True,
                )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()

"""Seconds per round of fedhet's simulation against the compute floor.

FedAvg on Fashion-MNIST, 100 clients (Dirichlet 0.5), 10 per round, 1 local epoch, batch 64, the simple CNN. The
floor is the same number of SGD steps on the same model and the same batches in a bare PyTorch loop
(torch.optim.SGD, no federation), measured in the same process right before, so machine noise affects both alike.
Rounds are timed without evaluation (it is the same for any FL library and is reported separately).

    python benchmarks/round_time.py [--rounds 5] [--model cnn] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from fedhet.config import build_config
from fedhet.engine.simulation import Simulation, build_federation
from fedhet.toolkit.local import batch_indices, num_local_steps


def make_config(args: argparse.Namespace):
    return build_config(
        {
            "run": {
                "rounds": args.rounds,
                "out_dir": "/tmp/fedhet-bench",
                "progress": False,
                "eval_every": 10**6,
                "workers": 1,
            },
            "dataset": {"name": "fmnist"},
            "partition": {"name": "dirichlet", "alpha": 0.5, "num_clients": 100},
            "model": {"name": args.model},
            "train": {"clients_per_round": 10, "local_epochs": 1, "batch_size": 64, "lr": 0.01},
            "algorithm": {"name": "fedavg"},
        }
    )


def floor_round(sim: Simulation, cids: list[int], rnd: int) -> float:
    """The same clients' batches, trained by a bare torch loop on a plain model."""
    model = sim.setup.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    t = sim.cfg.train
    start = time.perf_counter()
    for cid in cids:
        data = sim.fed.clients[cid]
        steps = num_local_steps(len(data), t.batch_size, t.local_epochs, t.local_steps)
        gen = torch.Generator().manual_seed(rnd * 1000 + cid)
        for idx in batch_indices(len(data), t.batch_size, steps, gen):
            opt.zero_grad()
            F.cross_entropy(model(data.x[idx]), data.y[idx]).backward()
            opt.step()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--model", default="cnn")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = make_config(args)
    fed = build_federation(cfg)
    sim = Simulation(cfg, fed=fed)
    sim.prepare_dir(resume=False, overwrite=True)
    fed_times, floor_times = [], []
    for rnd in range(1, args.rounds + 1):
        cids = sim.sample_clients(rnd)
        floor_times.append(floor_round(sim, cids, rnd))
        start = time.perf_counter()
        sim.run_phase(rnd, 0, "train", cids)
        fed_times.append(time.perf_counter() - start)
        print(f"round {rnd}: fedhet {fed_times[-1]:.3f} s, floor {floor_times[-1]:.3f} s")
    # the first round warms up allocators and kernels: leave it out when there are enough rounds
    skip = 1 if args.rounds > 2 else 0
    f, b = statistics.median(fed_times[skip:]), statistics.median(floor_times[skip:])
    print(f"\nmedian seconds per round: fedhet {f:.3f}, floor {b:.3f}, ratio {f / b:.3f} (target <= 1.15)")


if __name__ == "__main__":
    main()

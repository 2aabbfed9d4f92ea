"""What fedhet does around the local steps of a round, before and after the launch work (docs/performance.md,
"Fewer launches per client"): case (a)'s shape of benchmarks/gpu.py (Fashion-MNIST, 100 of 1,000 clients, one
epoch, batch 64) with logistic regression, whose steps cost almost nothing, so a round's time is the executors'
own per-client work. Each (executor, build) pair runs REPEATS times, interleaved, one torch thread; prints and writes
the median of rounds 2-6 of each run.

    python benchmarks/host_cost.py [--repeats 3] [--out runs/host-cost.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import gpu  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--clients", type=int, default=1000)
    ap.add_argument("--per-round", type=int, default=100)
    ap.add_argument("--out", type=Path, default=Path("runs/host-cost.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    run = argparse.Namespace(rounds=6, device="cpu", small=False, work=Path("runs/host-cost-work"))
    data, what = gpu.dataset_for("fmnist", False)
    train = {"local_epochs": 1, "batch_size": 64}
    cfg = gpu.config(run, "host", data, args.clients, args.per_round, {"name": "logreg"}, train, "fedavg")
    fed = gpu.build_federation(cfg)
    times: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for ex in ("sequential", "batched"):
            for before in (False, True):
                rounds, _ = gpu.fedhet_run(gpu.with_executor(cfg, ex, f"host-{ex}"), fed, before=before)
                times.setdefault(f"{ex}{' before' if before else ''}", []).append(statistics.median(rounds[1:]))
    report = {"data": what, "clients": f"{args.per_round}/{args.clients}", "s_per_round": times}
    for name, values in times.items():
        print(f"{name:18} median {statistics.median(values):.4f} s a round  ({', '.join(f'{v:.4f}' for v in values)})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()

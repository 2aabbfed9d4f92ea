"""FedRANE's Table 1 (G-FL, Fashion-MNIST) baselines: our global test accuracy beside the paper's, as Markdown.

    .venv/bin/python benchmarks/reproduce/fedrane/table1.py [--round R] [--out runs/reproduce/fedrane-fmnist]

Reads the run folders that run.sh writes (OUT/alpha<A>/<method>-s<seed>) and reports each cell at round R (default:
the last round every run of the table has reached, so all cells compare the same budget), averaged over the seeds
present. Cells whose runs have not reached R are left empty. ``--best`` reports the best accuracy over rounds 1..R
instead, which is what PFLlib (the code base of FedRANE's experiments) prints as its result.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from fedhet.results.report import Run, load_run

ALPHAS = ("0.1", "0.5", "5")
# notes/fedrane.md section 6, FMNIST columns (global model, official test set, mean of 5 runs, ~100 rounds).
PAPER = {
    "fedavg": (79.02, 86.85, 88.45),
    "fedprox": (78.91, 86.78, 88.42),
    "scaffold": (79.81, 87.47, 88.77),
    "feddyn": (82.86, 88.46, 89.72),
    "moon": (84.07, 89.66, 90.81),
}
NAMES = {"fedavg": "FedAvg", "fedprox": "FedProx", "scaffold": "SCAFFOLD", "feddyn": "FedDyn", "moon": "MOON"}


def runs_of(out: Path, alpha: str, method: str) -> list[Run]:
    return [load_run(p) for p in sorted((out / f"alpha{alpha}").glob(f"{method}-s*")) if (p / "metrics.jsonl").exists()]


def acc_at(run: Run, rnd: int, best: bool = False) -> float | None:
    """Test accuracy (%) at round ``rnd``, or the best up to it; None if the run has not reached ``rnd``."""
    values = [(r, 100 * v) for r, v in run.values("test_acc") if r <= rnd]
    if not values or values[-1][0] != rnd:
        return None
    return max(v for _, v in values) if best else values[-1][1]


def table(out: Path, rnd: int, best: bool = False) -> str:
    head = "| method | " + " | ".join(f"α={a} ours | α={a} paper | gap" for a in ALPHAS) + " |"
    lines = [head, "|:---|" + "---:|" * (3 * len(ALPHAS))]
    for method, paper in PAPER.items():
        cells = []
        for alpha, ref in zip(ALPHAS, paper, strict=True):
            accs = [a for a in (acc_at(r, rnd, best) for r in runs_of(out, alpha, method)) if a is not None]
            ours = statistics.fmean(accs) if accs else None
            cells += ["—", f"{ref:.2f}", ""] if ours is None else [f"{ours:.2f}", f"{ref:.2f}", f"{ours - ref:+.2f}"]
        lines.append(f"| {NAMES[method]} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/reproduce/fedrane-fmnist")
    parser.add_argument("--round", type=int, default=None, help="report this round (default: the common last one)")
    parser.add_argument("--best", action="store_true", help="best accuracy over rounds 1..R instead of round R's")
    args = parser.parse_args()
    out = Path(args.out)
    runs = [r for a in ALPHAS for m in PAPER for r in runs_of(out, a, m)]
    if not runs:
        raise SystemExit(f"no runs under {out}: run benchmarks/reproduce/fedrane/run.sh first")
    rnd = args.round or min(r.last_round for r in runs)
    what = f"best over rounds 1-{rnd}" if args.best else f"at round {rnd}"
    seeds = sorted({r.config["run"]["seed"] for r in runs})
    print(f"Global test accuracy (%) {what}, ours (seeds: {seeds}), beside the paper's (5 runs, ~100 rounds):\n")
    print(table(out, rnd, args.best))


if __name__ == "__main__":
    main()

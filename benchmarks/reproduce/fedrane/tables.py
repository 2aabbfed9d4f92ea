"""FedRANE's Tables 1 (G-FL) and 2 (P-FL) on Fashion-MNIST: ours beside the paper's, as Markdown.

    .venv/bin/python benchmarks/reproduce/fedrane/tables.py [RUNS_DIR ...] [--round R] [--best]

Each RUNS_DIR holds alpha<A>/<method>-s<seed> run folders (default: runs/reproduce/fedrane-fmnist, which run.sh
writes, then the archived cells in benchmarks/reproduce/fedrane/results, written by benchmarks/reproduce/archive.py);
a seed found in several is read from the first. A cell is the mean over the seeds that reached round R (default: the
last round every run present has reached, so all cells compare the same budget); a cell no run reached is "—", and
one more than 1.5 points from the paper is marked "!" (docs/reproductions/fedrane.md gives the cause we found).
``--best`` reports the best value over rounds 1..R instead, which is what PFLlib (FedRANE's code base) prints.
``--last`` reports each cell at its own last round instead and names it (cells stopped at a deadline, archived with
``archive.py --partial``, have different rounds).

G-FL is test_acc (the global model on the official test set); P-FL is personal_acc_micro (each client's personalised
model on its 25% local test split, summed over clients as FedRANE's code does).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from fedhet.results.report import Run, load_run

ALPHAS = ("0.1", "0.5", "5")
RESULTS = Path(__file__).parent / "results"  # archived finished cells (benchmarks/reproduce/archive.py)
FLAG = 1.5  # points from the paper: a cell this far off gets an explanation in docs/reproductions/fedrane.md
NAMES = {
    "fedavg": "FedAvg",
    "fedprox": "FedProx",
    "scaffold": "SCAFFOLD",
    "feddyn": "FedDyn",
    "moon": "MOON",
    "fedper": "FedPer",
    "fedmtl": "FedMTL",
    "pfedme": "pFedMe",
    "ditto": "Ditto",
    "apple": "APPLE",
    "fedrod": "Fed-RoD",
    "fedbabu": "FedBABU",
    "spherefed": "SphereFed",
    "fedrane_wo_lra": "FedRANE-w/o-LRA",
    "fedrane_wo_gne": "FedRANE-w/o-GNE",
    "fedrane": "FedRANE",
}
# notes/fedrane.md section 6, FMNIST columns alpha = 0.1 / 0.5 / 5 (mean of 5 runs, ~100 rounds), in %.
PAPER_GFL = {
    "fedavg": (79.02, 86.85, 88.45),
    "fedprox": (78.91, 86.78, 88.42),
    "scaffold": (79.81, 87.47, 88.77),
    "feddyn": (82.86, 88.46, 89.72),
    "moon": (84.07, 89.66, 90.81),
    "fedrod": (84.21, 89.52, 90.74),
    "fedbabu": (75.91, 82.64, 84.84),
    "spherefed": (87.85, 90.05, 90.87),
    "fedrane_wo_lra": (88.47, 90.92, 91.62),
    "fedrane_wo_gne": (88.64, 91.28, 91.75),
    "fedrane": (88.92, 91.35, 91.94),
}
PAPER_PFL = {
    "fedper": (97.17, 90.96, 87.55),
    "fedmtl": (97.47, 91.16, 85.71),
    "pfedme": (96.11, 89.22, 85.96),
    "ditto": (97.75, 93.88, 91.79),
    "apple": (96.86, 90.74, 87.35),
    "fedrod": (97.52, 93.59, 91.71),
    "fedbabu": (96.81, 89.66, 85.66),
    "spherefed": (88.01, 90.62, 91.44),
    "fedrane_wo_lra": (96.62, 93.11, 92.18),
    "fedrane_wo_gne": (95.63, 92.62, 92.64),
    "fedrane": (97.97, 94.40, 92.76),
}
TABLES = (
    ("Table 1 (G-FL): global model on the official test set (%)", "test_acc", PAPER_GFL),
    ("Table 2 (P-FL): personalised models on the clients' local test splits (%)", "personal_acc_micro", PAPER_PFL),
)


def runs_of(roots: list[Path], alpha: str, method: str) -> list[Run]:
    """One run per seed, from the first root that has it."""
    found: dict[str, Path] = {}
    for root in roots:
        for path in sorted((root / f"alpha{alpha}").glob(f"{method}-s*")):
            if (path / "metrics.jsonl").exists():
                found.setdefault(path.name, path)
    return [load_run(found[name]) for name in sorted(found)]


def value_at(run: Run, metric: str, rnd: int, best: bool = False) -> float | None:
    """The metric (%) at round ``rnd``, or its best up to it; None if the run has not logged it at ``rnd``."""
    values = [(r, 100 * v) for r, v in run.values(metric) if r <= rnd]
    if not values or values[-1][0] != rnd:
        return None
    return max(v for _, v in values) if best else values[-1][1]


def cell(runs: list[Run], metric: str, rnd: int | None, ref: float, best: bool) -> list[str]:
    """Ours, the paper's and the gap; ``rnd`` None: each run at its own last round, named in the cell."""
    at = {id(r): rnd or r.last_round for r in runs}
    hits = [(v, at[id(r)]) for r in runs if (v := value_at(r, metric, at[id(r)], best)) is not None]
    if not hits:
        return ["—", f"{ref:.2f}", ""]
    values = [v for v, _ in hits]
    ours, gap = statistics.fmean(values), statistics.fmean(values) - ref
    seeds = "" if len(values) == 1 else f" ({len(values)} seeds)"
    if rnd is None:
        first, last = min(r for _, r in hits), max(r for _, r in hits)
        seeds += f" R{first}" if first == last else f" R{first}-{last}"
    return [f"{ours:.2f}{seeds}", f"{ref:.2f}", f"{gap:+.2f}" + (" !" if abs(gap) > FLAG else "")]


def table(roots: list[Path], metric: str, paper: dict, rnd: int | None, best: bool) -> str:
    head = "| method | " + " | ".join(f"α={a} ours | α={a} paper | gap" for a in ALPHAS) + " |"
    lines = [head, "|:---|" + "---:|" * (3 * len(ALPHAS))]
    for method, refs in paper.items():
        cells = []
        for alpha, ref in zip(ALPHAS, refs, strict=True):
            cells += cell(runs_of(roots, alpha, method), metric, rnd, ref, best)
        lines.append(f"| {NAMES[method]} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("roots", nargs="*", type=Path, default=[Path("runs/reproduce/fedrane-fmnist"), RESULTS])
    parser.add_argument("--round", type=int, default=None, help="report this round (default: the common last one)")
    parser.add_argument("--best", action="store_true", help="best value over rounds 1..R instead of round R's")
    parser.add_argument("--last", action="store_true", help="each cell at its own last round (named in the cell)")
    args = parser.parse_args()
    if args.last and args.round:
        parser.error("--last and --round exclude each other")
    runs = [r for a in ALPHAS for m in NAMES for r in runs_of(args.roots, a, m)]
    if not runs:
        raise SystemExit(f"no runs under {', '.join(map(str, args.roots))}: run benchmarks/reproduce/fedrane/run.sh")
    rnd = None if args.last else args.round or min(r.last_round for r in runs)
    if rnd is None:
        what = "best over rounds 1-R" if args.best else "at round R"
    else:
        what = f"best over rounds 1-{rnd}" if args.best else f"at round {rnd}"
    seeds = sorted({r.config["run"]["seed"] for r in runs})
    print(f"Ours {what} (seeds {seeds}; one seed unless a cell says more) beside the paper's (5 runs, ~100 rounds).\n")
    for title, metric, paper in TABLES:
        print(f"### {title}\n\n{table(args.roots, metric, paper, rnd, args.best)}")


if __name__ == "__main__":
    main()

"""FedACD's Tables 1, 2, 3 and 9 from a folder of runs (benchmarks/reproduce/fedacd/run.sh), beside the paper's.

    python benchmarks/reproduce/fedacd/tables.py [RUNS_DIR ...] [--round R]

Each RUNS_DIR holds alpha<B>/<method>-s<seed> run folders (default: runs/reproduce/fedacd-fmnist, then the archived
cells in benchmarks/reproduce/fedacd/results, written by benchmarks/reproduce/archive.py); a cell found in several
is read from the first. Each cell is the mean
± sample std over the seeds that reached round R (default: the config's last round), with the seed count when it is
not 3; a cell no seed reached is "—". The paper's columns are CIFAR-10 (Tables 1-3) and CIFAR-100 (Table 9, the only
dataset it reports KL for), copied from notes/fedacd.md section 6. Prints markdown.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

METHODS = ["fedavg", "fedprox", "fednova", "creff", "fedrod", "fedntd", "fedlc", "feddecorr", "fednh", "fedacd"]
NAMES = {
    "fedavg": "FedAvg",
    "fedprox": "FedProx",
    "fednova": "FedNova",
    "creff": "CReFF",
    "fedrod": "FedRoD",
    "fedntd": "FedNTD",
    "fedlc": "FedLC",
    "feddecorr": "FedDecorr",
    "fednh": "FedNH",
    "fedacd": "FedACD",
}
BETAS = ["0.3", "0.1", "0.05"]
RESULTS = Path(__file__).parent / "results"  # archived finished cells (benchmarks/reproduce/archive.py)

# The paper's numbers, beta = 0.3 / 0.1 / 0.05 (Tables 1-3: CIFAR-10; Table 9: CIFAR-100).
PAPER = {
    "test_acc": {
        "fedavg": "75.63 ± 0.75 | 68.35 ± 2.43 | 60.47 ± 3.74",
        "fedprox": "75.54 ± 0.91 | 68.80 ± 2.60 | 62.18 ± 0.20",
        "fednova": "75.19 ± 1.15 | 67.02 ± 2.90 | 56.63 ± 1.88",
        "creff": "76.07 ± 0.85 | 69.40 ± 2.17 | 61.71 ± 3.57",
        "fedrod": "77.53 ± 0.86 | 71.12 ± 1.33 | 62.46 ± 3.29",
        "fedntd": "76.01 ± 0.47 | 70.41 ± 0.76 | 60.48 ± 1.41",
        "feddecorr": "74.51 ± 0.37 | 71.80 ± 1.81 | 61.19 ± 1.79",
        "fedlc": "76.76 ± 0.56 | 69.40 ± 1.40 | 52.71 ± 4.09",
        "fednh": "75.30 ± 0.84 | 68.11 ± 2.15 | 60.54 ± 2.61",
        "fedacd": "79.57 ± 0.02 | 73.13 ± 0.52 | 63.57 ± 0.46",
    },
    "client_dist_acc": {
        "fedavg": "76.29 ± 2.19 | 70.75 ± 1.93 | 62.67 ± 2.62",
        "fedprox": "75.99 ± 1.95 | 70.52 ± 2.10 | 62.27 ± 2.53",
        "fednova": "75.89 ± 2.09 | 67.27 ± 5.83 | 55.44 ± 2.52",
        "creff": "76.27 ± 1.56 | 69.08 ± 2.74 | 60.49 ± 5.37",
        "fedrod": "77.71 ± 0.98 | 71.53 ± 1.86 | 62.84 ± 3.16",
        "fedntd": "76.69 ± 1.26 | 67.92 ± 2.10 | 59.26 ± 4.13",
        "feddecorr": "75.84 ± 2.04 | 70.74 ± 2.21 | 62.48 ± 2.52",
        "fedlc": "77.08 ± 1.47 | 70.61 ± 1.99 | 56.52 ± 5.13",
        "fednh": "75.89 ± 1.57 | 69.70 ± 1.38 | 61.73 ± 3.12",
        "fedacd": "79.39 ± 0.85 | 74.05 ± 3.00 | 63.56 ± 2.88",
    },
    "local_risk": {
        "fedavg": "0.41 ± 0.033 | 0.57 ± 0.019 | 0.70 ± 0.020",
        "fedprox": "0.41 ± 0.034 | 0.58 ± 0.019 | 0.70 ± 0.020",
        "fednova": "0.41 ± 0.032 | 0.56 ± 0.030 | 0.69 ± 0.030",
        "creff": "0.41 ± 0.033 | 0.57 ± 0.019 | 0.70 ± 0.020",
        "fedrod": "0.30 ± 0.014 | 0.38 ± 0.020 | 0.47 ± 0.031",
        "fedntd": "0.31 ± 0.030 | 0.46 ± 0.028 | 0.59 ± 0.030",
        "feddecorr": "0.41 ± 0.033 | 0.58 ± 0.019 | 0.70 ± 0.021",
        "fedlc": "0.30 ± 0.026 | 0.39 ± 0.023 | 0.49 ± 0.062",
        "fednh": "0.40 ± 0.031 | 0.55 ± 0.020 | 0.69 ± 0.021",
        "fedacd": "0.25 ± 0.017 | 0.31 ± 0.012 | 0.39 ± 0.031",
    },
    "local_kl": {
        "fedavg": "4.06 ± 0.05 | 4.99 ± 0.09 | 5.59 ± 0.16",
        "fedprox": "4.05 ± 0.01 | 4.96 ± 0.11 | 5.61 ± 0.18",
        "fednova": "4.06 ± 0.01 | 4.97 ± 0.10 | 5.58 ± 0.18",
        "creff": "4.06 ± 0.05 | 4.99 ± 0.09 | 5.59 ± 0.16",
        "fedrod": "2.99 ± 0.03 | 3.05 ± 0.01 | 3.07 ± 0.02",
        "fedntd": "2.63 ± 0.01 | 2.79 ± 0.03 | 3.01 ± 0.03",
        "feddecorr": "4.03 ± 0.02 | 4.91 ± 0.10 | 5.49 ± 0.17",
        "fedlc": "3.45 ± 0.04 | 3.49 ± 0.02 | 3.67 ± 0.06",
        "fednh": "2.59 ± 0.01 | 2.97 ± 0.08 | 3.36 ± 0.14",
        "fedacd": "0.83 ± 0.01 | 0.70 ± 0.02 | 0.60 ± 0.03",
    },
}
TABLES = [
    ("Table 1: global model, uniform test set (%)", "test_acc", "CIFAR-10"),
    ("Table 2: global model on each client's label distribution, exact (%)", "client_dist_acc", "CIFAR-10"),
    ("Table 2, sampled: global model on a test sample drawn per client (%)", "client_dist_acc_sampled", None),
    ("Table 3: local models' risk over all clients' distributions (lower is better)", "local_risk", "CIFAR-10"),
    ("Table 9: local models' KL(P^m || Q) (lower is better)", "local_kl", "CIFAR-100"),
]


def value_at(run: Path, metric: str, rnd: int) -> float | None:
    log = run / "metrics.jsonl"
    for line in log.read_text().splitlines() if log.exists() else []:
        record = json.loads(line)
        if record["round"] == rnd and record.get(metric) is not None:
            return float(record[metric])
    return None


def cell(runs: list[Path], metric: str, rnd: int) -> str:
    values = [v for v in (value_at(r, metric, rnd) for r in runs) if v is not None]
    if not values:
        return "—"
    scale, digits = (100.0, 2) if "acc" in metric else (1.0, 3)
    text = f"{statistics.fmean(values) * scale:.{digits}f}"
    if len(values) > 1:
        text += f" ± {statistics.stdev(values) * scale:.{digits}f}"
    return text if len(values) == 3 else f"{text} ({len(values)} seed{'s' * (len(values) > 1)})"


def final_round(roots: list[Path]) -> int:
    for root in roots:
        for config in root.rglob("config.json"):
            return int(json.loads(config.read_text())["run"]["rounds"])
    raise SystemExit(f"no runs under {', '.join(map(str, roots))}")


def seed_runs(roots: list[Path], beta: str, method: str) -> list[Path]:
    """One folder per seed of a cell, from the first root that has that seed."""
    found: dict[str, Path] = {}
    for root in roots:
        for run in sorted((root / f"alpha{beta}").glob(f"{method}-s*")):
            found.setdefault(run.name, run)
    return [found[name] for name in sorted(found)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("roots", nargs="*", type=Path, default=[Path("runs/reproduce/fedacd-fmnist"), RESULTS])
    parser.add_argument("--round", type=int, default=None, help="the round to report (default: the last)")
    args = parser.parse_args()
    rnd = args.round or final_round(args.roots)
    print(f"Round {rnd}; mean ± std over seeds (3 unless stated).\n")
    for title, metric, paper in TABLES:
        head = "| Method | " + " | ".join(f"β={b}" for b in BETAS)
        head += " | " + " | ".join(f"paper {paper} β={b}" for b in BETAS) if paper else ""
        print(f"### {title}\n\n{head} |\n|" + "---|" * (1 + len(BETAS) * (2 if paper else 1)))
        for m in METHODS:
            cells = [cell(seed_runs(args.roots, b, m), metric, rnd) for b in BETAS]
            row = f"| {NAMES[m]} | " + " | ".join(cells)
            print(row + (f" | {PAPER[metric][m]}" if paper else "") + " |")
        print()


if __name__ == "__main__":
    main()

"""FedUFO's Tables 1-2 (accuracy; best / worst / std of the clients' accuracies) and its ablations from a folder of
runs (benchmarks/reproduce/fedufo/fmnist.toml), beside the paper's MNIST numbers.

    python benchmarks/reproduce/fedufo/tables.py [RUNS_DIR ...] [--rounds 25,50,75,100]

Each RUNS_DIR holds <variant>-s<seed> run folders (default: runs/reproduce/fedufo-fmnist, then the archived cells in
benchmarks/reproduce/fedufo/results); a cell found in several is read from the first. Accuracy is the global model's
on the test set at each listed round, then, averaged over the last five evaluations up to the last listed round
(the curves swing by 5-10 points between evaluations, the worst client's accuracy by 20-40), the accuracy and P_b /
P_w / P_std (client_acc_max / _min / _std: the global model on each client's matched local test data); each the
mean ± sample std over the seeds that reached that round, with the seed count. Variants the folders do not hold
are left out. Prints markdown.
"""

from __future__ import annotations

import argparse
import functools
import statistics
from pathlib import Path

from fedhet.results.store import read_metrics

RESULTS = Path(__file__).parent / "results"
# Table 1 (MNIST P_acc) and Table 2 (MNIST P_b / P_w / P_std); Table 4 for the ablations (no P_acc on MNIST)
PAPER = {
    "centralized": ("97.89 ± 0.08", "100", "91.55", "1.47"),
    "fedavg": ("94.38 ± 1.72", "98.95", "86.80", "2.81"),
    "fedmeta": ("94.23 ± 0.41", "98.86", "85.00", "2.80"),
    "fml": ("93.73 ± 1.39", "98.75", "85.88", "2.84"),
    "fedavg+rprop": ("95.00 ± 0.10", "100", "82.40", "3.79"),
    "qfedavg": ("87.70 ± 1.39", "98.10", "71.81", "4.99"),
    "feduad": ("96.70 ± 0.20", "100", "89.69", "2.05"),
    "fedufo": ("96.75 ± 0.07", "100", "89.69", "1.87"),
    "fedufo_cls": ("—", "98.95", "86.80", "2.81"),
    "fedufo_cgr": ("—", "98.79", "87.01", "2.39"),
    "fedufo_cgl": ("—", "99.52", "88.87", "2.06"),
    "fedufo_uad_cgr": ("—", "100", "89.28", "1.95"),
    "fedufo_uad_cgl": ("—", "100", "89.79", "1.90"),
}
NAMES = {"fedavg+rprop": "FedRetile (fedavg+rprop)", "qfedavg": "q-FFL (q = 2)"}


def seed_runs(roots: list[Path], variant: str) -> list[Path]:
    found: dict[str, Path] = {}
    for root in roots:
        for run in sorted(root.glob(f"{variant.replace('+', '_')}-s*")):  # compare names fedavg+rprop fedavg_rprop
            if (run / "metrics.jsonl").exists():
                found.setdefault(run.name, run)
    return [found[name] for name in sorted(found)]


@functools.cache
def records(run: Path) -> list[dict]:
    """A run's metrics, read once (every cell of a row asks)."""
    return read_metrics(run / "metrics.jsonl")


def at(run: Path, metric: str, rnd: int) -> float | None:
    for record in records(run):
        if record["round"] == rnd and record.get(metric) is not None:
            return 100.0 * float(record[metric])
    return None


def tail_mean(run: Path, metric: str, last: int, count: int = 5) -> float | None:
    """Mean of ``metric`` over the run's last ``count`` evaluations up to round ``last`` (the curves are noisy)."""
    rows = records(run)
    if not any(r["round"] == last for r in rows):
        return None  # the run has not reached the round yet
    values = [100.0 * r[metric] for r in rows if r.get(metric) is not None and r["round"] <= last]
    return statistics.fmean(values[-count:]) if len(values) >= count else None


def summary(values: list[float]) -> str:
    if not values:
        return "—"
    text = f"{statistics.fmean(values):.2f}"
    if len(values) > 1:
        text += f" ± {statistics.stdev(values):.2f}"
    return f"{text} ({len(values)})"


def cell(runs: list[Path], metric: str, rnd: int) -> str:
    return summary([v for v in (at(r, metric, rnd) for r in runs) if v is not None])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("roots", nargs="*", type=Path, default=[Path("runs/reproduce/fedufo-fmnist"), RESULTS])
    parser.add_argument("--rounds", default="25,50,75,100", help="rounds at which to show the accuracy")
    args = parser.parse_args()
    rounds = [int(r) for r in args.rounds.split(",")]
    last = rounds[-1]
    fairness = ("client_acc_max", "client_acc_min", "client_acc_std")
    head = [f"acc @ {r}" for r in rounds] + [f"acc @ {last}, last 5 evals"]
    head += [f"{name} @ {last}, last 5 evals" for name in ("P_b", "P_w", "P_std")]
    print("Fashion-MNIST, accuracy in %, mean ± std over seeds (seed count in brackets); paper: MNIST.\n")
    print("| Method | " + " | ".join(head) + " | paper P_acc | paper P_b | paper P_w | paper P_std |")
    print("|---" * (len(head) + 5) + "|")
    for variant, paper in PAPER.items():
        runs = seed_runs(args.roots, variant)
        if not runs:
            continue
        ours = [cell(runs, "test_acc", r) for r in rounds]
        for metric in ("test_acc", *fairness):
            ours.append(summary([v for v in (tail_mean(r, metric, last) for r in runs) if v is not None]))
        print(f"| {NAMES.get(variant, variant)} | " + " | ".join(ours + list(paper)) + " |")


if __name__ == "__main__":
    main()

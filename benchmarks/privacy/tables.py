"""The privacy table of docs/privacy-robustness.md from run.sh's folders.

Usage: python benchmarks/privacy/tables.py [OUT]   (OUT default runs/privacy-fmnist)

Each cell is the final evaluation's test accuracy (mean over the seeds found) with the epsilon the run spent
(privacy/epsilon) and the noise multiplier its target gave, and the rounds the runs reached; a cell whose runs have
not finished says so."""

from __future__ import annotations

import sys
from pathlib import Path
from statistics import mean

from fedhet import load_run

EPSILONS = ["1", "4", "8", "inf"]
METHODS = ["fedavg", "scaffold", "fedrcl"]


def final_record(run: Path) -> tuple[dict, int, bool]:
    """The run's last evaluation, its configured rounds and whether it finished."""
    result = load_run(run)
    return result.final, result.config["run"]["rounds"], result.summary.get("status") == "finished"


def cell(out: Path, eps: str, method: str) -> str:
    found = sorted(p for p in (out / f"eps{eps}").glob(f"{method}-s*") if (p / "metrics.jsonl").exists())
    if not found:
        return "–"
    records = [final_record(r) for r in found]
    acc = mean(100 * r[0]["test_acc"] for r in records)
    text = f"{acc:.1f}"
    if eps != "inf":
        spent = mean(r[0]["privacy/epsilon"] for r in records)
        text += f" (eps {spent:.2f}, z {records[0][0]['privacy/noise_multiplier']:.2f})"
    rounds = {r[0]["round"] for r in records}
    if not all(r[2] for r in records):
        text += f" [round {min(rounds)} of {records[0][1]}, unfinished]"
    return text


def main(out: Path) -> None:
    print("| method | " + " | ".join(f"epsilon {e}" for e in EPSILONS) + " |")
    print("|---|" + "---|" * len(EPSILONS))
    for method in METHODS:
        print(f"| {method} | " + " | ".join(cell(out, e, method) for e in EPSILONS) + " |")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/privacy-fmnist"))

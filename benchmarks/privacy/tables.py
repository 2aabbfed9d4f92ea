"""The privacy table of docs/privacy-robustness.md from run.sh's folders.

Usage: python benchmarks/privacy/tables.py [OUT]   (OUT default runs/privacy-fmnist)

Each cell is the final evaluation's test accuracy (mean over the seeds found) with the epsilon the run spent
(privacy/epsilon) and the noise multiplier its target gave, and the rounds the runs reached; a cell whose runs have
not finished says so, and one whose run failed (e.g. every client's model turned non-finite) says why."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from statistics import mean

from fedhet import load_run

EPSILONS = ["1", "4", "8", "inf"]
METHODS = ["fedavg", "scaffold", "fedrcl"]


def final_record(run: Path) -> tuple[dict, int, str]:
    """The run's last evaluation, its configured rounds and its status (finished, failed or unfinished)."""
    result = load_run(run)
    return result.final, result.config["run"]["rounds"], result.summary.get("status", "unfinished")


def failure(run: Path) -> str:
    """Why a failed run stopped, in a few words: the first clause of its summary's error and what its clients hit."""
    result = load_run(run)
    why = result.summary.get("error", "").split(";")[0]
    errors = [json.loads(line)["error"] for line in (run / "failures.jsonl").read_text().splitlines()[:1]]
    return why + (f" (clients: {errors[0]})" if errors else "")


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
    failed = [run for run, r in zip(found, records, strict=True) if r[2] == "failed"]
    if failed:
        text += f" [last evaluated at round {min(rounds)}; failed: {failure(failed[0])}]"
    elif any(r[2] != "finished" for r in records):
        text += f" [round {min(rounds)} of {records[0][1]}, unfinished]"
    return text


def main(out: Path) -> None:
    print("| method | " + " | ".join(f"epsilon {e}" for e in EPSILONS) + " |")
    print("|---|" + "---|" * len(EPSILONS))
    for method in METHODS:
        print(f"| {method} | " + " | ".join(cell(out, e, method) for e in EPSILONS) + " |")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/privacy-fmnist"))

"""The privacy table of docs/privacy-robustness.md from run.sh's folders.

Usage: python benchmarks/privacy/tables.py [OUT]   (OUT default runs/privacy-fmnist)

Each cell is the final evaluation's test accuracy (mean over the seeds found; with the best evaluation's where that
was more than a point higher) with the epsilon the run spent
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


def summary(run: Path) -> dict:
    """summary.json, or {} for a run still going (or killed before it wrote one)."""
    path = run / "summary.json"
    return json.loads(path.read_text()) if path.exists() else {}


def failure(run: Path, status: dict) -> str:
    """Why a failed run stopped, in a few words: the first clause of its summary's error and what its clients hit."""
    why = status.get("error", "").split(";")[0]
    failures = run / "failures.jsonl"
    errors = [json.loads(line)["error"] for line in failures.read_text().splitlines()[:1]] if failures.exists() else []
    return why + (f" (clients: {errors[0]})" if errors else "")


def cell(out: Path, eps: str, method: str) -> str:
    found = sorted(p for p in (out / f"eps{eps}").glob(f"{method}-s*") if (p / "config.json").exists())
    if not found:
        return "–"
    status = {run: summary(run) for run in found}
    failed = [run for run in found if status[run].get("status") == "failed"]
    why = (
        f"failed after round {status[failed[0]]['rounds_done']}: {failure(failed[0], status[failed[0]])}"
        if failed
        else ""
    )
    evaluated = [load_run(run) for run in found if (run / "metrics.jsonl").exists()]
    evaluated = [result for result in evaluated if result.final]
    if len(evaluated) < len(found):  # a seed without an evaluation: no mean to show
        return f"[{why or 'not yet evaluated'}]"
    finals = [result.final for result in evaluated]
    text = f"{mean(100 * f['test_acc'] for f in finals):.1f}"
    peaks = [max(result.records, key=lambda r: r.get("test_acc", 0.0)) for result in evaluated]
    if mean(p["test_acc"] for p in peaks) > mean(f["test_acc"] for f in finals) + 0.01:  # noise undid some progress
        rounds = "/".join(str(p["round"]) for p in peaks)
        text += f" (best {mean(100 * p['test_acc'] for p in peaks):.1f} at round {rounds})"
    if eps != "inf":
        spent = mean(f["privacy/epsilon"] for f in finals)
        text += f" (eps {spent:.2f}, z {finals[0]['privacy/noise_multiplier']:.2f})"
    last = min(f["round"] for f in finals)
    if why:
        text += f" [last evaluated at round {last}; {why}]"
    elif any(status[run].get("status") != "finished" for run in found):
        text += f" [round {last} of {evaluated[0].config['run']['rounds']}, unfinished]"
    return text


def main(out: Path) -> None:
    print("| method | " + " | ".join(f"epsilon {e}" for e in EPSILONS) + " |")
    print("|---|" + "---|" * len(EPSILONS))
    for method in METHODS:
        print(f"| {method} | " + " | ".join(cell(out, e, method) for e in EPSILONS) + " |")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/privacy-fmnist"))

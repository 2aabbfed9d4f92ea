"""The robustness tables of docs/privacy-robustness.md from run.sh's folders.

Usage: python benchmarks/robustness/tables.py [OUT]   (OUT default runs/robustness-fmnist)

Each cell is the final evaluation's test accuracy (and for the backdoor its attack success rate, attack/asr), mean
over the seeds found, with the rounds the runs reached; a cell whose runs have not finished says so."""

from __future__ import annotations

import sys
from pathlib import Path
from statistics import mean

from fedhet import load_run

ATTACKS = [("none", None), ("sign_flip", 0.1), ("sign_flip", 0.3), ("backdoor", 0.1), ("backdoor", 0.3)]
AGGREGATIONS = ["weights", "median", "trimmed_mean", "krum", "multikrum", "geomed"]
METHODS = ["fedavg", "scaffold"]


def runs(out: Path, attack: str, fraction: float | None, agg: str, method: str) -> list[Path]:
    folder = out / attack / agg
    if fraction is not None:
        folder = folder / f"fraction{fraction:g}"
    return sorted(p for p in folder.glob(f"{method}-s*") if (p / "metrics.jsonl").exists())


def final_record(run: Path) -> tuple[dict, int, bool]:
    """The run's last evaluation, its configured rounds and whether it finished."""
    result = load_run(run)
    return result.final, result.config["run"]["rounds"], result.summary.get("status") == "finished"


def cell(out: Path, attack: str, fraction: float | None, agg: str, method: str, key: str) -> str:
    found = runs(out, attack, fraction, agg, method)
    if not found:
        return "–"
    records = [final_record(r) for r in found]
    values = [r[0].get(key) for r in records if r[0].get(key) is not None]
    if not values:
        return "–"
    text = f"{100 * mean(values):.1f}"
    unfinished = [r for r in records if not r[2]]
    if unfinished:
        text += f" (round {min(r[0]['round'] for r in unfinished)})"
    return text


def table(out: Path, key: str, attacks: list[tuple[str, float | None]]) -> str:
    head = ["method", "aggregation"] + [a if f is None else f"{a} {f:.0%}" for a, f in attacks]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for method in METHODS:
        for agg in AGGREGATIONS:
            if not any(runs(out, a, f, agg, method) for a, f in attacks):
                continue
            rows.append(
                "| " + " | ".join([method, agg] + [cell(out, a, f, agg, method, key) for a, f in attacks]) + " |"
            )
    return "\n".join(rows)


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/robustness-fmnist")
    print("Final test accuracy (%):\n")
    print(table(out, "test_acc", ATTACKS))
    print("\nBackdoor attack success rate (%, stamped test samples of other classes labelled the target):\n")
    print(table(out, "attack/asr", [a for a in ATTACKS if a[0] == "backdoor"]))


if __name__ == "__main__":
    main()

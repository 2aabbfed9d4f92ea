"""The table of diagnose.sh's runs: accuracy per round, its mean over rounds 5-15, and the last round's loss terms.

python benchmarks/reproduce/fedufo/diag_table.py [RUNS_DIR]      (default runs/ufo-diag)
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from fedhet.results.store import read_metrics


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/ufo-diag")
    print("| run | accuracy per round (%) | mean, rounds 5-15 | loss terms at round 15 |")
    print("|---|---|---:|---|")
    for log in sorted(root.glob("*/metrics.jsonl")):
        records = [r for r in read_metrics(log) if r.get("test_acc") is not None]
        acc = [100 * r["test_acc"] for r in records]
        terms = ", ".join(
            f"{k.removeprefix('fedufo_').removesuffix('_loss')} {v:.3f}"
            for k, v in records[-1].items()
            if k.startswith("fedufo_") and k.endswith("_loss")
        )
        mean = f"{statistics.fmean(acc[4:]):.1f}" if len(acc) > 4 else "—"
        print(f"| {log.parent.name} | {' '.join(f'{a:.0f}' for a in acc)} | {mean} | {terms} |")


if __name__ == "__main__":
    main()

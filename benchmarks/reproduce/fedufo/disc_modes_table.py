"""FedUFO's discriminator readings at E = 10 beside FedAvg, the paper-literal FedUFO and the +cgr / +cgl ablations
(docs/reproductions/fedufo.md, "Discriminator readings"; cells from disc_modes.sh).

    python benchmarks/reproduce/fedufo/disc_modes_table.py [--upto R]

Reads each cell from runs/reproduce/... if it is there, else from its archive under benchmarks/reproduce/fedufo/
(results/, results-fresh/, results-frozen/). Cells may be partial (a run stopped at a deadline): every value names
its cell's last logged round. Per seed: accuracy at rounds 25 / 50 / 75 / 100 and the mean of the last five
evaluations up to the cell's last round (with those rounds); then, over the seeds that reached round 100, mean ±
sample std of that last-five mean, and of the worst client's accuracy over the same evaluations. ``--upto R`` reads
every cell only up to round R, so that partial cells can be set beside the others at the same round.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from fedhet.results.store import read_metrics

HERE = Path(__file__).parent
ROWS = [  # label, runs folder, archive folder, cell prefix
    ("FedAvg", "runs/reproduce/fedufo-fmnist", HERE / "results", "fedavg"),
    ("FedUFO, disc_mode federated (paper-literal)", "runs/reproduce/fedufo-fmnist", HERE / "results", "fedufo"),
    ("FedUFO, disc_mode fresh, kl mean", "runs/reproduce/fedufo-fmnist-fresh", HERE / "results-fresh", "fedufo"),
    ("FedUFO, disc_mode frozen, kl mean", "runs/reproduce/fedufo-fmnist-frozen", HERE / "results-frozen", "fedufo"),
    ("+cgr (CE + CGR)", "runs/reproduce/fedufo-fmnist", HERE / "results", "fedufo_cgr"),
    ("+cgl (CE + 3 CGL)", "runs/reproduce/fedufo-fmnist", HERE / "results", "fedufo_cgl"),
]
SEEDS = (0, 1, 2)


def find(runs: str, archive: Path, prefix: str, seed: int) -> Path | None:
    """The cell with more rounds of the live run folder and its archive."""
    best, best_round = None, -1
    for root in (Path(runs), archive):
        cell = root / f"{prefix}-s{seed}" / "metrics.jsonl"
        if cell.exists():
            rows = read_metrics(cell)
            if rows and rows[-1]["round"] > best_round:
                best, best_round = cell.parent, rows[-1]["round"]
    return best


def describe(run: Path, upto: int) -> tuple[str, float | None, float | None, int]:
    rows = [r for r in read_metrics(run / "metrics.jsonl") if r.get("test_acc") is not None and r["round"] <= upto]
    by_round = {r["round"]: 100 * r["test_acc"] for r in rows}
    last = rows[-1]["round"]
    points = " / ".join(f"{by_round[r]:.1f}" if r in by_round else "—" for r in (25, 50, 75, 100))
    tail = rows[-5:]
    mean = statistics.fmean(100 * r["test_acc"] for r in tail)
    worst = statistics.fmean(100 * r["client_acc_min"] for r in tail if r.get("client_acc_min") is not None)
    text = f"{points}; last 5 (R{tail[0]['round']}-{last}) {mean:.2f}, worst client {worst:.1f}"
    return text, mean, worst, last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upto", type=int, default=100, help="read every cell up to this round")
    args = parser.parse_args()
    print(f"| method | seed 0 | seed 1 | seed 2 | seeds at round {args.upto}: acc, last 5 evals | worst client |")
    print("|---|---|---|---|---|---|")
    for label, runs, archive, prefix in ROWS:
        cells, full, worst = [], [], []
        for seed in SEEDS:
            run = find(runs, archive, prefix, seed)
            if run is None:
                cells.append("not run")
                continue
            text, mean, w, last = describe(run, args.upto)
            cells.append(f"R{last}: {text}")
            if last >= args.upto:
                full.append(mean)
                worst.append(w)

        def agg(values: list[float]) -> str:
            if not values:
                return "—"
            sd = f" ± {statistics.stdev(values):.2f}" if len(values) > 1 else ""
            return f"{statistics.fmean(values):.2f}{sd} ({len(values)})"

        print(f"| {label} | " + " | ".join(cells) + f" | {agg(full)} | {agg(worst)} |")


if __name__ == "__main__":
    main()

"""Probe FedBC's Table 1 cells that sit furthest from the paper: what moves them and what does not.

    nice -n 10 .venv/bin/python benchmarks/reproduce/fedbc/probes.py [--jobs 2] [--out runs/fedbc-probes]
    .venv/bin/python benchmarks/reproduce/fedbc/probes.py --table-only

Each probe changes one thing against the Table 1 run (synthetic.toml with table1.py's per-method settings) and reads
the global test accuracy at rounds 50, 100 and 200 (mean ± std over the seeds that finished):

- rounds: the official script's T = 50 against 200 (the paper's Figs. 3-4 talk of 100 and 200 rounds);
- data: another draw of Synthetic(0.5, 0.5) and its split (dataset.seed = partition.seed = d), since Table 1's
  "±" over run seeds cannot show how much one data set decides;
- SCAFFOLD: without momentum (where ours and the official code's control-variate arithmetic are the same), and at
  the lr of every other method (0.01) instead of the official script's 0.1;
- official: the FedBC code's own data set (dataset.generator = "fedbc", seed 1 of create_partition_synthetic.sh,
  each user's own 80/20 split) for the E = 1 column and FedAvg/FedBC at E = 50, 100 rounds.

The runs are fedhet runs in OUT/<probe>-s<seed>, run like table1.py's (finished ones skipped, killed ones resumed).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from table1 import TRAIN_OVERRIDES, algo_overrides, cells, finished_run  # noqa: E402

READ_AT = (50, 100, 200)
# The FedBC code's own data set: create_partition_synthetic.sh's seed 1, drawn as its partition.py draws it, with each
# user's 80/20 split as its local test data (the global test set is their union, as before).
OFFICIAL = [
    "dataset.generator='fedbc'",
    "dataset.seed=1",
    "partition.local_test='natural'",
    "partition.local_test_fraction=0.0",
]
SEEDS = (0, 1, 2)
# (probe name, algorithm, local epochs E, rounds, extra overrides, seeds)
PROBES: list[tuple[str, str, int, int, list[str], tuple[int, ...]]] = [
    *[(f"{a}-E1-T200", a, 1, 200, [], SEEDS) for a in ("fedavg", "fedprox", "scaffold", "fedbc")],
    ("scaffold-E1-momentum0", "scaffold", 1, 50, ["train.momentum=0.0"], SEEDS),
    ("scaffold-E1-lr0.01", "scaffold", 1, 50, ["train.lr=0.01"], SEEDS),
    *[
        (f"{a}-E1-data{d}", a, 1, 50, [f"dataset.seed={d}", f"partition.seed={d}"], SEEDS)
        for d in (1, 2, 3)
        for a in ("fedavg", "fedprox", "scaffold", "fedbc")
    ],
    *[(f"{a}-E50-T200", a, 50, 200, [], SEEDS) for a in ("fedavg", "fedbc")],
    *[
        (f"{a}-E50-data{d}", a, 50, 50, [f"dataset.seed={d}", f"partition.seed={d}"], (0,))
        for d in (1, 2)
        for a in ("fedavg", "fedbc")
    ],
    *[
        (f"{a}-E1-official-T100", a, 1, 100, OFFICIAL, SEEDS)
        for a in ("fedavg", "qfedavg", "fedprox", "scaffold", "fedbc")
    ],
    *[(f"{a}-E50-official-T100", a, 50, 100, OFFICIAL, SEEDS) for a in ("fedavg", "fedbc")],
]


def tasks(only: str | None) -> list[tuple[str, list[str], int]]:
    """(run name, overrides, cost), cheapest first, as table1.tasks gives them to table1.cells."""
    out = []
    for probe, algo, epochs, rounds, extra, seeds in PROBES:
        if only and only not in probe:
            continue
        for seed in seeds:
            sets = algo_overrides(algo) + TRAIN_OVERRIDES.get(algo, []) + extra
            sets += [f"train.local_epochs={epochs}", f"run.rounds={rounds}", f"run.seed={seed}", "run.progress=false"]
            out.append((f"{probe}-s{seed}", sets, epochs * rounds))
    return sorted(out, key=lambda t: t[2])


def accuracy_at(out: Path, name: str, rounds: int) -> float | None:
    run = finished_run(out, name)
    if run is None:
        return None
    return dict(run.values("test_acc")).get(rounds)


def mean_std(values: list[float]) -> str:
    if not values:
        return "—"
    mean = 100 * statistics.fmean(values)
    return f"{mean:.2f} ± {100 * statistics.stdev(values):.2f} ({len(values)})" if len(values) > 1 else f"{mean:.2f}"


def table(out: Path) -> str:
    lines = ["| probe | " + " | ".join(f"acc @ round {r}" for r in READ_AT) + " |", "|:---|" + "---:|" * len(READ_AT)]
    for probe, _, _, rounds, _, seeds in PROBES:
        cols = []
        for r in READ_AT:
            accs = [a for a in (accuracy_at(out, f"{probe}-s{s}", r) for s in seeds) if a is not None]
            cols.append(mean_std(accs) if r <= rounds else "")
        lines.append(f"| {probe} | " + " | ".join(cols) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/fedbc-probes")
    parser.add_argument("--jobs", default="auto", help="runs at once (default: one per usable core)")
    parser.add_argument("--only", default=None, help="run only the probes whose name contains this")
    parser.add_argument("--table-only", action="store_true", help="only tabulate the runs already in OUT")
    args = parser.parse_args()
    from fedhet.cells import parse_jobs, run_cells

    out = Path(args.out)
    todo = [] if args.table_only else tasks(args.only)
    results = run_cells(cells(todo, str(out)), jobs=parse_jobs(args.jobs), threads=1)
    text = "Global test accuracy (%), mean ± std (number of seeds):\n\n" + table(out)
    (out / "probes.md").parent.mkdir(parents=True, exist_ok=True)
    (out / "probes.md").write_text(text)
    print(text)
    failed = [r.name for r in results if r.status == "failed"]
    if failed:
        sys.exit(f"{len(failed)} runs failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()

"""Reproduce FedBC's Table 1 (Synthetic(0.5, 0.5), global test accuracy vs local epochs E) and write it, with the
paper's numbers beside ours, as Markdown.

    nice -n 10 .venv/bin/python benchmarks/reproduce/fedbc/table1.py [--jobs 2] [--out runs/fedbc-synthetic]

Every (method, E, seed) run is an ordinary fedhet run of synthetic.toml with a few overrides, in
OUT/<label>-E<E>-s<seed>. They run as the cells of `fedhet compare` do (fedhet.cells.run_cells): --jobs at a time in
worker processes with one torch thread each, one progress display, finished runs skipped and killed ones resumed,
so a rerun continues where the last one stopped. (The table's rows need per-method training overrides, SCAFFOLD's
lr, which a compare variant list cannot express, hence this script.)
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIG = HERE / "synthetic.toml"
EPOCHS = (1, 5, 10, 25, 50)

# Table 1 of the paper (notes/fedbc.md section 6), global test accuracy in %, mean ± std.
PAPER = {
    "fedavg": ["83.61 ± 0.43", "83.42 ± 0.58", "83.49 ± 0.70", "83.73 ± 0.57", "82.94 ± 0.66"],
    "qfedavg": ["87.12 ± 0.25", "86.76 ± 0.15", "86.46 ± 0.28", "86.76 ± 0.12", "86.71 ± 0.12"],
    "fedprox": ["86.23 ± 0.42", "85.59 ± 0.37", "85.34 ± 0.61", "85.00 ± 0.63", "85.34 ± 0.48"],
    "scaffold": ["83.84 ± 0.09", "82.95 ± 0.30", "83.48 ± 0.21", "83.60 ± 0.21", "82.80 ± 0.62"],
    "fedbc": ["87.83 ± 0.35", "87.48 ± 0.18", "87.43 ± 0.20", "86.99 ± 0.11", "87.26 ± 0.12"],
}
NAMES = {"fedavg": "FedAvg", "qfedavg": "q-FedAvg", "fedprox": "FedProx", "scaffold": "SCAFFOLD", "fedbc": "FedBC"}
# Rows beyond the paper's: (label, algorithm, extra overrides, epochs).
EXTRA = [("fedbc_paper_dual", "fedbc", ["algorithm.dual_momentum=0.0"], (1, 5, 10))]
TRAIN_OVERRIDES = {"scaffold": ["train.lr=0.1"]}  # official synthetic_jobs.sh --lr 0.1 for SCAFFOLD only


def algo_overrides(algo: str) -> list[str]:
    from fedhet.config import load_raw

    params = load_raw(CONFIG)["compare"].get("params", {}).get(algo, {})
    return [f"algorithm.name={algo!r}"] + [f"algorithm.{k}={v!r}" for k, v in params.items()]


def tasks(seeds: list[int], rounds: int | None, columns: tuple[int, ...]) -> list[tuple[str, list[str], int]]:
    """(run name, overrides, cost) for every run, cheapest column first so that finished columns accumulate."""
    rows = [(a, a, [], EPOCHS) for a in PAPER] + EXTRA
    out = []
    for label, algo, extra, epochs in rows:
        for e in (e for e in epochs if e in columns):
            for seed in seeds:
                sets = algo_overrides(algo) + TRAIN_OVERRIDES.get(algo, []) + extra
                sets += [f"train.local_epochs={e}", f"run.seed={seed}", "run.progress=false"]
                sets += [f"run.rounds={rounds}"] if rounds else []
                out.append((f"{label}-E{e}-s{seed}", sets, e))
    return sorted(out, key=lambda t: t[2])


def cells(todo: list[tuple[str, list[str], int]], out_dir: str) -> list:
    from fedhet.cells import Cell
    from fedhet.config import load_config

    return [
        Cell(name, load_config(CONFIG, sets + [f"run.name={name!r}", f"run.out_dir={out_dir!r}"]))
        for name, sets, _ in todo
    ]


def finished_run(out: Path, name: str):
    """The run folder's contents if the run finished all its rounds, else None (unfinished runs are left out)."""
    from fedhet.results.report import load_run

    folder = out / name
    if not (folder / "summary.json").exists():
        return None
    run = load_run(folder)
    return run if run.summary.get("status") == "finished" else None


def final_acc(out: Path, name: str) -> float | None:
    run = finished_run(out, name)
    return run.final("test_acc") if run else None


def cell(values: list[float]) -> str:
    if not values:
        return "—"
    mean = 100 * statistics.fmean(values)
    return f"{mean:.2f} ± {100 * statistics.stdev(values):.2f}" if len(values) > 1 else f"{mean:.2f}"


def accuracy_table(out: Path, seeds: list[int]) -> str:
    head = "| Method | " + " | ".join(f"E={e} ours" + f" | E={e} paper" for e in EPOCHS) + " |"
    lines = [head, "|:---|" + "---:|" * (2 * len(EPOCHS))]
    rows = [(a, a) for a in PAPER] + [(label, algo) for label, algo, _, _ in EXTRA]
    for label, algo in rows:
        cells = []
        for i, e in enumerate(EPOCHS):
            accs = [a for a in (final_acc(out, f"{label}-E{e}-s{s}") for s in seeds) if a is not None]
            paper = PAPER[algo][i] if label == algo else "—"
            cells += [cell(accs), paper]
        name = NAMES[algo] if label == algo else f"{NAMES[algo]} ({label})"
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


FAIRNESS = [
    ("acc_smallest_client", "acc. smallest client"),
    ("acc_largest_client", "acc. largest client"),
    ("client_acc_std", "std across clients"),
    ("personal_acc_micro", "local-model acc. (micro)"),
    ("personal_acc_macro", "local-model acc. (macro)"),
    ("weight_share_smallest", "λ share smallest"),
    ("data_share_smallest", "data share smallest"),
    ("weight_share_largest", "λ share largest"),
    ("data_share_largest", "data share largest"),
]


def fairness_table(out: Path, seeds: list[int], epochs: int) -> str:
    """Final-round fairness diagnostics at one E (the paper's Figs. 3-4 use E = 5), mean over seeds."""
    lines = ["| Method | " + " | ".join(h for _, h in FAIRNESS) + " |", "|:---|" + "---:|" * len(FAIRNESS)]
    for algo in PAPER:
        runs = [r for r in (finished_run(out, f"{algo}-E{epochs}-s{s}") for s in seeds) if r is not None]
        cells = []
        for key, _ in FAIRNESS:
            values = [v for v in (r.final(key) for r in runs) if v is not None]
            scale = 100 if "acc" in key else 1
            cells.append(f"{scale * statistics.fmean(values):.{2 if scale == 100 else 3}f}" if values else "—")
        lines.append(f"| {NAMES[algo]} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/fedbc-synthetic")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--jobs", default="auto", help="runs at once (default: one per usable core)")
    parser.add_argument("--rounds", type=int, default=None, help="override run.rounds (default: the config's 50)")
    parser.add_argument("--epochs", default=",".join(map(str, EPOCHS)), help="columns to run, e.g. 1,5,10")
    parser.add_argument("--table-only", action="store_true", help="only tabulate the runs already in OUT")
    parser.add_argument("--markdown", default=None, help="write the tables here (default: OUT/table1.md)")
    args = parser.parse_args()
    from fedhet.cells import parse_jobs, run_cells

    seeds = [int(s) for s in args.seeds.split(",")]
    out = Path(args.out)
    planned = tasks(seeds, args.rounds, tuple(int(e) for e in args.epochs.split(",")))
    todo = [] if args.table_only else planned
    results = run_cells(cells(todo, str(out)), jobs=parse_jobs(args.jobs), threads=1)  # prints each failure
    failed = [r for r in results if r.status == "failed"]
    total = sum(run.summary.get("wall_time_s") or 0.0 for run in (finished_run(out, n) for n, _, _ in planned) if run)
    text = "Global test accuracy (%) at the final round, mean ± std over seeds " + f"{args.seeds}:\n\n"
    text += accuracy_table(out, seeds)
    text += "\nFinal-round fairness diagnostics at E = 5 (mean over seeds; shares are fractions):\n\n"
    text += fairness_table(out, seeds, 5)
    text += f"\nWall time of the finished runs (summed, from their summary.json): {total / 60:.1f} min\n"
    md = Path(args.markdown) if args.markdown else out / "table1.md"
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(text)
    print(text)
    if failed:
        sys.exit(f"{len(failed)} runs failed: {', '.join(r.name for r in failed)}")


if __name__ == "__main__":
    main()

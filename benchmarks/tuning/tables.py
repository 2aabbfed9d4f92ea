"""The tables of docs/tuning.md's study from run.sh's folders, beside docs/non-iid.md's default-settings cells.

Usage: python benchmarks/tuning/tables.py [OUT] [--claims DIR] [--retuned DIR] [--plot PNG]
  (defaults runs/tuning-fmnist, runs/tuning-claims, runs/tuning-fmnist-lr-wide)

For each kind, one row per method: its default-settings cell (benchmarks/noniid/results: fmnist.toml's settings,
train.lr 0.01, no validation split), its tuned cell (OUT/<kind>/<method>-s<seed>, else the archived copy in
benchmarks/tuning/results), the tuned minus default difference paired by seed, the values its tune chose, and the
tune's budget (trials complete + pruned, rounds run of the nominal trials x rounds). A cell is the final
evaluation's global test accuracy, mean ± sample std over the seeds that reached round 30, with those seeds; ranks
are by that mean among the methods with a finished cell in both columns (FedBN, with no global model, has none).

Then the claims (claims.sh): per seed paper, its method and its strongest baseline, both tuned, with the method
minus the baseline paired by seed (95 % paired bootstrap interval and Wilcoxon's p, fedhet.results.stats)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from statistics import mean, stdev

from fedhet.results.store import read_metrics

HERE = Path(__file__).parent
DEFAULTS = HERE.parent / "noniid" / "results"
ARCHIVE = HERE / "results"
KINDS = {"dir0.1": "Dir(0.1)", "two_classes": "2 classes", "rotated": "rotated ×4"}
METHODS = ["fedavg", "fedprox", "scaffold", "fednova", "feddyn", "moon", "fedbn", "fedrod"]
NO_GLOBAL_MODEL = {"fedbn"}  # its clients keep their BatchNorm layers: the averaged model is no model anyone uses
ROUNDS = 30


def _method(folder: Path, method: str) -> dict[int, float]:
    out = {}
    for run in sorted(folder.glob(f"{method}-s[0-9]*")):
        path = run / "metrics.jsonl"
        lines = read_metrics(path, lambda _: None) if path.exists() else []  # a line torn by a kill ends them
        if lines and lines[-1]["round"] >= ROUNDS:
            out[int(run.name.rsplit("-s", 1)[1])] = 100 * lines[-1]["test_acc"]
    return out


def spread(values: dict[int, float], signed: bool = False) -> str:
    if not values:
        return "–"
    v = list(values.values())
    text = f"{mean(v):{'+' if signed else ''}.1f}" + (f" ± {stdev(v):.1f}" if len(v) > 1 else "")
    return text + f" <sub>s{','.join(map(str, sorted(values)))}</sub>"


def tune_summary(out: Path, kind: str, method: str, archive: Path | None = None) -> dict | None:
    """A tune's tune.json, from OUT or else the archive (default: the study's)."""
    for base in (out, archive or ARCHIVE):
        path = base / kind / "tuning" / method / "tune.json"
        if path.exists():
            return json.loads(path.read_text())
    return None


def at_edge(summary: dict) -> dict[str, str]:
    """The best values at an edge of their range ("lower" | "upper"), from the tune's space (older tune.json files
    have no "at_edge" field)."""
    from fedhet.tuning.space import edges_of

    return edges_of(summary.get("space", ""), summary["best"]["params"])


def chosen(summary: dict | None) -> tuple[str, str]:
    if summary is None or summary.get("best") is None:
        return "–", "–"
    from fedhet.tuning.space import EDGE_MARKS

    marks = {k: EDGE_MARKS[side] for k, side in at_edge(summary).items()}
    values = ", ".join(f"{k.split('.')[-1]}={v:.3g}{marks.get(k, '')}" for k, v in summary["best"]["params"].items())
    b = summary["budget"]
    budget = f"{b['complete']}+{b['pruned']} of {b['trials']}, {b['rounds_run']}/{b['rounds_nominal']} rounds"
    return values, budget


def ranks(means: dict[str, float]) -> dict[str, int]:
    order = sorted(means, key=lambda m: -means[m])
    return {m: i + 1 for i, m in enumerate(order)}


BASELINE = "fedavg"  # the kind tables' paired comparison: each tuned method against tuned FedAvg


def against_baseline(tuned: dict[int, float], base: dict[int, float]) -> str:
    """Mean tuned − tuned-baseline difference paired by seed (a seed's cells share its partition), with the 95 %
    paired bootstrap interval and ▲/▼ where it excludes 0 (fedhet.results.stats, as fedhet compare gives them)."""
    from fedhet.results.stats import paired_difference

    seeds = sorted(set(tuned) & set(base))
    diff = paired_difference([tuned[s] for s in seeds], [base[s] for s in seeds])
    if diff.mean is None:
        return "–"
    return f"{diff.mean:+.1f} [{diff.ci_low:+.1f}, {diff.ci_high:+.1f}]{diff.marker}"


# a method retuned at the same budget with train.lr's range widened (run.sh with LR and its own OUT), where the edge
# probe (edge_probe.py) found its optimum below the study's range: its row follows the study's, outside the ranks
RETUNED_LR = "log:1e-4:0.3"
RETUNED_ARCHIVE = HERE / "results-lr-wide"


def tuned_cells(out: Path, archive: Path, kind: str, method: str) -> dict[int, float]:
    """A method's finished tuned runs of a kind: the archived ones, replaced by OUT's where both have a seed."""
    return {**_method(archive / kind, method), **_method(out / kind, method)}


def row(
    label: str,
    default: dict[int, float],
    tuned: dict[int, float],
    base: dict[int, float] | None,
    rank: str,
    summary: dict | None,
) -> str:
    """A kind table's row: both cells, their difference paired by seed, the rank change, the difference to tuned
    FedAvg (``base``; None: the row is FedAvg's), the chosen values and the budget."""
    shared = sorted(set(default) & set(tuned))
    diff = spread({s: tuned[s] - default[s] for s in shared}, signed=True)
    versus = against_baseline(tuned, base) if base is not None and tuned else "–"
    cells = [spread(default), spread(tuned), diff, rank, versus, *chosen(summary)]
    return f"| {label} | " + " | ".join(cells) + " |"


def retuned_rows(retuned: Path, kind: str, default: dict, base: dict[int, float]) -> list[str]:
    lines = []
    for m in METHODS:
        runs = tuned_cells(retuned, RETUNED_ARCHIVE, kind, m)
        summary = tune_summary(retuned, kind, m, RETUNED_ARCHIVE)
        if runs or summary is not None:
            lines.append(row(f"{m}, lr on {RETUNED_LR}²", default[m], runs, base, "–", summary))
    return lines


def kind_table(out: Path, kind: str, retuned: Path | None = None) -> list[str]:
    head = ["method", "default", "tuned", "tuned − default", "rank default → tuned", f"tuned − tuned {BASELINE}"]
    head += ["chosen", "budget"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---|" * (len(head) - 1)]
    default = {m: _method(DEFAULTS / kind, m) for m in METHODS}
    tuned = {m: tuned_cells(out, ARCHIVE, kind, m) for m in METHODS}
    both = [m for m in METHODS if default[m] and tuned[m] and m not in NO_GLOBAL_MODEL]
    rank_default = ranks({m: mean(default[m].values()) for m in both})
    rank_tuned = ranks({m: mean(tuned[m].values()) for m in both})
    for m in METHODS:
        if m in NO_GLOBAL_MODEL:
            lines.append(f"| {m} | n/a¹ | n/a¹ | | | | | |")
            continue
        rank = f"{rank_default[m]} → {rank_tuned[m]}" if m in both else "–"
        base = tuned[BASELINE] if m != BASELINE else None
        lines.append(row(m, default[m], tuned[m], base, rank, tune_summary(out, kind, m)))
    return lines if retuned is None else lines + retuned_rows(retuned, kind, default, tuned[BASELINE])


def rank_table(out: Path) -> list[str]:
    """Each method's rank per kind and its average over the kinds, default settings against tuned, over the kinds
    where every method of the study has both cells (fedhet.results.stats.average_ranks: 1 = best, ties averaged)."""
    from fedhet.results.stats import average_ranks

    methods = [m for m in METHODS if m not in NO_GLOBAL_MODEL]
    tables: dict[str, dict[str, dict[str, float]]] = {"default": {}, "tuned": {}}
    for kind in KINDS:
        default = {m: _method(DEFAULTS / kind, m) for m in methods}
        tuned = {m: tuned_cells(out, ARCHIVE, kind, m) for m in methods}
        if all(default[m] and tuned[m] for m in methods):
            tables["default"][kind] = {m: mean(default[m].values()) for m in methods}
            tables["tuned"][kind] = {m: mean(tuned[m].values()) for m in methods}
    kinds = list(tables["default"])
    if not kinds:
        return ["(no kind has every method's default and tuned cells yet)"]
    (by_kind_d, avg_d), (by_kind_t, avg_t) = (average_ranks(tables[k]) for k in ("default", "tuned"))
    head = ["method", *(f"{KINDS[k]} default → tuned" for k in kinds), "average default → tuned"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---|" * (len(head) - 1)]
    for m in sorted(methods, key=lambda m: (avg_t[m], avg_d[m])):
        cells = [f"{by_kind_d[k][m]:g} → {by_kind_t[k][m]:g}" for k in kinds] + [f"{avg_d[m]:.1f} → {avg_t[m]:.1f}"]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return lines


def dumbbells(out: Path, kind: str) -> list[tuple[str, float, float, float, float]]:
    """(method, default mean, its std, tuned mean, its std) for every method of a kind with both cells (%; std 0
    with one seed), in the table's order."""
    rows = []
    for m in METHODS:
        cells = [_method(DEFAULTS / kind, m), tuned_cells(out, ARCHIVE, kind, m)]
        if m in NO_GLOBAL_MODEL or not all(cells):
            continue
        stats = [(mean(c.values()), stdev(c.values()) if len(c) > 1 else 0.0) for c in cells]
        rows.append((m, *stats[0], *stats[1]))
    return rows


def plot(out: Path, path: Path) -> None:
    """One panel per kind: each method's default-settings cell (grey) joined to its tuned cell (blue), mean ± std
    over seeds, so a rank change reads as crossing lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(KINDS), figsize=(5 * len(KINDS), 4.2), sharey=True)
    labels = [m for m in METHODS if m not in NO_GLOBAL_MODEL]
    for ax, (kind, title) in zip(axes, KINDS.items(), strict=True):
        for m, d, d_std, t, t_std in dumbbells(out, kind):
            y = labels.index(m)
            ax.plot([d, t], [y, y], color="0.6", zorder=1)
            ax.errorbar(d, y, xerr=d_std, fmt="o", color="0.55", capsize=3, zorder=2)
            ax.errorbar(t, y, xerr=t_std, fmt="o", color="tab:blue", capsize=3, zorder=3)
        ax.set_title(title)
        ax.set_xlabel(f"global test accuracy (%) after {ROUNDS} rounds")
        ax.grid(alpha=0.3)
    axes[0].set_yticks(range(len(labels)), labels)
    axes[0].invert_yaxis()
    handles = [plt.Line2D([], [], marker="o", ls="", color=c) for c in ("0.55", "tab:blue")]
    fig.legend(handles, ["default settings (lr 0.01)", "tuned (16 trials × 15 rounds)"], loc="lower center", ncol=2)
    fig.suptitle("Fashion-MNIST, 10 clients: default settings against tuned, mean ± std over seeds 0-2")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# claims.sh: each seed paper's method and its strongest baseline on the paper's claims-row protocol
CLAIMS = {  # paper: (its method, its strongest baselines untuned: the row compares with the best of them tuned)
    "fedbc": ("fedbc", ("qfedavg", "scaffold")),
    "fedrane": ("fedrane", ("fedavg",)),
    "fedacd": ("fedacd", ("fedrod",)),
    "fedrcl": ("fedrcl", ("fedlc",)),
    "fedufo": ("fedufo", ("fedavg",)),
}
CLAIMS_ARCHIVE = HERE / "results-claims"


def finished(folder: Path) -> dict[int, float]:
    """seed -> final test accuracy (%) of the runs <method>-s<seed> in ``folder`` whose summary says finished."""
    out = {}
    for summary in sorted(folder.parent.glob(f"{folder.name}-s[0-9]*/summary.json")):
        info = json.loads(summary.read_text())
        if info.get("status") == "finished":
            records = read_metrics(summary.parent / "metrics.jsonl", lambda _: None)
            out[int(summary.parent.name.rsplit("-s", 1)[1])] = 100 * records[-1]["test_acc"]
    return out


def claim_runs(out: Path, paper: str, name: str) -> dict[int, float]:
    return {**finished(CLAIMS_ARCHIVE / paper / name), **finished(out / paper / name)}


def picked(out: Path, paper: str, name: str) -> str:
    return f"{name}: {chosen(tune_summary(out, paper, name, CLAIMS_ARCHIVE))[0]}"


def claims_table(out: Path) -> list[str]:
    """Per paper: its method's final test accuracy after tuning against the best tuned baseline's, the difference
    paired by seed (95 % paired bootstrap interval, Wilcoxon p: fedhet.results.stats, as fedhet compare gives them),
    and every baseline's cell."""
    from fedhet.results.stats import paired_difference

    head = ["paper", "method (tuned)", "baselines (tuned)", "method − best baseline [95 % CI], p", "chosen"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---|" * (len(head) - 1)]
    for paper, (method, baselines) in CLAIMS.items():
        mine = claim_runs(out, paper, method)
        theirs = {b: claim_runs(out, paper, b) for b in baselines}
        theirs = {b: runs for b, runs in theirs.items() if runs}
        if not mine or not theirs:
            lines.append(f"| {paper} | {method}: not run yet | {', '.join(baselines)}: not run yet | | |")
            continue
        best = max(theirs, key=lambda b: mean(theirs[b].values()))
        seeds = sorted(set(mine) & set(theirs[best]))
        diff = paired_difference([mine[s] for s in seeds], [theirs[best][s] for s in seeds])
        text = "–" if diff.mean is None else f"{diff.mean:+.2f} [{diff.ci_low:+.2f}, {diff.ci_high:+.2f}] {diff.marker}"
        text += f" against {best}" + ("" if diff.p is None else f", p = {diff.p:.2f}")
        others = "; ".join(f"{b} {spread(runs)}" for b, runs in theirs.items())
        picks = "; ".join(picked(out, paper, name) for name in (method, *theirs))
        lines.append(f"| {paper} | {method} {spread(mine)} | {others} | {text} | {picks} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default="runs/tuning-fmnist", type=Path)
    parser.add_argument("--claims", type=Path, default=Path("runs/tuning-claims"), help="claims.sh's output folder")
    parser.add_argument(
        "--retuned", type=Path, default=Path("runs/tuning-fmnist-lr-wide"), help=f"run.sh's OUT with LR={RETUNED_LR}"
    )
    parser.add_argument("--plot", type=Path, help="also draw each kind's default and tuned cells (a PNG)")
    args = parser.parse_args()
    if args.plot:
        plot(args.out, args.plot)
    for kind, title in KINDS.items():
        print(f"\n### {title}: global test accuracy (%) after {ROUNDS} rounds\n")
        print("\n".join(kind_table(args.out, kind, args.retuned)))
    print("\n¹ FedBN has no global model (each client keeps its BatchNorm layers): left out of the tuned study.")
    print(
        f"² retuned at the same budget with train.lr on {RETUNED_LR} (edge_probe.py found its optimum below the"
        " study's range); outside the ranks, which compare methods tuned over one space."
    )
    print("⇤ / ⇥: chosen at the lower / upper edge of its range (the outer 5 %); the best may lie outside it.")
    print("\n### Ranks by final test accuracy, per kind and averaged over the finished kinds\n")
    print("\n".join(rank_table(args.out)))
    print("\n### The claims, both methods tuned: final test accuracy (%)\n")
    print("\n".join(claims_table(args.claims)))


if __name__ == "__main__":
    main()

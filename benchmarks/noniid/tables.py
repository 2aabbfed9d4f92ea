"""The table and plot of docs/non-iid.md from run.sh's folders.

Usage: python benchmarks/noniid/tables.py [OUT] [--plot PNG]   (OUT default runs/noniid-fmnist)

Reads OUT/<kind>/<method>-s<seed> and, for cells not there, the archived copies in benchmarks/noniid/results (see
benchmarks/reproduce/archive.py). A cell is the final evaluation's global test accuracy, mean ± sample std over the
seeds that reached the last round, then in brackets the worst part of the federation: the worst domain's accuracy
(test_acc/domain/worst) under domains, else the worst client's on its own test data (client_acc_min). FedBN's and
FedRoD's personalised accuracy (each client's own model on its own test data, micro average) is a second table,
since those methods are meant to be used that way. A cell lists its seeds; one whose runs have not all reached the
last round shows only the finished seeds and says how many are unfinished."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from statistics import mean, stdev

from fedhet.config import load_config

KINDS = {
    "iid": "IID",
    "dir0.5": "Dir(0.5)",
    "dir0.1": "Dir(0.1)",
    "two_classes": "2 classes",
    "noise": "noise σ=0.1",
    "rotated": "rotated ×4",
    "quantity": "quantity",
}
# the noise sweep (run.sh's noise<sigma> kinds): how strong NIID-Bench's noise must be to matter on Fashion-MNIST
SWEEP = {"noise": 0.1, "noise0.5": 0.5, "noise1": 1.0, "noise2": 2.0}
SWEEP_METHODS = ["fedavg", "fedprox"]
METHODS = ["fedavg", "fedprox", "scaffold", "fednova", "feddyn", "moon", "fedbn", "fedrod"]
PERSONAL = ["fedbn", "fedrod"]
# FedBN's server never holds BatchNorm statistics (each client keeps its own), so its "global model" is the averaged
# weights with the initial statistics: not a model anyone uses, and its accuracy means nothing
NO_GLOBAL_MODEL = {"fedbn": "n/a¹"}
# a personalised method's cell: each client's own model on its own test data (micro average), no worst part
PERSONAL_CELL = {"key": lambda r: r["personal_acc_micro"], "with_worst": False}
ARCHIVE = Path(__file__).parent / "results"


def records(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line torn by a kill: the records before it stand
            break
    return out


def runs(out: Path, kind: str, method: str) -> dict[int, list[dict]]:
    """seed -> the evaluation records of the cell's run, from OUT or else the archive."""
    found = {}
    for root in (ARCHIVE, out):  # a live folder wins over its archived copy
        for run in sorted((root / kind).glob(f"{method}-s*")):
            recs = records(run)
            if recs:
                found[int(run.name.rsplit("-s", 1)[1])] = recs
    return found


def final_rounds() -> int:
    """The rounds every cell runs (fmnist.toml's run.rounds)."""
    return load_config(Path(__file__).parent / "fmnist.toml").run.rounds


def worst(record: dict) -> float:
    return record.get("test_acc/domain/worst", record.get("client_acc_min"))


def cell(found: dict[int, list[dict]], rounds: int, key=lambda r: r["test_acc"], with_worst=True) -> str:
    done = {seed: recs[-1] for seed, recs in found.items() if recs[-1]["round"] >= rounds}
    if not done:
        return "–" if not found else f"(running: round {max(r[-1]['round'] for r in found.values())})"
    accs = [100 * key(r) for r in done.values()]
    text = f"{mean(accs):.1f} ± {stdev(accs):.1f}" if len(accs) > 1 else f"{accs[0]:.1f}"
    if with_worst:
        text += f" ({mean(100 * worst(r) for r in done.values()):.1f})"
    text += f" <sub>s{','.join(map(str, sorted(done)))}</sub>"
    if len(done) < len(found):
        text += f" +{len(found) - len(done)} unfinished"
    return text


def table(out: Path, rounds: int, methods: list[str], **kw) -> list[str]:
    lines = ["| method | " + " | ".join(KINDS.values()) + " |", "|---|" + "---|" * len(KINDS)]
    for method in methods:
        if method in NO_GLOBAL_MODEL and "key" not in kw:
            lines.append(f"| {method} | " + " | ".join(NO_GLOBAL_MODEL[method] for _ in KINDS) + " |")
            continue
        cells = [cell(runs(out, kind, method), rounds, **kw) for kind in KINDS]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return lines


def sweep_table(out: Path, rounds: int) -> list[str]:
    """One row per noise level sigma (client i of N: std sigma * i / N on its inputs): FedAvg's and FedProx's global
    model on the clean test set and on the clients' own noisy test data (mean over clients, worst client in
    brackets), and FedBN's personalised models on the clients' own data, the like-for-like comparison."""
    head = []
    for m in SWEEP_METHODS:
        head += [f"{m}: clean test", f"{m}: clients' own (worst)"]
    head.append("fedbn personalised: clients' own")
    lines = ["| σ | " + " | ".join(head) + " |", "|---|" + "---|" * len(head)]
    clean = {"with_worst": False}
    own = {"key": lambda r: r["client_acc_mean"]}
    for kind, sigma in SWEEP.items():
        cells = []
        for m in SWEEP_METHODS:
            found = runs(out, kind, m)
            cells += [cell(found, rounds, **clean), cell(found, rounds, **own)]
        cells.append(cell(runs(out, kind, "fedbn"), rounds, **PERSONAL_CELL))
        lines.append(f"| {sigma:g} | " + " | ".join(cells) + " |")
    return lines


def plot(out: Path, path: Path) -> None:
    """One panel per kind: the global test accuracy against rounds, mean over the seeds found, per method (FedBN,
    which has no global model, is left out)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 4, figsize=(16, 7.5), sharey=True)
    colours = plt.get_cmap("tab10")
    for ax, (kind, title) in zip(axes.flat, KINDS.items(), strict=False):
        for i, method in enumerate(METHODS):
            found = runs(out, kind, method)
            if not found or method in NO_GLOBAL_MODEL:
                continue
            by_round: dict[int, list[float]] = {}
            for recs in found.values():
                for r in recs:
                    by_round.setdefault(r["round"], []).append(100 * r["test_acc"])
            xs = sorted(by_round)
            ax.plot(xs, [mean(by_round[x]) for x in xs], marker=".", color=colours(i), label=method)
        ax.set_title(title)
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
    axes.flat[0].set_ylabel("global test accuracy (%)")
    axes.flat[4].set_ylabel("global test accuracy (%)")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    axes.flat[-1].axis("off")
    axes.flat[-1].legend(handles, labels, loc="center", fontsize=12)
    fig.suptitle("Fashion-MNIST, 10 clients, mean over the seeds run (benchmarks/noniid)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default="runs/noniid-fmnist", type=Path)
    parser.add_argument("--plot", type=Path, help="also draw the accuracy curves, one panel per kind")
    args = parser.parse_args()
    rounds = final_rounds()
    print(f"Global test accuracy (%) after {rounds} rounds (worst domain or client in brackets):\n")
    print("\n".join(table(args.out, rounds, METHODS)))
    print("\n¹ FedBN has no global model: each client keeps its BatchNorm layers; see its personalised accuracy.")
    print(f"\nPersonalised accuracy (%) after {rounds} rounds (each client's own model, micro average):\n")
    print("\n".join(table(args.out, rounds, PERSONAL, **PERSONAL_CELL)))
    if any((root / kind).is_dir() for root in (args.out, ARCHIVE) for kind in SWEEP if kind != "noise"):
        print(f"\nNoise sweep: accuracy (%) after {rounds} rounds against sigma (client i of N: std sigma * i / N):\n")
        print("\n".join(sweep_table(args.out, rounds)))
    if args.plot:
        plot(args.out, args.plot)
        print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()

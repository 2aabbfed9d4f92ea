"""The tables and plots of docs/system-heterogeneity.md's studies from run.sh's folders.

Usage: python benchmarks/system/tables.py [OUT] [--plot-dir DIR]   (OUT default runs/system-synthetic)

Reads OUT/<study>/<setting>/<label>/<method>-s<seed> and, for cells not there, the archived copies in
benchmarks/system/results (benchmarks/reproduce/archive.py). A cell is mean ± std over the seeds whose run reached
its last round, with the seeds listed; one with unfinished seeds says so. The asynchronous study compares the
methods at equal simulated time: each method's accuracy at the last evaluation at or before a time."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from statistics import mean, pstdev

ARCHIVE = Path(__file__).parent / "results"
STRAGGLERS = ["0", "0.5", "0.9"]
STUDIES = {"stragglers": "1", "stragglers_shakespeare": "0.001"}  # the study's folder and its FedProx mu


def straggler_labels(mu: str) -> dict[str, str]:
    return {
        "fedavg-drop": "FedAvg (drops stragglers)",
        "fedprox-mu0": "FedProx μ=0",
        f"fedprox-mu{mu}": f"FedProx μ={mu}",
    }


WORK = {"sizes": "sizes' spread", "random": "random share", "deadline": "deadline, log-normal speeds"}


def records(run: Path) -> list[dict]:
    out = []
    path = run / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line torn by a kill: the records before it stand
            break
    return out


def runs(out: Path, folder: str) -> dict[int, tuple[list[dict], int]]:
    """seed -> (evaluation records, the rounds the run was set to) of the cell in ``folder``, live or archived."""
    found = {}
    for root in (ARCHIVE, out):  # a live folder wins over its archived copy
        for run in sorted((root / folder).glob("*-s*")):
            recs = records(run)
            config = run / "config.json"
            if recs and config.exists():
                found[int(run.name.rsplit("-s", 1)[1])] = (recs, json.loads(config.read_text())["run"]["rounds"])
    return found


def finished(found: dict) -> dict[int, list[dict]]:
    return {seed: recs for seed, (recs, rounds) in found.items() if recs[-1]["round"] >= rounds}


def cell(found: dict, value, digits: int = 1) -> str:
    done = finished(found)
    if not done:
        return "–" if not found else f"(running: round {max(r[-1]['round'] for r, _ in found.values())})"
    xs = [value(recs) for recs in done.values()]
    text = f"{mean(xs):.{digits}f} ± {pstdev(xs):.{digits}f}" if len(xs) > 1 else f"{xs[0]:.{digits}f}"
    text += f" <sub>s{','.join(map(str, sorted(done)))}</sub>"
    return text + (f" +{len(found) - len(done)} unfinished" if len(done) < len(found) else "")


def final_acc(recs: list[dict]) -> float:
    return 100 * recs[-1]["test_acc"]


def acc_at(recs: list[dict], t: float) -> float:
    """The accuracy of the last evaluation at or before simulated time ``t`` (0 before the first)."""
    before = [r for r in recs if r["sim/time"] <= t]
    return 100 * before[-1]["test_acc"] if before else 0.0


def stragglers(out: Path, study: str = "stragglers") -> list[str]:
    labels = straggler_labels(STUDIES[study])
    lines = ["| method | " + " | ".join(f"{float(s):.0%} stragglers" for s in STRAGGLERS) + " |"]
    lines.append("|---|" + "---|" * len(STRAGGLERS))
    for label, name in labels.items():
        cells = [cell(runs(out, f"{study}/{s}/{label}"), final_acc) for s in STRAGGLERS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def local_work(out: Path) -> list[str]:
    lines = ["| method | " + " | ".join(WORK.values()) + " |", "|---|" + "---|" * len(WORK)]
    for method in ("fedavg", "fednova"):
        cells = [cell(runs(out, f"local_work/{setting}/{method}"), final_acc) for setting in WORK]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return lines


def asynchronous(out: Path) -> list[str]:
    sync = finished(runs(out, "async/lognormal/fedavg-sync"))
    if not sync:
        return ["(the synchronous runs have not finished)"]
    end = mean(recs[-1]["sim/time"] for recs in sync.values())
    times = [end / 8, end / 4, end / 2, end]
    lines = ["| method | " + " | ".join(f"t = {t:,.0f} s" for t in times) + " |", "|---|" + "---|" * len(times)]
    for label, name in (("fedavg-sync", "FedAvg, synchronous"), ("fedbuff", "FedBuff (K = 5, 10 at once)")):
        found = runs(out, f"async/lognormal/{label}")
        lines.append(f"| {name} | " + " | ".join(cell(found, lambda r, t=t: acc_at(r, t)) for t in times) + " |")
    return lines


def plots(out: Path, folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    fig, grid = plt.subplots(2, 3, figsize=(15, 8))
    for row, (study, title) in zip(
        grid, (("stragglers", "Synthetic(1, 1)"), ("stragglers_shakespeare", "Shakespeare")), strict=True
    ):
        for ax, s in zip(row, STRAGGLERS, strict=True):
            for label, name in straggler_labels(STUDIES[study]).items():
                curve(ax, runs(out, f"{study}/{s}/{label}"), "round", name)
            ax.set_title(f"{title}, {float(s):.0%} stragglers")
            ax.set_xlabel("round")
        row[0].set_ylabel("test accuracy (%)")
        row[0].legend()
    first = save(fig, "FedProx's straggler experiment (mean over the seeds run)", folder / "system-stragglers.png")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for label, name in (("fedavg-sync", "FedAvg, synchronous"), ("fedbuff", "FedBuff")):
        found = runs(out, f"async/lognormal/{label}")
        curve(axes[0], found, "round", name)
        curve(axes[1], found, "sim/time", name)
    axes[0].set_xlabel("round (server steps for FedBuff)")
    axes[1].set_xlabel("simulated time (s)")
    axes[0].set_ylabel("test accuracy (%)")
    axes[1].legend()
    title = "Synthetic(1, 1), log-normal client speeds: FedBuff against synchronous FedAvg"
    return [first, save(fig, title, folder / "system-async.png")]


def save(fig, title: str, path: Path) -> Path:
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def curve(ax, found: dict, x: str, name: str) -> None:
    """The mean over seeds of test accuracy against ``x``, at the evaluations every seed has."""
    if not found:
        return
    series = [recs for recs, _ in found.values()]
    n = min(len(recs) for recs in series)
    xs = [mean(recs[i][x] for recs in series) for i in range(n)]
    ax.plot(xs, [mean(100 * recs[i]["test_acc"] for recs in series) for i in range(n)], label=name)
    ax.grid(alpha=0.3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default="runs/system-synthetic", type=Path)
    parser.add_argument("--plot-dir", type=Path, help="also draw the curves into this folder")
    args = parser.parse_args()
    print("Synthetic(1, 1): test accuracy (%) after the last round, by the share of stragglers:\n")
    print("\n".join(stragglers(args.out)))
    print("\nShakespeare: test accuracy (%) after the last round, by the share of stragglers:\n")
    print("\n".join(stragglers(args.out, "stragglers_shakespeare")))
    print("\nTest accuracy (%) after the last round, FedAvg against FedNova, by how local work varies:\n")
    print("\n".join(local_work(args.out)))
    print("\nTest accuracy (%) at equal simulated time (fractions of the synchronous runs' length):\n")
    print("\n".join(asynchronous(args.out)))
    if args.plot_dir:
        for path in plots(args.out, args.plot_dir):
            print(f"plot: {path}")


if __name__ == "__main__":
    main()

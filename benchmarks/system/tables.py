"""The tables and plots of docs/system-heterogeneity.md's studies from run.sh's folders.

Usage: python benchmarks/system/tables.py [OUT] [--plot-dir DIR]   (OUT default runs/system-synthetic)

Reads OUT/<study>/<setting>/<label>/<method>-s<seed> and, for cells not there, the archived copies in
benchmarks/system/results (benchmarks/reproduce/archive.py). A cell is mean ± sample standard deviation (n − 1, as
``fedhet report``) over the seeds whose run reached its last round, with the seeds listed; one with unfinished seeds
says so. The asynchronous study compares the methods at equal simulated time (each method's accuracy at the last
evaluation at or before a time), by the simulated time to a target accuracy, and by the clients' work per simulated
second."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from statistics import mean, stdev

ARCHIVE = Path(__file__).parent / "results"
STRAGGLERS = ["0", "0.5", "0.9"]
STUDIES = {"stragglers": "1", "stragglers_shakespeare": "0.001"}  # the study's folder and its FedProx mu


def straggler_labels(mu: str) -> dict[str, str]:
    return {
        "fedavg-drop": "FedAvg (drops stragglers)",
        "fedprox-mu0": "FedProx μ=0",
        f"fedprox-mu{mu}": f"FedProx μ={mu}",
    }


ASYNC = (("fedavg-sync", "FedAvg, synchronous"), ("fedbuff", "FedBuff (K = 5, 10 at once)"))
TARGETS = (70, 75, 80)  # test accuracy (%) for the time-to-target table
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


def runs(out: Path, folder: str) -> dict[int, tuple[list[dict], dict]]:
    """seed -> (evaluation records, the run's config) of the cell in ``folder``, live or archived."""
    found = {}
    for root in (ARCHIVE, out):  # a live folder wins over its archived copy
        for run in sorted((root / folder).glob("*-s*")):
            recs = records(run)
            config = run / "config.json"
            if recs and config.exists():
                found[int(run.name.rsplit("-s", 1)[1])] = (recs, json.loads(config.read_text()))
    return found


def finished(found: dict) -> dict[int, list[dict]]:
    return {seed: recs for seed, (recs, config) in found.items() if recs[-1]["round"] >= config["run"]["rounds"]}


def cell(found: dict, value, digits: int = 1) -> str:
    done = finished(found)
    if not done:
        return "–" if not found else f"(running: round {max(r[-1]['round'] for r, _ in found.values())})"
    xs = [value(recs) for recs in done.values()]
    text = f"{mean(xs):,.{digits}f} ± {stdev(xs):,.{digits}f}" if len(xs) > 1 else f"{xs[0]:,.{digits}f}"
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


def clock(out: Path, study: str = "stragglers") -> list[str]:
    """Simulated seconds at the last round: dropped stragglers are not waited for, so FedAvg's rounds are shorter."""
    labels = straggler_labels(STUDIES[study])
    lines = ["| method | " + " | ".join(f"{float(s):.0%} stragglers" for s in STRAGGLERS) + " |"]
    lines.append("|---|" + "---|" * len(STRAGGLERS))
    for label, name in labels.items():
        cells = [cell(runs(out, f"{study}/{s}/{label}"), lambda r: r[-1]["sim/time"], 0) for s in STRAGGLERS]
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
    for label, name in ASYNC:
        found = runs(out, f"async/lognormal/{label}")
        lines.append(f"| {name} | " + " | ".join(cell(found, lambda r, t=t: acc_at(r, t)) for t in times) + " |")
    return lines


def time_to(recs: list[dict], target: float) -> float | None:
    """Simulated seconds at the first evaluation with test accuracy >= ``target`` % (None: never reached)."""
    return next((r["sim/time"] for r in recs if 100 * r["test_acc"] >= target), None)


def time_cell(found: dict, target: float) -> str:
    done = finished(found)
    if not done:
        return "–"
    times = {seed: time_to(recs, target) for seed, recs in done.items()}
    reached = [t for t in times.values() if t is not None]
    text = f"{mean(reached):,.0f}" + (f" ± {stdev(reached):,.0f}" if len(reached) > 1 else "") if reached else ""
    text += f" <sub>s{','.join(str(s) for s in sorted(times) if times[s] is not None)}</sub>" if reached else ""
    missed = [str(s) for s in sorted(times) if times[s] is None]
    return (text + (f"; not reached by s{','.join(missed)}" if missed else "")).lstrip("; ") or "–"


def time_to_target(out: Path) -> list[str]:
    lines = ["| method | " + " | ".join(f"{t} %" for t in TARGETS) + " |", "|---|" + "---|" * len(TARGETS)]
    for label, name in ASYNC:
        found = runs(out, f"async/lognormal/{label}")
        lines.append(f"| {name} | " + " | ".join(time_cell(found, t) for t in TARGETS) + " |")
    return lines


def updates(recs: list[dict], config: dict) -> int:
    """Client updates the run aggregated: FedBuff counts them; a synchronous round without stragglers, deadline or
    dropouts aggregates every sampled client (its records say so: no client dropped)."""
    if "async/updates" in recs[-1]:
        return recs[-1]["async/updates"]
    assert all(r.get("sim/dropped", 0) == 0 for r in recs), "dropped clients: the count below would be wrong"
    return config["run"]["rounds"] * config["train"]["clients_per_round"]


def work(out: Path) -> list[str]:
    """Per seed: updates per 1,000 simulated seconds (exact), local steps per update (the mean over the evaluated
    rounds' clients: the only rounds whose clients metrics.jsonl records) and their product, an estimate."""
    lines = [
        "| method | updates per 1,000 s | local steps per update (sampled) | local steps per s (estimate) |",
        "|---|---|---|---|",
    ]
    for label, name in ASYNC:
        found = runs(out, f"async/lognormal/{label}")
        seeds, total = [], 0
        for recs, config in found.values():
            total += updates(recs, config)
            rate = updates(recs, config) / recs[-1]["sim/time"]
            steps = mean(r["clients/steps/mean"] for r in recs)
            seeds.append((1000 * rate, steps, rate * steps))
        if not seeds:
            continue
        cells = [spread([v[i] for v in seeds], digits) for i, digits in enumerate((1, 0, 1))]
        sampled = sum(r["clients"] for recs, _ in found.values() for r in recs)
        lines.append(f"| {name} | {cells[0]} | {cells[1]} ({sampled:,} of {total:,} updates) | {cells[2]} |")
    return lines


def spread(xs: list[float], digits: int) -> str:
    return f"{mean(xs):,.{digits}f} ± {stdev(xs):,.{digits}f}" if len(xs) > 1 else f"{xs[0]:,.{digits}f}"


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
    for study, name in (("stragglers", "Synthetic(1, 1)"), ("stragglers_shakespeare", "Shakespeare")):
        print(f"\n{name}: simulated seconds at the last round, by the share of stragglers:\n")
        print("\n".join(clock(args.out, study)))
    print("\nTest accuracy (%) after the last round, FedAvg against FedNova, by how local work varies:\n")
    print("\n".join(local_work(args.out)))
    print("\nTest accuracy (%) at equal simulated time (fractions of the synchronous runs' length):\n")
    print("\n".join(asynchronous(args.out)))
    print("\nSimulated seconds to a test accuracy (the first evaluation at or above it):\n")
    print("\n".join(time_to_target(args.out)))
    print("\nThe clients' work per simulated second:\n")
    print("\n".join(work(args.out)))
    if args.plot_dir:
        for path in plots(args.out, args.plot_dir):
            print(f"plot: {path}")


if __name__ == "__main__":
    main()

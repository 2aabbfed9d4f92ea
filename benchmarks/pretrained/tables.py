"""The tables and plot of docs/pretrained.md from run.sh's folders.

Usage: python benchmarks/pretrained/tables.py [OUT] [--plot PNG]   (OUT default runs/pretrained-fmnist)

Reads OUT/<mode>/<kind>/<method>-s<seed> and, for cells not there, the archived copies in
benchmarks/pretrained/results (benchmarks/reproduce/archive.py). A cell is the final evaluation's global test
accuracy, mean ± std (sample std) over the seeds that reached the last round, with those seeds; a cell whose runs have
not all finished shows the finished seeds and says how many are not. The gap columns are IID's accuracy minus the
non-IID kind's, per seed shared by both cells (the same seed's runs differ only in how the data are dealt). The
advantage table is each method's accuracy minus FedAvg's, paired by seed, in the same mode and kind. Bytes per round
are measured on the built model: what one message carries (the trainable parameters and exchanged buffers, as
float32), times 10 clients, both directions."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from statistics import mean, stdev

from fedhet.config import load_config
from fedhet.results.store import read_metrics

MODES = {"scratch": "from scratch", "full": "full fine-tuning", "probe": "linear probe", "lora": "LoRA r=4"}
KINDS = {"iid": "IID", "dir0.1": "Dir(0.1)", "two_classes": "2 classes"}
METHODS = ["fedavg", "fedprox", "scaffold", "fedrod"]
GAPS = ["dir0.1", "two_classes"]
ARCHIVE = Path(__file__).parent / "results"
CONFIG = Path(__file__).parent / "fmnist.toml"


def records(run: Path) -> list[dict]:
    """The run's evaluation records (a line torn by a kill ends them)."""
    path = run / "metrics.jsonl"
    return read_metrics(path, lambda _: None) if path.exists() else []


def runs(out: Path, mode: str, kind: str, method: str) -> dict[int, list[dict]]:
    """seed -> the evaluation records of the cell's run, from OUT or else the archive."""
    found = {}
    for root in (ARCHIVE, out):  # a live folder wins over its archived copy
        for run in sorted((root / mode / kind).glob(f"{method}-s*")):
            recs = records(run)
            if recs:
                found[int(run.name.rsplit("-s", 1)[1])] = recs
    return found


def finals(found: dict[int, list[dict]], rounds: int, key: str = "test_acc") -> dict[int, float]:
    """seed -> the final accuracy (%) of the runs that reached the last round."""
    return {s: 100 * recs[-1][key] for s, recs in found.items() if recs[-1]["round"] >= rounds and key in recs[-1]}


def spread(values: list[float], seeds: list[int], signed: bool = False) -> str:
    if not values:
        return "–"
    sign = "+" if signed else ""
    text = f"{mean(values):{sign}.1f}" + (f" ± {stdev(values):.1f}" if len(values) > 1 else "")
    return text + f" <sub>s{','.join(map(str, seeds))}</sub>"


def cell(found: dict[int, list[dict]], rounds: int, key: str = "test_acc") -> str:
    done = finals(found, rounds, key)
    if not done:
        return "–" if not found else f"(running: round {max(r[-1]['round'] for r in found.values())})"
    text = spread(list(done.values()), sorted(done))
    return text + (f" +{len(found) - len(done)} unfinished" if len(done) < len(found) else "")


def paired(a: dict[int, float], b: dict[int, float], signed: bool = True) -> str:
    """a - b over the seeds both have."""
    seeds = sorted(set(a) & set(b))
    return spread([a[s] - b[s] for s in seeds], seeds, signed)


def accuracy_table(out: Path, rounds: int) -> list[str]:
    head = [*KINDS.values(), *(f"gap IID − {KINDS[k]}" for k in GAPS)]
    lines = ["| mode | method | " + " | ".join(head) + " |", "|---|---|" + "---|" * len(head)]
    for mode, mode_name in MODES.items():
        for method in [*METHODS, "fedrod personal"]:
            name, key = ("fedrod", "personal_acc_micro") if method == "fedrod personal" else (method, "test_acc")
            found = {kind: runs(out, mode, kind, name) for kind in KINDS}
            cells = [cell(found[kind], rounds, key) for kind in KINDS]
            iid = finals(found["iid"], rounds, key)
            if key == "test_acc":
                cells += [paired(iid, finals(found[k], rounds, key), signed=False) for k in GAPS]
            else:  # a client's own test data get easier as its classes get fewer: no gap to read
                cells += ["n/a"] * len(GAPS)
            lines.append(f"| {mode_name} | {method} | " + " | ".join(cells) + " |")
    return lines


def advantage_table(out: Path, rounds: int) -> list[str]:
    """Each method's final accuracy minus FedAvg's (paired by seed), per mode and kind."""
    head = [f"{KINDS[k]}: {m}" for k in KINDS for m in METHODS[1:]]
    lines = ["| mode | " + " | ".join(head) + " |", "|---|" + "---|" * len(head)]
    for mode, mode_name in MODES.items():
        cells = []
        for kind in KINDS:
            base = finals(runs(out, mode, kind, "fedavg"), rounds)
            cells += [paired(finals(runs(out, mode, kind, m), rounds), base) for m in METHODS[1:]]
        lines.append(f"| {mode_name} | " + " | ".join(cells) + " |")
    return lines


def message_bytes(run: Path) -> tuple[int, int]:
    """(trainable parameters, bytes of one model message) of a run's model, built from its config (reading the
    pretrained run's checkpoint; nothing is written)."""
    from fedhet.config import build_config
    from fedhet.engine.simulation import build_training
    from fedhet.engine.system import model_bytes
    from fedhet.engine.training import build_federation

    cfg = build_config(json.loads((run / "config.json").read_text()))
    flat = build_training(cfg, build_federation(cfg)).flat
    return flat.params.numel(), model_bytes(flat.params, flat.buffers)


def size_text(size: int) -> str:
    return f"{size / 2**20:.2f} MiB" if size >= 2**20 else f"{size / 1024:.1f} KiB"


def bytes_table(out: Path) -> list[str]:
    """Per mode: trainable parameters and the bytes a round moves (10 clients, down and up), from one of its runs.
    SCAFFOLD also moves a control variate of the same size each way (twice these); FedRoD's personal head stays on
    the client, so its messages are the model without that head (the same as FedAvg's here)."""
    clients = load_config(CONFIG).partition.num_clients
    lines = ["| mode | trainable parameters | one message | per round (10 clients, both ways) |", "|---|---|---|---|"]
    for mode, mode_name in MODES.items():
        run = next(
            (
                r
                for root in (out, ARCHIVE)
                for r in sorted((root / mode / "iid").glob("fedavg-s*"))
                if (r / "config.json").exists()
            ),
            None,
        )
        if run is None:
            lines.append(f"| {mode_name} | – | – | – |")
            continue
        count, size = message_bytes(run)
        lines.append(f"| {mode_name} | {count:,} | {size_text(size)} | {size_text(2 * clients * size)} |")
    return lines


def plot(out: Path, path: Path, rounds: int) -> None:
    """One panel per kind: FedAvg's global test accuracy against rounds in each mode, mean over the seeds run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(KINDS), figsize=(15, 5), sharey=True)
    colours = plt.get_cmap("tab10")
    for ax, (kind, title) in zip(axes, KINDS.items(), strict=True):
        for i, (mode, mode_name) in enumerate(MODES.items()):
            for method, style in (("fedavg", "-"), ("scaffold", ":")):
                found = runs(out, mode, kind, method)
                by_round: dict[int, list[float]] = {}
                for recs in found.values():
                    for r in recs:
                        by_round.setdefault(r["round"], []).append(100 * r["test_acc"])
                xs = sorted(by_round)
                if xs:
                    label = f"{mode_name}, {method}"
                    ax.plot(xs, [mean(by_round[x]) for x in xs], style, marker=".", color=colours(i), label=label)
        ax.set_title(title)
        ax.set_xlabel("round")
        ax.set_xlim(0, rounds)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("global test accuracy (%)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=9)
    fig.suptitle("vit_tiny fine-tuned federated on Fashion-MNIST classes 5-9, 10 clients (benchmarks/pretrained)")
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default="runs/pretrained-fmnist", type=Path)
    parser.add_argument("--plot", type=Path, help="also draw the accuracy curves, one panel per kind")
    parser.add_argument("--no-bytes", action="store_true", help="skip the bytes table (it builds each mode's model)")
    args = parser.parse_args()
    rounds = load_config(CONFIG).run.rounds
    print(f"Global test accuracy (%) after {rounds} rounds; the non-IID gap: IID minus the kind, paired by seed\n")
    print("\n".join(accuracy_table(args.out, rounds)))
    print("\n`fedrod personal`: FedRoD's personalised accuracy (each client's own head on its own test data).")
    print(f"\nAdvantage over FedAvg (points, paired by seed) after {rounds} rounds:\n")
    print("\n".join(advantage_table(args.out, rounds)))
    if not args.no_bytes:
        print("\nCommunication per round:\n")
        print("\n".join(bytes_table(args.out)))
    if args.plot:
        plot(args.out, args.plot, rounds)
        print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()

"""FedRCL-style table from finished comparison runs: accuracy EMA (test_acc_ema) at chosen rounds, per method and
partition setting, as in the paper's Table 1 (EMA 0.9 at rounds 500 and 1000), plus the raw final accuracy and
the mean raw accuracy over the last five evaluated rounds.

    python benchmarks/reproduce/fedrcl/table.py --rounds 20,40 alpha=0.05:RUNS_DIR alpha=0.3:RUNS_DIR

Each RUNS_DIR holds one `fedhet compare` output (one run folder per method).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fedhet.results.report import load_runs

ORDER = ["fedavg", "fedlc", "fedntd", "feddecorr", "fedrcl"]


def method_name(run) -> str:
    name = run.config["algorithm"]["name"]
    server = run.config.get("server", {}).get("name", "sgd")
    return name if server == "sgd" else f"{name}+{server}"


def at_round(records: list[dict], metric: str, rnd: int) -> float | None:
    values = [r[metric] for r in records if r.get(metric) is not None and r["round"] <= rnd]
    return values[-1] if values and records[-1]["round"] >= rnd else None


def last_mean(records: list[dict], k: int = 5) -> float | None:
    values = [r["test_acc"] for r in records if r.get("test_acc") is not None][-k:]
    return sum(values) / len(values) if values else None


def pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.2f}"


def cells_for(run, rounds: list[int]) -> list[str]:
    if run is None:
        return ["—"] * (len(rounds) + 2)
    emas = [pct(at_round(run.metrics, "test_acc_ema", r)) for r in rounds]
    return emas + [pct(run.final("test_acc")), pct(last_mean(run.metrics))]


def collect(settings: list[tuple[str, Path]], rounds: list[int]) -> tuple[list[str], dict[str, list[str]]]:
    header = ["Method"]
    runs: list[dict] = []
    for label, folder in settings:
        header += [f"{label} EMA@{r}" for r in rounds] + [f"{label} final", f"{label} last-5 mean"]
        runs.append({method_name(run): run for run in load_runs([folder])})
    methods = sorted({m for by_method in runs for m in by_method}, key=lambda m: (ORDER + [m]).index(m))
    rows = {m: [cell for by_method in runs for cell in cells_for(by_method.get(m), rounds)] for m in methods}
    return header, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("settings", nargs="+", help="LABEL:RUNS_DIR, e.g. alpha=0.05:runs/fedrcl-fmnist/a005")
    parser.add_argument("--rounds", default="500,1000", help="rounds at which to read the EMA (comma-separated)")
    args = parser.parse_args()
    rounds = [int(r) for r in args.rounds.split(",")]
    settings = [(s.rsplit(":", 1)[0], Path(s.rsplit(":", 1)[1])) for s in args.settings]
    header, rows = collect(settings, rounds)
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for method, cells in rows.items():
        print(f"| {method} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

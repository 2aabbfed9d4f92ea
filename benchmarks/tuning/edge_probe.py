"""Is a tune's best learning rate below the range it searched? For each method of one kind of run.sh's study, its
chosen values rerun as a tuning trial (tuning seed 100, TUNE_ROUNDS rounds, validation accuracy at the last round)
at learning rates below the range's lower edge, beside what its tune's best trial scored.

Usage: python benchmarks/tuning/edge_probe.py KIND METHODS [--lrs 5e-4,2.5e-4] [--study DIR] [--out DIR]
  KIND: dir0.1 | two_classes | rotated; METHODS: comma-separated (fedprox,moon,...)
  --study: run.sh's OUT (default runs/tuning-fmnist; benchmarks/tuning/results, the archive, where a cell is not there)
  --out: where the probe runs go (default runs/edge-probe/KIND); a finished probe run is read, not rerun.
Prints a Markdown table and writes OUT/probe.json (joined with what earlier calls wrote there)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fedhet.config import build_config
from fedhet.engine.simulation import Simulation
from fedhet.results.store import read_metrics

HERE = Path(__file__).parent
ARCHIVE = HERE / "results"
TUNE_SEED, TUNE_ROUNDS = 100, 15  # run.sh's


def cell_folder(study: Path, kind: str, method: str) -> Path:
    """The kind's folder holding the method's tune and final runs: the study's, else the archive's."""
    for root in (study, ARCHIVE):
        if (root / kind / "tuning" / method / "tune.json").exists() and (root / kind / f"{method}-s0").exists():
            return root / kind
    raise SystemExit(f"no finished tune of {method} under {kind} in {study} or {ARCHIVE}")


def trial_config(cell: Path, method: str) -> dict:
    """The method's tuning trial at its chosen values: its seed-0 final run's config, at the tuning seed and rounds
    (a final run's config is the best trial's but for those and its name)."""
    raw = json.loads((cell / f"{method}-s0" / "config.json").read_text())
    raw["run"].update(seed=TUNE_SEED, rounds=TUNE_ROUNDS)
    return raw


def probe(raw: dict, lr: float, out: Path, name: str) -> float:
    """val_acc at the last round of ``raw`` run at ``lr`` (run once; a finished run folder is read)."""
    raw = json.loads(json.dumps(raw))
    raw["run"].update(out_dir=str(out), name=name, progress=False)
    raw["train"]["lr"] = lr
    sim = Simulation(build_config(raw))
    if not (sim.run_dir / "summary.json").exists():
        sim.run()
    return read_metrics(sim.run_dir / "metrics.jsonl")[-1]["val_acc"]


def merged(path: Path, rows: list[dict]) -> list[dict]:
    """The rows of an earlier call's ``probe.json`` with this call's: a method's probes joined, this call's values
    winning, methods in first-probed order."""
    out = {r["method"]: r for r in (json.loads(path.read_text()) if path.exists() else [])}
    for r in rows:
        out[r["method"]] = {**r, "probes": {**out.get(r["method"], {}).get("probes", {}), **r["probes"]}}
    return list(out.values())


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kind")
    ap.add_argument("methods")
    ap.add_argument("--lrs", default="5e-4,2.5e-4")
    ap.add_argument("--study", default="runs/tuning-fmnist")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    lrs = [float(v) for v in args.lrs.split(",")]
    out = Path(args.out or f"runs/edge-probe/{args.kind}")
    rows = []
    for method in args.methods.split(","):
        cell = cell_folder(Path(args.study), args.kind, method)
        best = json.loads((cell / "tuning" / method / "tune.json").read_text())["best"]
        raw = trial_config(cell, method)
        probes = {f"{lr:g}": probe(raw, lr, out, f"{method}-lr{lr:g}") for lr in lrs}
        rows.append(
            {"method": method, "chosen_lr": best["params"]["train.lr"], "best_val_acc": best["value"], "probes": probes}
        )
        print(json.dumps(rows[-1]), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe.json").write_text(json.dumps(merged(out / "probe.json", rows), indent=1))
    head = " | ".join(f"lr {lr:g}" for lr in lrs)
    print(f"\n| method | chosen lr | its best val_acc | {head} |\n|---|---|---|{'---|' * len(lrs)}")
    for r in rows:
        cells = " | ".join(f"{v:.4f}" for v in r["probes"].values())
        print(f"| {r['method']} | {r['chosen_lr']:.3g} | {r['best_val_acc']:.4f} | {cells} |")
    return {"rows": rows}


if __name__ == "__main__":
    main()

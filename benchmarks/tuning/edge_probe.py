"""Is a tune's best value outside the range it searched? For each method of one kind of run.sh's study (or of one
claims.sh paper), its chosen values rerun as a tuning trial (tuning seed 100, the tune's rounds per trial, validation
accuracy at the last round) with one setting moved past its range's edge, beside what its tune's best trial scored.

Usage: python benchmarks/tuning/edge_probe.py WHERE METHODS [--param KEY] [--values 5e-4,2.5e-4] [--study DIR]
                                              [--out DIR]
  WHERE: dir0.1 | two_classes | rotated (run.sh's kinds), or a folder holding tuning/<method>/ and <method>-s0/
         (a claims.sh paper's, e.g. runs/tuning-claims/fedrcl); METHODS: comma-separated (fedprox,moon,...)
  --param: the setting probed (default train.lr; e.g. algorithm.tau); --values (or --lrs): its values
  --study: run.sh's OUT (default runs/tuning-fmnist; benchmarks/tuning/results, the archive, where a cell is not there)
  --out: where the probe runs go (default runs/edge-probe/WHERE's name); a finished probe run is read, not rerun.
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


def cell_folder(study: Path, where: str, method: str) -> Path:
    """The folder holding the method's tune and its seed-0 final run: WHERE itself (a claims.sh paper's folder), else
    the study's kind folder, else the archive's."""
    for folder in (Path(where), study / where, ARCHIVE / where):
        if (folder / "tuning" / method / "tune.json").exists() and (folder / f"{method}-s0").exists():
            return folder
    raise SystemExit(f"no finished tune of {method} in {where} or under {where} in {study} or {ARCHIVE}")


def trial_config(cell: Path, method: str, rounds: int) -> dict:
    """The method's tuning trial at its chosen values: its seed-0 final run's config, at the tuning seed and rounds
    (a final run's config is the best trial's but for those and its name)."""
    raw = json.loads((cell / f"{method}-s0" / "config.json").read_text())
    raw["run"].update(seed=TUNE_SEED, rounds=rounds)
    return raw


def probe(raw: dict, param: str, value: float, out: Path, name: str) -> float:
    """val_acc at the last round of ``raw`` run with ``param`` (``section.key``) at ``value`` (run once; a finished
    run folder is read)."""
    raw = json.loads(json.dumps(raw))
    raw["run"].update(out_dir=str(out), name=name, progress=False)
    section, key = param.split(".", 1)
    if key not in raw.get(section, {}):
        raise SystemExit(f"--param {param}: the run's config has no such setting")
    raw[section][key] = value
    sim = Simulation(build_config(raw))
    if not (sim.run_dir / "summary.json").exists():
        sim.run()
    return read_metrics(sim.run_dir / "metrics.jsonl")[-1]["val_acc"]


def merged(path: Path, rows: list[dict]) -> list[dict]:
    """The rows of an earlier call's ``probe.json`` with this call's: a method's probes joined, this call's values
    winning, methods in first-probed order."""
    earlier = [normalised(r) for r in (json.loads(path.read_text()) if path.exists() else [])]
    out = {r["method"]: r for r in earlier}
    for r in rows:
        out[r["method"]] = {**r, "probes": {**out.get(r["method"], {}).get("probes", {}), **r["probes"]}}
    return list(out.values())


def normalised(row: dict) -> dict:
    """A probe.json row as this version writes it (rows of the first version probed train.lr alone: chosen_lr)."""
    if "param" in row:
        return row
    rest = {k: v for k, v in row.items() if k != "chosen_lr"}
    return {"method": row["method"], "param": "train.lr", "chosen": row["chosen_lr"], **rest}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("where")
    ap.add_argument("methods")
    ap.add_argument("--param", default="train.lr")
    ap.add_argument("--values", "--lrs", default="5e-4,2.5e-4")
    ap.add_argument("--study", default="runs/tuning-fmnist")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    values = [float(v) for v in args.values.split(",")]
    short = args.param.rsplit(".", 1)[-1]
    out = Path(args.out or f"runs/edge-probe/{Path(args.where).name}")
    rows = []
    for method in args.methods.split(","):
        cell = cell_folder(Path(args.study), args.where, method)
        tune = json.loads((cell / "tuning" / method / "tune.json").read_text())
        raw = trial_config(cell, method, tune.get("budget", {}).get("rounds_per_trial", TUNE_ROUNDS))
        probes = {f"{v:g}": probe(raw, args.param, v, out, f"{method}-{short}{v:g}") for v in values}
        best = tune["best"]
        row = {"method": method, "param": args.param, "chosen": best["params"].get(args.param)}
        rows.append({**row, "best_val_acc": best["value"], "probes": probes})
        print(json.dumps(rows[-1]), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe.json").write_text(json.dumps(merged(out / "probe.json", rows), indent=1))
    head = " | ".join(f"{short} {v:g}" for v in values)
    print(f"\n| method | chosen {short} | its best val_acc | {head} |\n|---|---|---|{'---|' * len(values)}")
    for r in rows:
        cells = " | ".join(f"{v:.4f}" for v in r["probes"].values())
        chosen = "–" if r["chosen"] is None else f"{r['chosen']:.3g}"
        print(f"| {r['method']} | {chosen} | {r['best_val_acc']:.4f} | {cells} |")
    return {"rows": rows}


if __name__ == "__main__":
    main()

"""Comparisons: the same federated setting trained with several algorithms (and seeds), then one table and plot.

A comparison config is a run config plus a ``[compare]`` table::

    [compare]
    variants = ["fedavg", "fedprox", "fedavg+fedadam"]   # ALGORITHM[+SERVER_OPTIMISER]
    seeds = [0]
    [compare.params.fedprox]                             # hyper-parameters of one algorithm
    mu = 0.01
    [compare.server_params.fedadam]                      # ... or of one server optimiser
    lr = 0.03

The data are loaded and partitioned once per seed and shared by every variant.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from fedhet.config import apply_override, build_config, load_raw
from fedhet.errors import ConfigError, RunFailed


def parse_variant(text: str) -> tuple[str, str | None]:
    algo, _, server = text.strip().partition("+")
    if not algo:
        raise ConfigError(f"empty variant in {text!r}; write ALGORITHM or ALGORITHM+SERVER_OPTIMISER")
    return algo, server or None


def variant_raw(base: dict[str, Any], variant: str, seed: int, spec: dict[str, Any]) -> dict[str, Any]:
    algo, server = parse_variant(variant)
    raw = copy.deepcopy(base)
    raw.setdefault("algorithm", {})
    raw["algorithm"] = {"name": algo, **spec.get("params", {}).get(algo, {})}
    if server is not None:
        raw["server"] = {"name": server, **spec.get("server_params", {}).get(server, {})}
    raw.setdefault("run", {})
    raw["run"]["seed"] = seed
    raw["run"]["name"] = f"{variant.replace('+', '_')}-s{seed}"
    return raw


def run_comparison(
    config: Path | None,
    overrides: list[str],
    variants: str | None,
    seeds: str | None,
    *,
    resume: bool,
    overwrite: bool,
    console: Console,
    err_console: Console,
) -> list[Path]:
    from fedhet.engine.simulation import Simulation, build_federation, resolve_config
    from fedhet.results.plots import plot_curves
    from fedhet.results.report import group_runs, load_runs, print_table, summary_table, to_markdown

    base = load_raw(config)
    spec = base.pop("compare", {})
    for item in overrides:
        apply_override(base, item)
    names = [v for v in (variants.split(",") if variants else spec.get("variants", ["fedavg", "fedprox"])) if v]
    seed_list = [int(s) for s in seeds.split(",")] if seeds else list(spec.get("seeds", [0]))
    configs = [(v, s, build_config(variant_raw(base, v, s, spec))) for s in seed_list for v in names]
    for _, _, cfg in configs:  # validate every config before training any
        resolve_config(cfg)
    out_dir = Path(configs[0][2].run.out_dir)
    run_dirs = []
    feds: dict[int, Any] = {}
    failed = []
    for variant, seed, cfg in configs:
        if seed not in feds:
            feds[seed] = build_federation(cfg)
        sim = Simulation(cfg, fed=feds[seed], console=err_console)
        try:
            sim.run(resume=resume, overwrite=overwrite)
        except RunFailed as err:  # one diverging cell must not cost the others
            err_console.print(f"[red]failed:[/] {escape(f'{variant} seed {seed}: {err}')}", soft_wrap=True)
            failed.append(f"{variant} seed {seed}")
            if not (sim.run_dir / "metrics.jsonl").exists():
                continue  # failed before its first evaluation: nothing to tabulate
        run_dirs.append(sim.run_dir)
    if not run_dirs:
        raise RunFailed(f"every run failed ({', '.join(failed)}); see their summary.json")
    groups = group_runs(load_runs(run_dirs))
    rows = summary_table(groups, metric="test_acc")
    print_table(rows, console)
    (out_dir / "comparison.md").write_text(to_markdown(rows) + "\n")
    plot = plot_curves(groups, out_dir / "comparison.png", metric="test_acc")
    console.print(f"table: {out_dir / 'comparison.md'}\nplot:  {plot}")
    if failed:
        raise RunFailed(f"{len(failed)} of {len(configs)} runs failed ({', '.join(failed)}); see their summary.json")
    return run_dirs

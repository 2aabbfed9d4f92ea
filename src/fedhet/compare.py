"""Comparisons: the same federated setting trained with several algorithms (and seeds), then one table and plot.

A comparison config is a run config plus a ``[compare]`` table::

    [compare]
    variants = ["fedavg", "fedprox", "fedavg+fedadam"]   # ALGORITHM[+SERVER_OPTIMISER]
    seeds = [0]                                          # default: run.seed
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

from pydantic import Field, ValidationError
from rich.console import Console
from rich.markup import escape

from fedhet.config import apply_override, build_config, load_raw
from fedhet.errors import ConfigError, RunFailed
from fedhet.params import Params, Seed, problem, shown


class CompareSpec(Params):
    """The ``[compare]`` table."""

    variants: list[str] = Field(default_factory=lambda: ["fedavg", "fedprox"], min_length=1)
    seeds: list[Seed] | None = Field(None, min_length=1)  # None: run.seed
    params: dict[str, dict[str, Any]] = {}  # algorithm name -> its hyper-parameters
    server_params: dict[str, dict[str, Any]] = {}  # server optimiser name -> its hyper-parameters


def parse_spec(table: Any) -> CompareSpec:
    if not isinstance(table, dict):
        raise ConfigError(f"compare: must be a table of keys (got {shown(table)})")
    try:
        return CompareSpec.model_validate(table)
    except ValidationError as err:
        problems, unknown = [], False
        for e in err.errors():
            if e["type"] == "extra_forbidden":
                problems.append(f"unknown key {shown('.'.join(['compare', *map(str, e['loc'])]))}")
                unknown = True
            else:
                problems.append(problem({**e, "loc": ("compare", *e["loc"])}))
        if unknown:
            problems.append(f"valid keys in [compare]: {', '.join(CompareSpec.model_fields)}")
        raise ConfigError("; ".join(problems)) from None


def parse_seeds(text: str) -> list[int]:
    """``--seeds 0,1,2``."""
    parts = [part.strip() for part in text.split(",")]
    if not all(part.isascii() and part.isdigit() for part in parts):  # also refuses "-1", "" and ","
        raise ConfigError(f"--seeds must be a comma list of non-negative integers, e.g. 0,1,2 (got {shown(text)})")
    return [int(part) for part in parts]


def parse_variants(text: str) -> list[str]:
    """``--variants fedavg,fedprox,fedavg+fedadam``."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise ConfigError(f"--variants names no variant (got {shown(text)})")
    return names


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
    run = raw.setdefault("run", {})
    if isinstance(run, dict):  # anything else is refused by build_config
        run["seed"] = seed
        run["name"] = f"{variant.replace('+', '_')}-s{seed}"
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
    spec = parse_spec(base.pop("compare", {}))
    for item in overrides:
        apply_override(base, item)
    names = parse_variants(variants) if variants is not None else spec.variants
    if seeds is not None:
        seed_list = parse_seeds(seeds)
    elif spec.seeds is not None:
        seed_list = spec.seeds
    else:  # the base setting's own seed; validated with the rest of its config
        run = base.get("run")
        seed_list = [run.get("seed", 0) if isinstance(run, dict) else 0]
    table = spec.model_dump()
    configs = [(v, s, build_config(variant_raw(base, v, s, table))) for s in seed_list for v in names]
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
    console.print(escape(f"table: {out_dir / 'comparison.md'}\nplot:  {plot}"))
    if failed:
        raise RunFailed(f"{len(failed)} of {len(configs)} runs failed ({', '.join(failed)}); see their summary.json")
    return run_dirs

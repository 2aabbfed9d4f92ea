"""Comparisons: the same federated setting trained with several algorithms, seeds and settings; one table and plot.

A comparison config is a run config plus a ``[compare]`` table::

    [compare]
    variants = ["fedavg", "fedprox", "fedavg+fedadam"]   # ALGORITHM[+SERVER_OPTIMISER]
    seeds = [0]                                          # default: run.seed
    baseline = "fedavg"                                  # rows' paired differences from it (default; "none")
    [compare.params.fedprox]                             # hyper-parameters of one algorithm
    mu = 0.01
    [compare.server_params.fedadam]                      # ... or of one server optimiser
    lr = 0.03
    [compare.grid]                                       # a sweep: every combination of these values
    partition.alpha = [0.1, 0.5]

An ``-s algorithm.KEY=VALUE`` (or a key of the base ``[algorithm]`` section) goes to every variant whose algorithm
has that hyper-parameter, the command line over ``[compare.params]`` over the base section; one that no variant
takes is refused rather than dropped. ``server.KEY`` likewise for variants with their own server optimiser.

The cells are grid point x seed x variant. Each is an ordinary run in ``OUT/<variant>-s<seed>``, or
``OUT/<point>/<variant>-s<seed>`` with a grid, where the point's folder names the swept values (``alpha0.1``,
``alpha0.1-mu0.01``). ``fedhet.cells.run_cells`` runs them (in parallel with ``jobs``, skipping finished cells and
resuming killed ones); then one table and plot of every cell go to ``OUT``, and one per grid point to its folder.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, ValidationError
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from fedhet.cells import Cell, cell_state, check_conflicts, run_cells
from fedhet.config import apply_override, build_config, load_raw, parse_value, set_dotted
from fedhet.engine.display import print_warning
from fedhet.errors import ConfigError, RunFailed
from fedhet.params import Params, Seed, problem, shown

if TYPE_CHECKING:
    from fedhet.tuning.compare import TuneOptions

PANEL_ABOVE = 12  # curves in one comparison.png axes; more are split into panels by method family


class CompareSpec(Params):
    """The ``[compare]`` table."""

    variants: list[str] = Field(default_factory=lambda: ["fedavg", "fedprox"], min_length=1)
    seeds: list[Seed] | None = Field(None, min_length=1)  # None: run.seed
    params: dict[str, dict[str, Any]] = {}  # algorithm name -> its hyper-parameters
    server_params: dict[str, dict[str, Any]] = {}  # server optimiser name -> its hyper-parameters
    grid: dict[str, Any] = {}  # setting -> values to sweep (``partition.alpha = [0.1, 0.5]``)
    # "per-seed": each seed draws its own partition; "fixed": every seed trains on one (--partitions); None: as the
    # config says (fixed when it sets partition.seed)
    partitions: Literal["per-seed", "fixed"] | None = None
    # the method every row is compared with (--baseline): a variant, "auto" (fedavg where it is one) or "none"
    baseline: str | None = None


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


# Settings a grid may not sweep, and what sets them instead.
NOT_IN_GRID = {
    "run.seed": "--seeds (compare.seeds)",
    "run.name": "the comparison (cells are named VARIANT-sSEED)",
    "run.out_dir": "--out (each grid point gets its own folder)",
    "algorithm.name": "--variants (compare.variants)",
    "server.name": "--variants ALGORITHM+SERVER_OPTIMISER",
}


PARTITION_MODES = ("per-seed", "fixed")


def apply_partition_mode(base: dict[str, Any], mode: str | None, seeds: list[int]) -> str:
    """Set ``partition.seed`` in ``base`` for the mode and return what the cells' partitions will be, in words.

    "fixed": the config's partition.seed, else the first seed, for every cell. "per-seed": partition.seed is removed,
    so each cell's partition follows its run.seed. None: the config decides."""
    if mode is not None and mode not in PARTITION_MODES:
        raise ConfigError(f"--partitions must be one of {', '.join(PARTITION_MODES)} (got {shown(mode)})")
    part = base.get("partition", {})
    if not isinstance(part, dict):  # build_config refuses it with its own message
        return ""
    if mode == "per-seed":
        part.pop("seed", None)
    elif mode == "fixed" and part.get("seed") is None:
        part = base.setdefault("partition", part)
        part["seed"] = seeds[0]
    if part.get("seed") is None:
        return "one per seed (partition.seed follows run.seed)"
    return f"fixed for every seed (partition.seed = {part['seed']})"


def parse_variant(text: str) -> tuple[str, str | None]:
    algo, _, server = text.strip().partition("+")
    if not algo:
        raise ConfigError(f"empty variant in {text!r}; write ALGORITHM or ALGORITHM+SERVER_OPTIMISER")
    return algo, server or None


# The sections a variant picks the component of; their other keys are hyper-parameters shared by the variants.
VARIANT_SECTIONS = ("algorithm", "server")


def fixed_fields(section: str) -> set[str]:
    """A variant section's own fields (``name``, ``server.aggregation``, ...), as opposed to its component's."""
    from fedhet.config import AlgorithmSection, ServerSection

    return set((AlgorithmSection if section == "algorithm" else ServerSection).model_fields)


def split_overrides(overrides: list[str]) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """``-s`` items for the base setting, and those that set an algorithm's or server optimiser's hyper-parameter:
    those apply last, to every variant whose component takes them (``-s algorithm.mu=0.1`` sets FedProx's mu in a
    comparison of FedAvg and FedProx). A section's fixed fields (``server.aggregation``) stay with the base."""
    fixed = {section: fixed_fields(section) for section in VARIANT_SECTIONS}
    base: list[str] = []
    shared: dict[str, dict[str, Any]] = {section: {} for section in VARIANT_SECTIONS}
    for item in overrides:
        key, sep, value = item.partition("=")
        section, _, field = key.strip().partition(".")
        if key.strip() == "algorithm.name":
            raise ConfigError(
                "-s algorithm.name: a comparison picks the algorithm per variant; name it with --variants (or -a)"
            )
        if sep and section in VARIANT_SECTIONS and field and "." not in field and field not in fixed[section]:
            shared[section][field.strip()] = parse_value(value)
        else:
            base.append(item)
    return base, shared


def takes(section: str, name: str, key: str) -> bool:
    """Whether the algorithm (or server optimiser) ``name`` has the hyper-parameter ``key``."""
    from fedhet.algorithms import ALGORITHMS
    from fedhet.algorithms.server_opt import SERVER_OPTIMIZERS

    registry = ALGORITHMS if section == "algorithm" else SERVER_OPTIMIZERS
    try:
        entry = registry.get(name)
    except ConfigError:
        return False  # build_config names the unknown component
    return entry.params is not None and key in entry.params.model_fields


def variant_section(
    base: dict[str, Any], section: str, name: str, own: dict[str, Any], shared: dict[str, Any]
) -> tuple[dict[str, Any], set[str]]:
    """One variant's algorithm or server section: the component's name, the base section's fixed fields, the base
    section's hyper-parameters the component takes, then its own ``[compare.params]`` entry, then the ``-s`` ones it
    takes. Returns the section and the shared keys it took."""
    fixed = fixed_fields(section) - {"name"}
    raw = base.get(section)
    raw = raw if isinstance(raw, dict) else {}  # anything else is refused by build_config
    from_base = {k: v for k, v in raw.items() if k not in fixed and k != "name" and takes(section, name, k)}
    from_cli = {k: v for k, v in shared.items() if takes(section, name, k)}
    out = {"name": name, **{k: v for k, v in raw.items() if k in fixed}, **from_base, **own, **from_cli}
    return out, set(from_base) | set(from_cli)


def variant_raw(
    base: dict[str, Any],
    variant: str,
    seed: int,
    spec: dict[str, Any],
    shared: dict[str, dict[str, Any]] | None = None,
) -> tuple[dict[str, Any], dict[str, set[str]]]:
    """A cell's raw config and the shared hyper-parameters (section -> keys) its components took."""
    algo, server = parse_variant(variant)
    shared = shared or {section: {} for section in VARIANT_SECTIONS}
    raw = copy.deepcopy(base)
    took: dict[str, set[str]] = {}
    raw["algorithm"], took["algorithm"] = variant_section(
        base, "algorithm", algo, spec.get("params", {}).get(algo, {}), shared["algorithm"]
    )
    if server is not None:
        own = spec.get("server_params", {}).get(server, {})
        raw["server"], took["server"] = variant_section(base, "server", server, own, shared["server"])
    else:  # the base setting's server optimiser, with every -s of its section, as `fedhet run` would take them
        for key, value in shared["server"].items():
            set_dotted(raw, f"server.{key}", value)
        took["server"] = set(shared["server"])
    run = raw.setdefault("run", {})
    if isinstance(run, dict):  # anything else is refused by build_config
        run["seed"] = seed
        run["name"] = f"{variant.replace('+', '_')}-s{seed}"
    return raw, took


def check_shared_taken(
    base: dict[str, Any], shared: dict[str, dict[str, Any]], took: dict[str, set[str]], names: list[str]
) -> None:
    """A hyper-parameter that no variant's component takes would be silently dropped: refuse it."""
    algorithm = base.get("algorithm")
    in_base = {k for k in algorithm if k != "name"} if isinstance(algorithm, dict) else set()
    given = {"algorithm": set(shared["algorithm"]) | in_base, "server": set(shared["server"])}
    for section in VARIANT_SECTIONS:
        unused = sorted(given[section] - took.get(section, set()))
        if unused:
            keys = ", ".join(f"{section}.{k}" for k in unused)
            raise ConfigError(
                f"{keys}: no variant of this comparison takes it ({', '.join(names)}); set one component's "
                f"parameters in [compare.params.<algorithm>] or [compare.server_params.<optimiser>]"
            )


# ---------------------------------------------------------------------------------------------- grids


def split_values(text: str) -> list[str]:
    """``0.1,0.5`` -> ["0.1", "0.5"]; commas inside brackets or quotes stay: ``[32],[64,64]`` -> two lists."""
    parts, current, depth, quote = [], [], 0, ""
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[({":
            depth += 1
        elif ch in "])}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append("".join(current).strip())
            current = []
            continue
        current.append(ch)
    parts.append("".join(current).strip())
    return parts


def parse_grid_option(items: list[str]) -> dict[str, list[Any]]:
    """``--grid section.key=v1,v2`` (repeatable) -> {"section.key": [v1, v2]}; values parse as ``-s`` values do."""
    grid: dict[str, list[Any]] = {}
    for item in items:
        key, sep, text = item.partition("=")
        values = split_values(text)
        if not sep or not key.strip() or "" in values:
            raise ConfigError(
                f"--grid {item!r} must look like section.key=v1,v2,... (a list value in brackets: "
                "model.hidden=[32],[64,64])"
            )
        grid[key.strip()] = [parse_value(v) for v in values]
    return grid


def grid_from_table(table: dict[str, Any], prefix: str = "") -> dict[str, list[Any]]:
    """``[compare.grid]`` with ``partition.alpha = [0.1, 0.5]`` (TOML makes dotted keys nested tables)."""
    grid: dict[str, list[Any]] = {}
    for key, value in table.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            grid.update(grid_from_table(value, name + "."))
        elif isinstance(value, list) and value:
            grid[name] = value
        else:
            raise ConfigError(f"[compare.grid] {name}: give a list of values, e.g. {name} = [0.1, 0.5]")
    return grid


def slug(value: Any) -> str:
    """A value as it appears in a folder name: 0.1 -> "0.1", [32, 64] -> "32-64", "a/b" -> "a_b"."""
    from fedhet.results.report import format_value

    text = format_value(value)
    for old, new in (("[", ""), ("]", ""), (",", "-"), (" ", ""), ("/", "_"), ("\\", "_")):
        text = text.replace(old, new)
    return text


def grid_points(grid: dict[str, list[Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(folder name, {key: value}) for every combination, in order: ``alpha0.1-mu0.01``; a name's value alone."""
    from fedhet.results.report import short_names

    if not grid:
        return [("", {})]
    for key in grid:
        if key in NOT_IN_GRID:
            raise ConfigError(f"grid key {key!r} cannot be swept: use {NOT_IN_GRID[key]}")
        if "." not in key:
            raise ConfigError(f"grid key {key!r} must name a section, e.g. partition.alpha")
    short = short_names(list(grid))
    points = []
    for combo in itertools.product(*grid.values()):
        values = dict(zip(grid, combo, strict=True))
        name = "-".join(slug(v) if k.endswith(".name") else f"{short[k]}{slug(v)}" for k, v in values.items())
        points.append((name, values))
    names = [n for n, _ in points]
    if len(set(names)) < len(names) or any(n in ("", ".", "..") for n in names):
        raise ConfigError(f"the grid {grid} gives repeated or empty folder names ({', '.join(names)})")
    return points


# ---------------------------------------------------------------------------------------------- the plan


@dataclass
class Comparison:
    cells: list[Cell]
    labels: dict[str, str]  # cell name -> "fedprox seed 0" (+ its grid point), as failures are listed
    points: dict[str, list[str]]  # grid point folder -> its cells ({"": all} without a grid)
    out_dir: Path
    progress: bool  # run.progress of the base setting: show the live display
    partitions: str = ""  # what the cells' partitions are, in words (apply_partition_mode)
    baseline: str = "auto"  # the method the tables compare every row with (report.summary_table)
    variants: dict[str, tuple[str, str]] = field(default_factory=dict)  # cell name -> (grid point, variant)


def plan_comparison(
    config: Path | dict[str, Any] | None,
    overrides: list[str],
    variants: str | None = None,
    seeds: str | None = None,
    grid: list[str] | None = None,
    partitions: str | None = None,
    writable: bool = True,
    baseline: str | None = None,
) -> Comparison:
    """Every cell's validated config (grid point x seed x variant); raises ConfigError naming a bad cell. ``config``
    is a TOML file or its contents (``fedhet.api.config_dict``). The paths they name are checked as ``fedhet run``
    checks them (``writable``: the output folders can be made and written; False for --dry-run)."""
    from fedhet.engine.simulation import resolve_config
    from fedhet.naming import check_config_paths

    base = copy.deepcopy(config) if isinstance(config, dict) else load_raw(config)
    spec = parse_spec(base.pop("compare", {}))
    base_overrides, shared = split_overrides(overrides)
    for item in base_overrides:
        apply_override(base, item)
    names = parse_variants(variants) if variants is not None else spec.variants
    if seeds is not None:
        seed_list = parse_seeds(seeds)
    elif spec.seeds is not None:
        seed_list = spec.seeds
    else:  # the base setting's own seed; validated with the rest of its config
        run = base.get("run")
        seed_list = [run.get("seed", 0) if isinstance(run, dict) else 0]
    partitions_text = apply_partition_mode(base, partitions or spec.partitions, seed_list)
    table = spec.model_dump()
    sweep = grid_from_table(spec.grid)
    sweep.update(parse_grid_option(list(grid or [])))
    base_cfg = build_config(base)
    check_config_paths(base_cfg, writable=writable)  # -o a file, a FIFO --data-dir: one line before any cell
    out_dir = Path(base_cfg.run.out_dir)
    cells, labels, points, variant_of = [], {}, {}, {}
    took: dict[str, set[str]] = {section: set() for section in VARIANT_SECTIONS}
    for point, values in grid_points(sweep):
        points[point] = []
        for seed in seed_list:
            for variant in names:
                raw, taken = variant_raw(base, variant, seed, table, shared)
                for section, keys in taken.items():
                    took[section] |= keys
                for key, value in values.items():
                    set_dotted(raw, key, value)
                if point:
                    raw["run"]["out_dir"] = str(out_dir / point)
                name = f"{point}/{raw['run']['name']}" if point else raw["run"]["name"]
                try:
                    cfg = build_config(raw)
                    resolve_config(cfg)  # every cell is checked before any trains
                    check_config_paths(cfg, writable=writable)  # e.g. its run folder a dangling link
                except ConfigError as err:
                    raise ConfigError(f"{name}: {err}") from None
                cells.append(Cell(name, cfg))
                labels[name] = f"{variant} seed {seed}" + (f" {point}" if point else "")
                variant_of[name] = (point, variant)
                points[point].append(name)
    check_shared_taken(base, shared, took, names)
    chosen = check_baseline(baseline or spec.baseline, names)
    return Comparison(cells, labels, points, out_dir, base_cfg.run.progress, partitions_text, chosen, variant_of)


def check_baseline(baseline: str | None, variants: list[str]) -> str:
    """--baseline (compare.baseline) before any cell trains: one of the variants, "auto" or "none"."""
    from fedhet.results.report import AUTO, NO_BASELINE

    if baseline is None:
        return AUTO
    if baseline not in (*variants, AUTO, NO_BASELINE):
        raise ConfigError(
            f"--baseline {baseline!r} is not a variant of this comparison; choose one of: "
            f"{', '.join([*variants, AUTO, NO_BASELINE])}"
        )
    return baseline


def print_plan(plan: Comparison, overwrite: bool, console: Console, err_console: Console) -> None:
    """--dry-run: each cell, its folder and what running would do (warnings on ``err_console``); then the error a
    conflict would raise."""
    states = {c.name: cell_state(c, partial(print_warning, err_console)) for c in plan.cells}
    table = Table(title=f"{len(plan.cells)} cells in {plan.out_dir}", title_justify="left")
    for column in ("cell", "run folder", "rounds", "action"):
        table.add_column(column, overflow="fold")
    for cell in plan.cells:
        state = states[cell.name]
        action = "replace (--overwrite)" if overwrite and state.action != "start" else state.action
        detail = f": {state.detail}" if state.detail and not overwrite else ""
        table.add_row(
            escape(cell.name), escape(str(cell.run_dir)), str(cell.config.run.rounds), escape(action + detail)
        )
    console.print(table)
    console.print(escape(f"partitions: {plan.partitions}"))
    if not overwrite:
        check_conflicts(plan.cells, states)


def run_comparison(
    config: Path | dict[str, Any] | None,
    overrides: list[str],
    variants: str | None,
    seeds: str | None,
    *,
    grid: list[str] | None = None,
    partitions: str | None = None,
    baseline: str | None = None,
    jobs: int = 1,
    threads: int | None = None,
    overwrite: bool = False,
    dry_run: bool = False,
    tune: TuneOptions | None = None,
    console: Console,
    err_console: Console,
) -> list[Path]:
    """Run (or continue) every cell, then write the tables and plots; returns the run folders tabulated. With
    ``tune``, every variant is tuned first (fedhet/tuning/compare.py) and its cells run with the values it chose.

    Raises RunFailed, after tabulating the others, when some cells failed."""
    plan = plan_comparison(
        config, overrides, variants, seeds, grid, partitions, writable=not dry_run, baseline=baseline
    )
    if dry_run:
        if tune is not None:
            from fedhet.tuning.compare import plan_tunes, tuning_title

            plan_tunes(plan, tune)  # every check the tunes make, nothing run
            console.print(escape(f"first: {tuning_title(tune)}; the cells below then run with the chosen values"))
        print_plan(plan, overwrite, console, err_console)
        return []
    tuned = None
    if tune is not None:
        from fedhet.tuning.compare import tune_comparison

        tuned = tune_comparison(plan, tune, jobs=jobs, threads=threads, console=err_console)
    results = run_cells(
        plan.cells, jobs=jobs, threads=threads, overwrite=overwrite, console=err_console, progress=plan.progress
    )
    failed = [plan.labels[r.name] for r in results if r.status == "failed"]
    # a cell that failed before its first evaluation has nothing to tabulate
    run_dirs = {r.name: r.run_dir for r in results if r.status != "failed" or r.has_metrics}
    if not run_dirs:
        raise RunFailed(f"every run failed ({', '.join(failed)}); see their summary.json")
    if tuned is not None:  # before the table: it reads which values a tuner chose from provenance.json
        from fedhet.tuning.compare import record_provenance

        record_provenance(plan, tuned, list(run_dirs.values()))
    tabulate(list(run_dirs.values()), plan.out_dir, console, baseline=plan.baseline)
    if tuned is not None:
        from fedhet.tuning.compare import print_tuning

        print_tuning(tuned, tune, plan.out_dir, console)
    if len(plan.points) > 1:  # and each grid point on its own, beside its runs
        for point, names in plan.points.items():
            dirs = [run_dirs[n] for n in names if n in run_dirs]
            if dirs:
                tabulate(dirs, plan.out_dir / point, console, show=False, baseline=plan.baseline)
    if failed:
        raise RunFailed(f"{len(failed)} of {len(plan.cells)} runs failed ({', '.join(failed)}); see their summary.json")
    return list(run_dirs.values())


def tabulate(run_dirs: list[Path], out_dir: Path, console: Console, show: bool = True, baseline: str = "auto") -> None:
    """comparison.md and comparison.png in ``out_dir``; the table is printed when ``show``. Rows are compared with
    ``baseline`` (report.summary_table); one whose runs' labels do not name it (a grid over its hyper-parameters)
    is tabulated without, with a warning, rather than losing the tables of runs already made."""
    from fedhet.results.plots import plot_curves
    from fedhet.results.report import (
        NO_BASELINE,
        group_runs,
        load_runs,
        print_report,
        report_markdown,
        summary_table,
        table_notes,
    )

    groups = group_runs(load_runs(run_dirs))
    try:
        rows = summary_table(groups, metric="test_acc", baseline=baseline)
    except ConfigError as err:
        print_warning(console, f"{err}; the table has no comparison with a baseline")
        rows = summary_table(groups, metric="test_acc", baseline=NO_BASELINE)
    notes = table_notes(groups, rows)
    (out_dir / "comparison.md").write_text(report_markdown(rows, notes))
    # more methods than one axes shows legibly: one panel per method family (fedhet report --panels family)
    panels = "family" if len(groups) > PANEL_ABOVE else None
    plot = plot_curves(groups, out_dir / "comparison.png", metric="test_acc", panels=panels)
    if show:
        print_report(rows, console, notes)
        console.print(escape(f"table: {out_dir / 'comparison.md'}\nplot:  {plot}"))

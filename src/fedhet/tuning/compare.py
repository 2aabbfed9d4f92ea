"""``fedhet compare --tune TRIALS``: every variant tuned at the same budget on tuning seeds, then run with its best
values on the comparison's seeds.

For each variant (at each grid point) a tune runs in ``OUT/[point/]tuning/<variant>`` (an ordinary ``fedhet tune``
folder: study.db, trials/, tune.json), on the tuning seed(s), for TRIALS trials of ``--tune-rounds`` rounds
(default: the comparison's); with several tuning seeds a trial runs once per seed and scores their mean. A variant's
space is its algorithm's declared one plus the ``-t`` dimensions it has; a ``-t`` key no variant has is refused, and
a variant left with nothing to tune (FedAvg without ``-t train.lr``) keeps its defaults and spends no budget. The
final cells are the comparison's, with the best values set; each final run's provenance.json records the study, the
trial and its objective under ``tuning``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from fedhet.config import Config, build_config
from fedhet.errors import ConfigError, RunFailed
from fedhet.results.store import read_json, write_json_atomic
from fedhet.tuning.space import EDGE_MARKS, build_space, configured, tunable_parameters
from fedhet.tuning.study import TuneSettings
from fedhet.tuning.tuner import TuneResult, budget_text, plan_tune, tune_all, value_text

if TYPE_CHECKING:
    from fedhet.cells import Cell
    from fedhet.comparison import Comparison

TUNING_DIR = "tuning"
DEFAULT_TUNE_SEED = 100


@dataclass(frozen=True)
class TuneOptions:
    """``--tune TRIALS --tune-rounds R --tune-seeds S -t KEY=SPEC --metric --reduce --sampler --pruner``."""

    trials: int
    rounds: int | None = None
    seeds: str | int | list[int] | None = None
    space: tuple[str, ...] = ()
    metric: str = "val_acc"
    reduce: str = "last"
    sampler: str = "tpe"
    pruner: str = "median"

    @property
    def settings(self) -> TuneSettings:
        return TuneSettings(self.trials, self.metric, self.reduce, self.sampler, self.pruner)

    def seed_list(self) -> list[int]:
        """The tuning seeds (default 100): with several, each trial runs one run per seed, scored by their mean."""
        return [DEFAULT_TUNE_SEED] if self.seeds is None else parse_tune_seeds(self.seeds, "--tune-seeds")


def parse_tune_seeds(seeds: str | int | list[int], option: str) -> list[int]:
    """Distinct non-negative tuning seeds from ``"100,101"``, ``100`` or ``[100, 101]``; ``option`` names the setting
    in the error."""
    parts = seeds if isinstance(seeds, list) else str(seeds).split(",")
    text = [str(p).strip() for p in parts]
    if not text or not all(t.isascii() and t.isdigit() for t in text) or len(set(text)) < len(text):
        raise ConfigError(
            f"{option} {seeds!r}: give distinct seeds as a comma list of non-negative integers, "
            f"e.g. {option} 100 or 100,101"
        )
    return [int(t) for t in text]


@dataclass
class VariantTune:
    point: str  # the grid point's folder ("" without a grid)
    variant: str
    out_dir: Path
    space: str  # "" when the variant has nothing to tune
    result: TuneResult | None = None

    @property
    def label(self) -> str:
        """The variant, with its grid point where the comparison has one."""
        return f"{self.variant} ({self.point})" if self.point else self.variant


def variant_groups(plan: Comparison) -> dict[tuple[str, str], list[Cell]]:
    """The cells of each (grid point, variant), in order."""
    groups: dict[tuple[str, str], list[Cell]] = {}
    for cell in plan.cells:
        groups.setdefault(plan.variants[cell.name], []).append(cell)
    return groups


def check_space_keys(options: TuneOptions, configs: dict[str, Config]) -> None:
    """A ``-t`` key that no variant can tune would be silently dropped: refuse it, naming the variants."""
    every: dict[str, None] = {}
    for cfg in configs.values():
        every.update(dict.fromkeys(tunable_parameters(cfg)))
    for item in options.space:
        key = item.partition("=")[0].strip()
        if key not in every:
            raise ConfigError(
                f"-t {key}: no variant of this comparison can tune it ({', '.join(configs)}); tunable: "
                f"{', '.join(every)}"
            )


def tuning_config(cell: Cell, seed: int, rounds: int | None) -> Config:
    raw = cell.config.to_dict()
    raw["run"]["seed"] = seed
    if rounds is not None:
        raw["run"]["rounds"] = rounds
    return build_config(raw)


def plan_tunes(plan: Comparison, options: TuneOptions) -> list[tuple[VariantTune, Any]]:
    """Every variant's tune plan, each checked before any runs; (what is tuned, its TunePlan or None)."""
    settings = options.settings
    settings.check()
    seeds = options.seed_list()
    used = sorted({c.config.run.seed for c in plan.cells})
    shared = sorted(set(seeds) & set(used))
    if shared:
        raise ConfigError(
            f"the tuning seed(s) {', '.join(map(str, shared))} are also seeds of the comparison "
            f"({', '.join(map(str, used))}): the final runs need seeds the tuning never saw; give --tune-seeds others"
        )
    if options.rounds is not None and options.rounds < 1:
        raise ConfigError(f"--tune-rounds {options.rounds}: give 1 or more rounds")
    groups = variant_groups(plan)
    configs = {variant: cells[0].config for (_, variant), cells in groups.items()}
    check_space_keys(options, configs)
    planned = []
    for (point, variant), cells in groups.items():
        cfg = tuning_config(cells[0], seeds[0], options.rounds)
        own = tunable_parameters(cfg)
        specs = [s for s in options.space if s.partition("=")[0].strip() in own]
        out_dir = plan.out_dir / point / TUNING_DIR / variant.replace("+", "_")
        space = build_space(cfg, specs)
        tuned = VariantTune(point, variant, out_dir, space.describe())
        planned.append((tuned, plan_tune(cfg, specs, settings, out_dir, seeds) if space.dims else None))
    if all(p is None for _, p in planned):
        raise ConfigError(
            f"no variant of this comparison has anything to tune ({', '.join(configs)}); name shared settings with "
            "-t, e.g. -t train.lr"
        )
    return planned


def tune_comparison(
    plan: Comparison, options: TuneOptions, *, jobs: int, threads: int | None, console: Console
) -> list[VariantTune]:
    """Tune every variant, the tunes sharing ``jobs`` worker processes (``tuner.tune_all``: each runs as it would
    alone, and the next one's trials take the workers it leaves free), then set each cell's best values; returns what
    each variant chose. Raises RunFailed when a variant's tune completed no trial."""
    planned = plan_tunes(plan, options)
    todo = [(tuned, tune_plan) for tuned, tune_plan in planned if tune_plan is not None]
    for tuned, _ in todo:
        console.print(escape(f"tuning {tuned.label}: {tuned.space}"), highlight=False)
    labelled = [(tuned.label, tune_plan) for tuned, tune_plan in todo]
    results = tune_all(labelled, jobs=jobs, threads=threads, console=console, progress=plan.progress)
    empty = []
    for (tuned, _), result in zip(todo, results, strict=True):
        tuned.result = result
        if result.best_trial is None:
            where = f"{tuned.out_dir}/trials/*/summary.json"
            empty.append(f"tuning {tuned.label}: no trial completed ({budget_text(result.budget)}); see {where}")
    if empty:
        raise RunFailed("; ".join(empty))
    chosen = {(t.point, t.variant): t for t, _ in planned}
    for i, cell in enumerate(plan.cells):
        tuned = chosen[plan.variants[cell.name]]
        if tuned.result is not None:
            plan.cells[i] = type(cell)(cell.name, configured(cell.config, tuned.result.best_params))
    return [t for t, _ in planned]


def record_provenance(plan: Comparison, tuned: list[VariantTune], run_dirs: list[Path]) -> None:
    """Each final run's provenance.json gets ``tuning``: the study (database and name), trial, objective, budget."""
    chosen = {(t.point, t.variant): t for t in tuned}
    finals = {c.run_dir.resolve(): plan.variants[c.name] for c in plan.cells}
    for run_dir in run_dirs:
        key = finals.get(Path(run_dir).resolve())
        tuned_here = chosen.get(key) if key is not None else None
        path = Path(run_dir) / "provenance.json"
        if tuned_here is None or not path.exists():
            continue
        info = read_json(path, dict)
        info["tuning"] = tuning_record(tuned_here)
        write_json_atomic(path, info)


def tuning_record(tuned: VariantTune) -> dict[str, Any]:
    result = tuned.result
    if result is None:
        return {"tuned": False, "why": "the variant has no tunable parameter in this comparison's space"}
    return {
        "tuned": True,
        "study": {"storage": result.storage, "path": str(result.out_dir / "study.db"), "name": result.study_name},
        "trial": result.best_trial,
        "run_dir": str(result.best_run_dir),
        "objective": {"metric": result.metric, "reduce": result.reduce, "value": result.best_value},
        "params": result.best_params,
        "space": result.space,
        "budget": result.budget,
        "at_edge": result.at_edge,
    }


EDGE_NOTE = "⇤ / ⇥: chosen at the lower / upper edge of its range; the best may lie outside it (a wider range tells)"


def tuning_rows(tuned: list[VariantTune], metric: str) -> tuple[list[str], list[list[str]]]:
    head = ["variant", "chosen values", "trials", "rounds run", f"best {metric}", "tune folder"]
    points = len({t.point for t in tuned}) > 1
    if points:
        head.insert(0, "point")
    rows = []
    for t in tuned:
        r = t.result
        if r is None:
            row = [t.variant, "(nothing to tune: defaults)", "0", "0", "", ""]
        else:
            marks = {k: f" {EDGE_MARKS[side]}" for k, side in r.at_edge.items()}
            values = ", ".join(f"{k}={value_text(v)}{marks.get(k, '')}" for k, v in r.best_params.items())
            b = r.budget
            trials = f"{b['trials']} ({b['pruned']} pruned)" if b["pruned"] else str(b["trials"])
            row = [
                t.variant,
                values,
                trials,
                f"{b['rounds_run']} of {b['rounds_nominal']}",
                f"{r.best_value:.4f}",
                str(t.out_dir),
            ]
        rows.append(([t.point] if points else []) + row)
    return head, rows


def print_tuning(tuned: list[VariantTune], options: TuneOptions, out_dir: Path, console: Console) -> None:
    """The tuning table, printed and appended to comparison.md."""
    head, rows = tuning_rows(tuned, options.metric)
    title = tuning_title(options)
    table = Table(title=title, title_justify="left")
    for column in head:
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*(escape(v) for v in row))
    console.print(table)
    lines = ["", f"## {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(v.replace("|", "\\|") for v in row) + " |" for row in rows]
    if any(t.result is not None and t.result.at_edge for t in tuned):
        console.print(escape(EDGE_NOTE), style="yellow", highlight=False)
        lines += ["", EDGE_NOTE]
    path = out_dir / "comparison.md"
    if path.exists():
        path.write_text(path.read_text() + "\n".join(lines) + "\n")


def tuning_title(options: TuneOptions) -> str:
    rounds = f"{options.rounds} rounds" if options.rounds is not None else "the comparison's rounds"
    seeds = options.seed_list()
    on = f"seed {seeds[0]}" if len(seeds) == 1 else f"seeds {','.join(map(str, seeds))} (mean)"
    return (
        f"Tuning: {options.trials} trials x {rounds} per variant, {on}, on {options.metric} ({options.reduce}); "
        "final runs on the comparison's seeds, test metrics above"
    )

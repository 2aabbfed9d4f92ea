"""Load run folders, group seeds of the same experiment, and summarise them in mean ± std tables.

Two runs belong to one group when their resolved configs are equal apart from the seed, where the run is (its name,
output folder and plug-in paths) and how it was shown or laid out (DISPLAY_KEYS). A group's label is the algorithm
name plus the settings that tell the groups apart (`fedprox mu=0.1`). Groups come in one order everywhere (tables,
plots, the HTML page, `compare` and `report`): by setting, then method family, then method (`group_order`).
Standard deviations are over seeds, with Bessel's correction (ddof=1), shown for every measured column with two or
more seeds and left out for a single seed; count columns (clients never sampled) show their range instead.
A metric no run recorded is refused (``check_metric``); the global-model cells of a method whose server model no
client uses (``NO_GLOBAL_MODEL``: FedBN, FedPer) are marked and explained under the table (``table_notes``).
Beside the final value: its 95 % t interval over seeds, each row's paired difference from a baseline method's row of
the same setting (bootstrap interval, Wilcoxon p, pairs by seed and partition seed), and with several settings a
table of average ranks; the statistics are results/stats.py's, the legend every format prints is `stats_notes`.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from fedhet.errors import ConfigError, FedhetError
from fedhet.results.objective import STUDY_FILE
from fedhet.results.stats import (
    BOOTSTRAP_SEED,
    HIGHER,
    LOWER,
    RESAMPLES,
    PairedDifference,
    average_ranks,
    paired_difference,
    seed_summary,
)
from fedhet.results.store import Warn, read_json, read_metrics

# where a run is: its folder and plug-in paths (where the code is, not a setting)
LOCATION_KEYS = ("run.name", "run.out_dir", "run.plugins")
# How a run was shown or laid out, never what it computed: the progress display, checkpoint spacing, how many empty
# rounds it tolerated, the per-client file. run.workers and run.executor change only float rounding (the last bits,
# as a thread count or another CPU does, which no config records either), so a seed rerun under another executor
# belongs with its setting; a group that then holds a seed twice is named in the note under the table.
DISPLAY_KEYS = (
    "run.progress",
    "run.checkpoint_every",
    "run.max_empty_rounds",
    "run.workers",
    "run.executor",
    "run.client_metrics",
)
IGNORED_KEYS = ("run.seed", *LOCATION_KEYS, *DISPLAY_KEYS)
IGNORED_SECTIONS = ("tracking.",)  # where copies of the results went, not what ran
# the config sections that describe the setting (what a method is run on); the others describe the method
SETTING_SECTIONS = ("dataset.", "partition.", "model.", "train.")
# Method families, in the order rows, legends and `--panels family` show them; unknown names (plug-ins) go last
# ("other").
FAMILIES = {
    "aggregation": ("fedavg", "fednova", "qfedavg", "fedbc", "centralized", "fedrane_wo_lra"),
    "local regularisation": (
        "fedprox", "scaffold", "feddyn", "moon", "fedntd", "feddecorr", "fedrcl", "fedrane", "fedrane_wo_gne",
        "fedufo", "feduad", "fedufo_cls", "fedufo_cgr", "fedufo_cgl", "fedufo_uad_cgr", "fedufo_uad_cgl",
    ),
    "classifier calibration": ("fedlc", "fednh", "creff", "fedacd", "fedacd_base", "spherefed"),
    "personalised": (
        "fedrod", "fedper", "fedbabu", "perfedavg", "pfedme", "per_fedbc", "fedbc_finetune", "ditto", "apple",
        "fedmtl", "fedmeta", "fml",
    ),
}  # fmt: skip
MISSING = "—"
# Methods whose server model is no model any client uses: the shared layers averaged, with the layers each client
# keeps at their initial values. Their global-model cells are marked (GLOBAL_MARK) and explained under the table
# (global_model_note); their result is the personalised accuracy. Each reason completes "each client keeps ...".
NO_GLOBAL_MODEL = {
    "fedbn": "its own BatchNorm layers (parameters and statistics)",
    "fedper": "its own personalisation layers",
}
GLOBAL_MARK = "†"
# Under a feature skew with domains, each domain's accuracy of the global model and the worst of them
DOMAIN_PREFIX = "test_acc/domain/"
WORST_DOMAIN = DOMAIN_PREFIX + "worst"


@dataclass
class Run:
    path: Path
    config: dict
    metrics: list[dict]
    summary: dict = field(default_factory=dict)
    # the settings a tuner chose for this run (``fedhet compare --tune``, provenance.json's ``tuning.params``): they
    # belong to the method, so runs whose tuners chose differently are one setting and still pair with each other
    tuned: tuple[str, ...] = ()

    def values(self, metric: str) -> list[tuple[int, float]]:
        """(round, value) for every evaluation that recorded `metric`."""
        return [(r["round"], r[metric]) for r in self.metrics if r.get(metric) is not None]

    def final(self, metric: str) -> float | None:
        values = self.values(metric)
        return values[-1][1] if values else None

    def best(self, metric: str) -> float | None:
        values = [v for _, v in self.values(metric) if not math.isnan(v)]
        if not values:
            return None
        return min(values) if lower_is_better(metric) else max(values)

    @property
    def last_round(self) -> int:
        return self.metrics[-1]["round"] if self.metrics else 0


@dataclass
class Group:
    label: str
    runs: list[Run]
    settings: dict[str, Any]  # the flattened config shared by all runs, without IGNORED_KEYS


@dataclass
class Row:
    label: str
    metric: str
    seeds: int
    final_mean: float | None
    final_std: float | None
    best_mean: float | None
    client_dist_acc: float | None
    client_acc_worst10: float | None
    personal_acc_macro: float | None
    rounds: tuple[int, int]  # (fewest, most) rounds reached by a seed
    # OPTIONAL_COLUMNS: (mean, std) of the finals over seeds; for COUNT_COLUMNS (fewest, most)
    extras: dict[str, tuple[float | None, float | None]] = field(default_factory=dict)
    empty_rounds: int = 0  # rounds, over all seeds, that no client finished (summary.json)
    failed: int = 0  # seeds whose run ended with status "failed"
    # std over seeds of best_mean, client_dist_acc, client_acc_worst10, personal_acc_macro (None for one seed)
    best_std: float | None = None
    client_dist_acc_std: float | None = None
    client_acc_worst10_std: float | None = None
    personal_acc_macro_std: float | None = None
    no_global_model: str | None = None  # the algorithm, when it is one of NO_GLOBAL_MODEL
    final_ci: tuple[float, float] | None = None  # 95 % t interval of final_mean over seeds (two or more seeds)
    method: str = ""  # the label without the setting (`fedprox mu=0.1`)
    setting: str = "all"  # the dataset/partition/model/train values that tell settings apart (`alpha=0.1`)
    baseline: str | None = None  # the method this row is compared with, in its setting; None: no comparison
    versus: PairedDifference | None = None  # this row - baseline over the seeds both ran; None: no counterpart
    unpaired: int = 0  # runs of this row or of its baseline left out for want of a partner


# Personalised and fairness metrics shown as extra columns when some run recorded them. Personalisation that
# fine-tuned on test data (FedBC-FineTune's protocol) is logged under personal_leaky_* and shown as such.
OPTIONAL_COLUMNS = {
    "personal_acc_micro": "personal acc (micro)",
    "personal_leaky_acc_macro": "LEAKY personal acc (macro; tuned on test data)",
    "personal_never_sampled": "never sampled",
    "client_acc_std": "client acc std",
    "acc_smallest_client": "acc smallest client",
    "acc_largest_client": "acc largest client",
    "client_dist_acc_sampled": "client-dist acc (sampled)",
    "local_risk": "local-model risk",
    "local_kl": "local KL(P||Q)",
    "attack/asr": "backdoor success (ASR)",
    "privacy/epsilon": "epsilon spent",
}
# Counts of clients, not measurements: shown as a whole number, or the range over seeds ("0–3"), never "0 ± 0".
COUNT_COLUMNS = ("personal_never_sampled",)


def global_model_metric(metric: str) -> bool:
    """Whether ``metric`` scores the server's model (on the global test set, its domains, the clients'
    distributions and data, a backdoor), not personalised, local or client-reported models."""
    scored = ("test_acc", "test_loss", "test_acc_ema", "client_dist_acc", "client_dist_acc_sampled", "attack/asr")
    return metric in scored or metric.startswith(("client_acc_", "acc_smallest", "acc_largest", DOMAIN_PREFIX))


def domain_metrics(runs: list[Run]) -> list[str]:
    """The per-domain accuracies some run recorded, in the order recorded, with the worst domain's last."""
    keys = [k for k in recorded_metrics(runs) if k.startswith(DOMAIN_PREFIX)]
    return [k for k in keys if k != WORST_DOMAIN] + [k for k in keys if k == WORST_DOMAIN]


def column_name(metric: str) -> str:
    """A table column's header for an optional or a per-domain metric."""
    if metric == WORST_DOMAIN:
        return "worst domain acc"
    if metric.startswith(DOMAIN_PREFIX):
        return f"acc domain {metric.removeprefix(DOMAIN_PREFIX)}"
    return OPTIONAL_COLUMNS[metric]


def lower_is_better(metric: str) -> bool:
    # A backdoor's success rate is the attacker's score: the best run is the one it succeeded least on.
    return "loss" in metric or metric in ("local_risk", "local_kl", "attack/asr", "privacy/epsilon")


def is_percent(metric: str) -> bool:
    """Whether `metric` is a fraction that tables and plots show as a percentage (accuracies, attack success)."""
    return "acc" in metric or metric == "attack/asr"


def load_runs(paths: list[str | Path], warn: Warn = None) -> list[Run]:
    """Runs in the given folders: each path is a run folder or any folder above run folders. A torn last metrics
    line is skipped with ``warn`` (else a Python warning).

    The trial runs of a tune (the folders under one that holds ``study.db``) are left out when the path is above the
    tune, as a tuned comparison's folder is (its ``tuning/<variant>``): they are the search, not the results. A path
    to the tune folder or inside it reads them."""
    folders: list[Path] = []
    for path in map(Path, paths):
        if not path.exists():
            raise FedhetError(f"{path} does not exist")
        found = sorted(c.parent for c in path.rglob("config.json") if (c.parent / "metrics.jsonl").exists())
        if not found:
            raise FedhetError(f"no runs (config.json + metrics.jsonl) under {path}")
        results = [f for f in found if not _in_tune_below(f, path)]
        if not results:
            raise FedhetError(
                f"only the trial runs of tunes under {path}; to report them, give a tune folder (one with study.db)"
            )
        folders += [f for f in results if f not in folders]
    return [load_run(folder, warn) for folder in folders]


def _in_tune_below(folder: Path, top: Path) -> bool:
    """Whether ``folder`` lies in a tune folder (one with study.db) strictly below ``top``."""
    for parent in folder.relative_to(top).parents:
        if parent != Path(".") and (top / parent / STUDY_FILE).exists():
            return True
    return False


def load_run(folder: Path, warn: Warn = None) -> Run:
    summary_path = folder / "summary.json"
    summary = read_json(summary_path, dict) if summary_path.exists() else {}
    config, metrics = read_json(folder / "config.json", dict), read_metrics(folder / "metrics.jsonl", warn)
    return Run(folder, config, metrics, summary, tuned_settings(folder))


def tuned_settings(folder: Path) -> tuple[str, ...]:
    """The keys a tuner chose for the run in ``folder`` (provenance.json's ``tuning.params``); () for other runs."""
    path = folder / "provenance.json"
    try:
        tuning = read_json(path, dict).get("tuning") if path.exists() else None
    except FedhetError:  # an unreadable provenance says nothing about tuning; the run is still reported
        return ()
    params = tuning.get("params") if isinstance(tuning, dict) else None
    return tuple(sorted(params)) if isinstance(params, dict) else ()


def tuned_keys(groups: list[Group]) -> frozenset[str]:
    """Every key a tuner chose for some run of ``groups``."""
    return frozenset(key for group in groups for run in group.runs for key in run.tuned)


def recorded_metrics(runs: list[Run]) -> list[str]:
    """Every metric some run recorded (a key of its records other than ``round``), in the order first met."""
    keys = dict.fromkeys(key for run in runs for record in run.metrics for key in record)
    keys.pop("round", None)
    return list(keys)


def check_metric(runs: list[Run], metric: str) -> None:
    """Refuse ``metric`` when the runs recorded metrics and none of them is ``metric``: a typo would otherwise give
    a table of dashes. Runs with no record yet (just started) refuse nothing."""
    recorded = recorded_metrics(runs)
    if recorded and metric not in recorded:
        raise ConfigError(f"no run recorded the metric {metric!r}; the runs recorded: {', '.join(recorded)}")


def flatten(config: dict, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists and other leaves are kept as they are."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def run_settings(config: dict) -> dict[str, Any]:
    """The flattened config without the seed, location and display keys: what makes runs one experiment."""
    return {k: v for k, v in flatten(config).items() if k not in IGNORED_KEYS and not k.startswith(IGNORED_SECTIONS)}


def group_runs(runs: list[Run]) -> list[Group]:
    """Groups of runs that differ only by seed (or by location and display keys), in ``group_order``; within a
    group, runs by seed."""
    groups: dict[str, Group] = {}
    for run in runs:
        settings = run_settings(run.config)
        key = json.dumps(settings, sort_keys=True, default=str)
        if key not in groups:
            groups[key] = Group("", [], settings)
        groups[key].runs.append(run)
    tuned = tuned_keys(list(groups.values()))
    result = [groups[k] for k in group_order({k: g.settings for k, g in groups.items()}, tuned)]
    for group in result:
        group.runs.sort(key=lambda r: (value_key(r.config.get("run", {}).get("seed")), str(r.path)))
    for group, label in zip(result, make_labels([g.settings for g in result]), strict=True):
        group.label = label
    return result


def group_order(settings: dict[str, dict[str, Any]], tuned: frozenset[str] = frozenset()) -> list[str]:
    """The keys of ``settings`` (one flattened config per group) in the one order every table and plot uses: by the
    setting (the dataset, partition, model and training values that differ, numbers by value), then by method
    family (FAMILIES: FedAvg first, plug-ins last), the algorithm's place in it, the server optimiser (plain
    averaging first), and the method's remaining differing settings. Whatever order the runs were found in (a
    comparison's cells, a folder listing), the rows come out the same. ``tuned`` keys (``tuned_keys``) are the
    method's, whatever their section."""
    keys = differing_keys(list(settings.values()), presence_counts=True)
    setting_keys = [k for k in keys if k.startswith(SETTING_SECTIONS) and k not in tuned]
    method_keys = [k for k in keys if k not in setting_keys]

    def order(item: tuple[str, dict[str, Any]]) -> tuple:
        key, s = item
        algorithm = str(s.get("algorithm.name", ""))
        return (
            tuple(value_key(s.get(k, ABSENT)) for k in setting_keys),
            method_rank(algorithm),
            s.get("server.aggregation", "weights") != "weights",
            s.get("server.name", "sgd") != "sgd",
            str(s.get("server.name", "")),
            tuple(value_key(s.get(k, ABSENT)) for k in method_keys),
            key,
        )

    return [key for key, _ in sorted(settings.items(), key=order)]


def method_rank(algorithm: str) -> tuple[int, int, str]:
    """(family, place in the family, name): FedAvg first, plug-ins ("other") last and by name."""
    for i, members in enumerate(FAMILIES.values()):
        if algorithm in members:
            return i, members.index(algorithm), algorithm
    return len(FAMILIES), 0, algorithm


def value_key(value: Any) -> tuple:
    """A sort key that puts absent values first, numbers by value (0.5 before 10), then text, then the rest."""
    if value is ABSENT or value is None:
        return (0,)
    if isinstance(value, bool):
        return (1, int(value), "")
    if isinstance(value, int | float):
        return (1, value, "")
    if isinstance(value, str):
        return (2, 0, value)
    return (3, 0, json.dumps(value, sort_keys=True, default=str))


def partition_seed(run: Run) -> Any:
    """The seed the run's partition was drawn with: ``partition.seed``, else ``run.seed``."""
    part = run.config.get("partition", {}).get("seed")
    return run.config.get("run", {}).get("seed") if part is None else part


def partition_note(groups: list[Group]) -> str | None:
    """Whether the seeds of a row trained on one partition or on one each, so a reader knows what ± includes, and
    any row that holds a seed twice (runs that differ only in display or executor keys).

    None when no row has two seeds."""
    note = seeds_note(groups)
    twice = repeated_seeds(groups)
    if twice and note:
        return f"{note} {twice}"
    return note or twice


def repeated_seeds(groups: list[Group]) -> str | None:
    """'fedavg holds seed 0 twice ...' for the rows in which two runs share a seed, else None."""
    found = []
    for group in groups:
        seeds = [run.config.get("run", {}).get("seed") for run in group.runs]
        twice = sorted({s for s in seeds if seeds.count(s) > 1}, key=value_key)
        if twice:
            found.append(f"{group.label} (seed {', '.join(map(str, twice))})")
    if not found:
        return None
    return (
        f"Repeated seeds: {'; '.join(found)}: runs of one seed that differ only in how they ran (e.g. run.executor, "
        "run.workers) each count in the mean and ±."
    )


def seeds_note(groups: list[Group]) -> str | None:
    fixed, per_seed = [], []
    for group in groups:
        if len(group.runs) < 2:
            continue
        seeds = {partition_seed(run) for run in group.runs}
        (fixed if len(seeds) == 1 else per_seed).append(group)
    if not fixed and not per_seed:
        return None
    shared = "the seeds of each row share one partition ({}), so ± is over training randomness only"
    drawn = "each seed draws its own partition (partition.seed follows run.seed), so ± includes partition variance"
    if not per_seed:
        seeds = sorted({str(partition_seed(g.runs[0])) for g in fixed})
        return "Seeds: " + shared.format("partition seed " + ", ".join(seeds))
    if not fixed:
        return "Seeds: " + drawn
    return (
        f"Seeds: rows differ. {', '.join(g.label for g in fixed)}: {shared.format('fixed partition.seed')}; "
        f"{', '.join(g.label for g in per_seed)}: {drawn}."
    )


def method_and_setting(groups: list[Group]) -> tuple[list[str], list[str]]:
    """Each group's method (its label without the setting: ``fedprox mu=0.1``) and setting (``alpha=0.1``, or
    "all" where the groups share one). The values a tuner chose (``tuned_keys``) are in neither: a tuned fedprox is
    the method ``fedprox`` (its chosen values are in its label and the tuning table), in the setting of the others."""
    settings = [g.settings for g in groups]
    tuned = tuned_keys(groups)
    keys = [k for k in differing_keys(settings, presence_counts=False) if k not in tuned]
    setting_keys = [k for k in keys if k.startswith(SETTING_SECTIONS)]
    method_keys = [k for k in keys if k not in setting_keys]
    methods = [label_for(s, method_keys) for s in settings]
    names = short_names(setting_keys)
    setting = [" ".join(f"{names[k]}={format_value(s.get(k))}" for k in setting_keys) or "all" for s in settings]
    return methods, setting


def make_labels(settings: list[dict[str, Any]]) -> list[str]:
    """Algorithm name plus the settings whose values differ between groups; unique and short."""
    keys = differing_keys(settings, presence_counts=False)
    labels = [label_for(s, keys) for s in settings]
    if len(set(labels)) < len(labels):
        keys = differing_keys(settings, presence_counts=True)
        labels = [label_for(s, keys) for s in settings]
    return dedupe(labels)


COMPONENTS = ("algorithm", "server", "model", "dataset", "partition")
ABSENT = "\0absent"  # a key a group's config lacks, as a value no JSON text can equal


def owner(key: str, settings: dict[str, Any]) -> Any:
    """A component parameter (``server.lr``) is only comparable between groups using the same component."""
    section = key.split(".")[0]
    if section in COMPONENTS and not key.endswith(".name"):
        return settings.get(f"{section}.name")
    return None


def differing_keys(settings: list[dict[str, Any]], presence_counts: bool) -> list[str]:
    """Keys whose values differ across groups, algorithm hyper-parameters first.

    Without `presence_counts`, a key only some groups have (FedProx's mu next to FedAvg) counts only if those
    groups disagree on it: the algorithm name already tells such groups apart. Likewise a server optimiser's lr
    only counts between groups that use the same server optimiser. A component key that some groups of the same
    component have and others lack (a run made before the option existed, next to one that sets it) counts too:
    the name no longer tells them apart.
    """
    order = list(dict.fromkeys(k for s in settings for k in s))
    keys = []
    for key in order:
        values: dict[Any, set[str]] = {}
        for s in settings:
            group = owner(key, s)
            if key in s:
                values.setdefault(group, set()).add(json.dumps(s[key], sort_keys=True, default=str))
            elif group is not None:
                values.setdefault(group, set()).add(ABSENT)
        missing = any(key not in s for s in settings)
        if any(len(v) > 1 for v in values.values()) or (presence_counts and missing):
            keys.append(key)
    keys = [k for k in keys if k not in ("algorithm.name", "server.name", "server.aggregation")]
    return sorted(keys, key=lambda k: not k.startswith("algorithm."))


def label_for(settings: dict[str, Any], keys: list[str]) -> str:
    """``fedprox mu=0.1``; GNE aggregation and a server optimiser other than plain averaging join the name:
    ``fedavg+gne``, ``fedavg+fedadam``, ``fedavg+gne+fedadam``."""
    names = short_names(keys)
    head = str(settings.get("algorithm.name", "run"))
    if settings.get("server.aggregation", "weights") != "weights":
        head += "+" + str(settings["server.aggregation"])
    if settings.get("server.name", "sgd") != "sgd":
        head += "+" + str(settings["server.name"])
    parts = [head]
    gne = settings.get("server.aggregation") == "gne"
    for k in keys:
        if k in settings and (gne or not k.startswith("server.gne_")):  # GNE's options mean nothing without it
            name = k.split(".")[0] if k.endswith(".name") else names[k]
            parts.append(f"{name}={format_value(settings[k])}")
    return " ".join(parts)


def short_names(keys: list[str]) -> dict[str, str]:
    """Shortest dotted suffix of each key that no other key shares: `lr`, or `train.lr` and `server.lr`."""
    names = {}
    for key in keys:
        parts = key.split(".")
        for n in range(1, len(parts) + 1):
            suffix = ".".join(parts[-n:])
            if not any(other != key and (other == suffix or other.endswith("." + suffix)) for other in keys):
                break
        names[key] = suffix
    return names


def format_value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(format_value(v) for v in value) + "]"
    return str(value)


def dedupe(labels: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    result = []
    for label in labels:
        seen[label] = seen.get(label, 0) + 1
        result.append(label if seen[label] == 1 else f"{label} ({seen[label]})")
    return result


AUTO = "auto"  # the default baseline: fedavg where a row of that method is there
AUTO_BASELINE = "fedavg"
NO_BASELINE = "none"


def summary_table(groups: list[Group], metric: str = "test_acc", baseline: str = AUTO) -> list[Row]:
    """One row per group: mean ± std over seeds, the final value's 95 % t interval, and with a ``baseline`` (a
    method, as the rows name it without their setting) each row's paired difference from that method's row in the
    same setting. ``baseline``: "auto" (fedavg when some row is plain fedavg and some row has two seeds paired with
    it), "none", or a method name."""
    rows = [summary_row(group, metric) for group in groups]
    methods, settings = method_and_setting(groups)
    for row, method, setting in zip(rows, methods, settings, strict=True):
        row.method, row.setting = method, setting
    chosen = baseline_method(methods, baseline)
    if chosen is None:
        return rows
    try:
        compare_with_baseline(groups, rows, chosen, metric)
    except ConfigError:
        if baseline != AUTO:
            raise
    if baseline == AUTO and not any(r.versus is not None and r.versus.n >= 2 for r in rows):
        for row in rows:  # a default that has nothing to say (or cannot tell which fedavg) stays out of the table
            row.baseline, row.versus, row.unpaired = None, None, 0
    return rows


def baseline_method(methods: list[str], baseline: str) -> str | None:
    """The method rows are compared with, or None; a name that no row has is an error naming the choices."""
    if baseline == NO_BASELINE:
        return None
    if baseline == AUTO:
        return AUTO_BASELINE if AUTO_BASELINE in methods else None
    if baseline not in methods:
        choices = ", ".join([*dict.fromkeys(methods), AUTO, NO_BASELINE])
        raise ConfigError(f"baseline {baseline!r} is not a method of these runs; choose one of: {choices}")
    return baseline


def compare_with_baseline(groups: list[Group], rows: list[Row], baseline: str, metric: str) -> None:
    """Each row's paired difference from the baseline's row in its setting (over the seeds both ran on the same
    partition); the baseline row itself and rows of a setting without the baseline get none."""
    base = {}
    for group, row in zip(groups, rows, strict=True):
        if row.method == baseline:
            if row.setting in base:  # rows that differ only in a key some runs lack (a newer option)
                raise ConfigError(
                    f"baseline {baseline!r} is two rows of one setting ({base[row.setting][1]}; {row.label}); "
                    "choose another baseline, or none"
                )
            base[row.setting] = (group, row.label)
    for group, row in zip(groups, rows, strict=True):
        counterpart = base.get(row.setting, (None,))[0]
        if counterpart is None:
            continue
        row.baseline = baseline
        if counterpart is group:
            continue
        mine, theirs, row.unpaired = paired_finals(group.runs, counterpart.runs, metric)
        row.versus = paired_difference(mine, theirs)


def paired_finals(runs: list[Run], base_runs: list[Run], metric: str) -> tuple[list[float], list[float], int]:
    """The final ``metric`` of ``runs`` and of ``base_runs`` paired by seed and partition seed (sorted by them, so
    the bootstrap sees the same order however the folders were found), and how many runs of either had no
    partner: a seed only one side ran, one that a side holds twice, or a run that did not record the metric."""
    mine, theirs = finals_by_seed(runs, metric), finals_by_seed(base_runs, metric)
    shared = sorted(set(mine) & set(theirs))
    unpaired = len(runs) + len(base_runs) - 2 * len(shared)
    return [mine[k] for k in shared], [theirs[k] for k in shared], unpaired


def finals_by_seed(runs: list[Run], metric: str) -> dict[tuple, float]:
    """(seed, partition seed) -> final value, for the keys exactly one run has, with a finite value."""
    keys = [(value_key(run.config.get("run", {}).get("seed")), value_key(partition_seed(run))) for run in runs]
    found = {}
    for key, run in zip(keys, runs, strict=True):
        value = run.final(metric)
        if keys.count(key) == 1 and value is not None and math.isfinite(value):
            found[key] = value
    return found


def summary_row(group: Group, metric: str) -> Row:
    runs = group.runs
    final_mean, final_std = mean_std([r.final(metric) for r in runs])
    final = seed_summary([r.final(metric) for r in runs])
    best_mean, best_std = mean_std([r.best(metric) for r in runs])
    dist, dist_std = mean_std([r.final("client_dist_acc") for r in runs])
    worst, worst_std = mean_std([r.final("client_acc_worst10") for r in runs])
    personal, personal_std = mean_std([r.final("personal_acc_macro") for r in runs])
    rounds = [r.last_round for r in runs]
    algorithm = str(group.settings.get("algorithm.name", ""))
    return Row(
        label=group.label,
        metric=metric,
        seeds=len(runs),
        final_mean=final_mean,
        final_std=final_std,
        best_mean=best_mean,
        client_dist_acc=dist,
        client_acc_worst10=worst,
        personal_acc_macro=personal,
        rounds=(min(rounds), max(rounds)),
        extras={
            key: (value_range if key in COUNT_COLUMNS else mean_std)([r.final(key) for r in runs])
            for key in [*OPTIONAL_COLUMNS, *domain_metrics(runs)]
        },
        empty_rounds=sum(int(r.summary.get("empty_rounds") or 0) for r in runs),
        failed=sum(r.summary.get("status") == "failed" for r in runs),
        best_std=best_std,
        client_dist_acc_std=dist_std,
        client_acc_worst10_std=worst_std,
        personal_acc_macro_std=personal_std,
        no_global_model=algorithm if algorithm in NO_GLOBAL_MODEL else None,
        final_ci=None if final.ci_low is None or final.ci_high is None else (final.ci_low, final.ci_high),
    )


def mean_std(values: list[float | None]) -> tuple[float | None, float | None]:
    """Mean and sample std (ddof=1) of the values present; the std is None below two."""
    present = [v for v in values if v is not None]
    return mean(present), statistics.stdev(present) if len(present) > 1 else None


def value_range(values: list[float | None]) -> tuple[float | None, float | None]:
    """(fewest, most) of the values present: how a count column spans the seeds."""
    present = [v for v in values if v is not None]
    return (min(present), max(present)) if present else (None, None)


def mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def table_cells(rows: list[Row]) -> tuple[list[str], list[list[str]]]:
    """Header and formatted cells shared by the rich and markdown renderings."""
    metric = rows[0].metric if rows else "test_acc"
    header = ["run", "seeds", f"final {metric}", f"best {metric}", "client-dist acc", "worst-10% acc"]
    recorded = [k for r in rows for k, v in r.extras.items() if v[0] is not None]
    domains = [k for k in dict.fromkeys(recorded) if k.startswith(DOMAIN_PREFIX)]
    domains = [k for k in domains if k != WORST_DOMAIN] + [k for k in domains if k == WORST_DOMAIN]
    personal = any(r.personal_acc_macro is not None for r in rows)
    if personal:
        header.append("personal acc (macro)")
    extras = [k for k in OPTIONAL_COLUMNS if k in recorded]
    header[6:6] = [column_name(k) for k in domains]  # the global model's columns together
    header += [column_name(k) for k in extras]
    header.append("rounds")
    # how far to trust a row: shown only where some run lost rounds or failed
    trouble = [
        name
        for name, key in (("empty rounds", "empty_rounds"), ("failed", "failed"))
        if any(getattr(r, key) for r in rows)
    ]
    header += trouble
    stats_header, stats = stat_cells(rows)
    header[3:3] = stats_header  # beside the final value they are about
    cells = []
    for r, extra in zip(rows, stats, strict=True):
        line = [r.label, str(r.seeds), marked(fmt(r.final_mean, r.final_std, metric=metric), r, metric), *extra]
        line += [marked(fmt(r.best_mean, r.best_std, metric=metric), r, metric)]
        line += [marked(fmt(r.client_dist_acc, r.client_dist_acc_std, metric="acc"), r, "client_dist_acc")]
        line += [marked(fmt(r.client_acc_worst10, r.client_acc_worst10_std, metric="acc"), r, "client_acc_worst10")]
        line += [marked(fmt(*r.extras.get(k, (None, None)), metric=k), r, k) for k in domains]
        if personal:
            line.append(fmt(r.personal_acc_macro, r.personal_acc_macro_std, metric="acc"))
        for k in extras:
            value = r.extras.get(k, (None, None))
            line.append(fmt_range(*value) if k in COUNT_COLUMNS else marked(fmt(*value, metric=k), r, k))
        line.append(fmt_range(*r.rounds))
        line += [str(r.empty_rounds if name == "empty rounds" else r.failed) for name in trouble]
        cells.append(line)
    return header, cells


def marked(text: str, row: Row, metric: str) -> str:
    """A cell of a global-model metric in the row of a method without a global model, marked GLOBAL_MARK."""
    if row.no_global_model and text != MISSING and global_model_metric(metric):
        return f"{text} {GLOBAL_MARK}"
    return text


def global_model_note(rows: list[Row], metric: str | None = None) -> str | None:
    """The footnote of the marked cells: which methods have no global model, what their global-model numbers score
    instead, and where their result is. None without such a row (or when ``metric``, a table's only metric, does
    not score the global model)."""
    methods = list(dict.fromkeys(r.no_global_model for r in rows if r.no_global_model))
    if not methods or (metric is not None and not global_model_metric(metric)):
        return None
    keeps = "; ".join(f"{name}: each client keeps {NO_GLOBAL_MODEL[name]}" for name in methods)
    return (
        f"{GLOBAL_MARK} not a global model. {keeps}. The server's model is the averaged layers with the kept layers "
        "at their initial values, a model no client uses, so the marked global-model numbers are a diagnostic; "
        "the method's result is its personalised accuracy (the personal acc columns, with local test splits: "
        "partition.local_test_fraction or partition.local_test)."
    )


def table_notes(groups: list[Group], rows: list[Row]) -> list[str]:
    """The notes under a table: the marked cells' footnote, then which partitions the seeds had."""
    return [note for note in (global_model_note(rows), partition_note(groups)) if note]


def stat_cells(rows: list[Row]) -> tuple[list[str], list[list[str]]]:
    """The statistics columns of a table of ``rows`` (one metric): the final value's 95 % interval over seeds where
    some row has two seeds, and with a baseline the paired difference from it, its p-value and the pairs used."""
    metric = rows[0].metric if rows else "test_acc"
    header: list[str] = []
    cells: list[list[str]] = [[] for _ in rows]
    if any(r.final_ci is not None for r in rows):
        header.append(CI_COLUMN)
        for line, r in zip(cells, rows, strict=True):
            line.append(fmt_interval(r.final_ci, metric) if r.final_ci else MISSING)
    baseline = next((r.baseline for r in rows if r.baseline is not None), None)
    if baseline is not None:
        header += [f"Δ vs {baseline}", P_COLUMN, "pairs"]
        for line, r in zip(cells, rows, strict=True):
            line += versus_cells(r)
    return header, cells


CI_COLUMN = "95% CI"
P_COLUMN = "p (Wilcoxon)"
NOT_AVAILABLE = "n/a"


def versus_cells(row: Row) -> list[str]:
    """Δ [interval] marker, p and pairs of a row against its baseline."""
    if row.baseline is None:
        return [MISSING] * 3
    if row.versus is None:  # the baseline row itself
        return ["baseline", MISSING, MISSING]
    v = row.versus
    if v.mean is None:
        return [NOT_AVAILABLE, NOT_AVAILABLE, str(v.n)]
    interval = fmt_interval((v.ci_low, v.ci_high), row.metric, signed=True) if v.ci_low is not None else ""
    delta = " ".join(part for part in (fmt_signed(v.mean, row.metric), interval, v.marker) if part)
    return [delta, NOT_AVAILABLE if v.p is None else f"{v.p:.3g}", str(v.n)]


def fmt_signed(value: float, metric: str) -> str:
    scale, spec = (100.0, "+.2f") if is_percent(metric) else (1.0, "+.4g")
    return format(value * scale, spec)


def fmt_interval(interval: tuple[float | None, float | None], metric: str, signed: bool = False) -> str:
    """``[80.52, 83.48]``; a difference's with signs: ``[+0.30, +2.10]``."""
    low, high = interval
    if low is None or high is None:
        return MISSING
    if signed:
        return f"[{fmt_signed(low, metric)}, {fmt_signed(high, metric)}]"
    return f"[{fmt(low, metric=metric)}, {fmt(high, metric=metric)}]"


def stats_notes(rows: list[Row]) -> list[str]:
    """The legend of the statistics columns and of the rank table: which test, over how many pairs, and what a
    marker means. Empty when the table has none of them."""
    if not rows:
        return []
    metric = rows[0].metric
    better = "lower" if lower_is_better(metric) else "higher"
    notes = []
    if any(r.final_ci is not None for r in rows):
        notes.append(
            f"{CI_COLUMN}: Student t interval of the mean final {metric} over a row's seeds "
            f"(scipy.stats.ttest_1samp); ± is the sample std (n-1)."
        )
    baseline = next((r.baseline for r in rows if r.baseline is not None), None)
    if baseline is not None:
        notes.append(versus_note(rows, baseline, metric, better))
    if rank_table(rows) is not None:
        notes.append(
            f"avg rank: each method's mean final {metric} ranked within each setting (1 = best, {better} is "
            "better; ties share the average rank, scipy.stats.rankdata), averaged over the settings it ran in."
        )
    return notes


def versus_note(rows: list[Row], baseline: str, metric: str, better: str) -> str:
    compared = [r.versus for r in rows if r.versus is not None]
    counts = sorted({v.n for v in compared})
    pairs = "no row" if not counts else f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}–{counts[-1]}"
    unpaired = sum(r.unpaired for r in rows)
    runs = "1 run" if unpaired == 1 else f"{unpaired} runs"
    left_out = f"; {runs} without a partner left out" if unpaired else ""
    unit = " (percentage points)" if is_percent(metric) else ""
    return (
        f"Δ vs {baseline}: mean of the paired differences row − {baseline} in final {metric}{unit}, against "
        f"{baseline}'s row of the same setting; two runs pair when they share the seed and the partition seed "
        f"({pairs} pairs per row{left_out}). In brackets: the 95% paired bootstrap interval of that mean "
        f"(scipy.stats.bootstrap, percentile, {RESAMPLES} resamples, seed {BOOTSTRAP_SEED}), never wider than the "
        f"differences' range, so with few pairs read it beside p; {HIGHER} / {LOWER}: the interval lies wholly above "
        f"/ below 0 ({better} is better for {metric}). {P_COLUMN}: two-sided signed-rank test (scipy.stats.wilcoxon; "
        f"at least 0.25 with 3 pairs). {NOT_AVAILABLE}: fewer than 2 pairs, or no nonzero difference."
    )


def rank_table(rows: list[Row]) -> tuple[list[str], list[list[str]]] | None:
    """Methods x settings, each cell the method's mean final value and its rank there, then the average rank; None
    with fewer than two settings or two methods."""
    settings = list(dict.fromkeys(r.setting for r in rows))
    methods = list(dict.fromkeys(r.method for r in rows))
    cells = {(r.setting, r.method) for r in rows}
    if len(settings) < 2 or len(methods) < 2 or len(cells) < len(rows):  # two rows of one method in a setting
        return None
    metric = rows[0].metric
    means = {s: {r.method: r.final_mean for r in rows if r.setting == s} for s in settings}
    ranks, average = average_ranks(means, lower_is_better(metric))
    header = ["method", *settings, "avg rank"]
    cells = []
    for method in methods:
        line = [method]
        for s in settings:
            rank = ranks.get(s, {}).get(method)
            value = means[s].get(method)
            shown = fmt(value, metric=metric) + ("" if rank is None else f" ({rank:g})")
            line.append(MISSING if value is None else shown)
        line.append(MISSING if method not in average else f"{average[method]:.2f}")
        cells.append(line)
    return header, cells


def fmt(value: float | None, std: float | None = None, *, metric: str) -> str:
    """Accuracies and rates as percentages with two decimals, other metrics with four significant digits."""
    if value is None:
        return MISSING
    scale, spec = (100.0, ".2f") if is_percent(metric) else (1.0, ".4g")
    text = format(value * scale, spec)
    return text if std is None else f"{text} ± {format(std * scale, spec)}"


def fmt_range(low: float | None, high: float | None) -> str:
    """A count over seeds: ``3`` when every seed agrees, else ``2–5``."""
    if low is None or high is None:
        return MISSING
    low, high = round(low), round(high)
    return str(high) if low == high else f"{low}–{high}"


def print_table(rows: list[Row], console: Console | None = None, title: str | None = None) -> None:
    print_cells(*table_cells(rows), console or Console(), title)


def print_cells(header: list[str], cells: list[list[str]], console: Console, title: str | None = None) -> None:
    table = Table(title=title)
    # Nothing is cut where the console is narrow: a number and each word of its header keep their full width (the
    # header wraps between words), a long label wraps onto more lines instead of squeezing the numbers out, and a
    # table still too wide is printed wider than the console rather than cropped.
    labels = max([len(line[0]) for line in cells] + [12])
    table.add_column(escape(header[0]), justify="left", overflow="fold", min_width=min(labels, 40))
    for i, name in enumerate(header[1:], start=1):
        widest = max([len(line[i]) for line in cells] + [len(word) for word in name.split()])
        table.add_column(escape(name), justify="right", overflow="fold", min_width=widest)
    for line in cells:
        table.add_row(*map(escape, line))  # intervals and labels ([32]) are text, not markup
    console.print(table, crop=False)


def print_report(rows: list[Row], console: Console, notes: list[str] | None = None) -> None:
    """The table, the rank table over settings (where there are several), then the notes (``table_notes``) and the
    legend."""
    print_table(rows, console)
    ranks = rank_table(rows)
    if ranks is not None:
        print_cells(*ranks, console, title=rank_title(rows))
    for line in (notes or []) + stats_notes(rows):
        console.print(escape(line))


def rank_title(rows: list[Row]) -> str:
    settings = len(dict.fromkeys(r.setting for r in rows))
    return f"average rank over {settings} settings (final {rows[0].metric})"


def to_markdown(rows: list[Row]) -> str:
    return cells_markdown(*table_cells(rows))


def cells_markdown(header: list[str], cells: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join([":---"] + ["---:"] * (len(header) - 1)) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in line) + " |" for line in cells]
    return "\n".join(lines) + "\n"


def report_markdown(rows: list[Row], notes: list[str] | None = None) -> str:
    """comparison.md and ``fedhet report --markdown``: the table, the rank table, the notes (``table_notes``) and
    the legend."""
    parts = [to_markdown(rows)]
    ranks = rank_table(rows)
    if ranks is not None:
        parts.append(f"{rank_title(rows)}:\n\n{cells_markdown(*ranks)}")
    parts += [line + "\n" for line in (notes or []) + stats_notes(rows)]
    return "\n".join(parts) + "\n"

"""What a tuner optimises: one number read from a run folder's validation metrics, never from its test metrics.

A tuner that chose hyper-parameters by test accuracy would report a test accuracy that was selected on the test set
(an optimistic, unfair comparison). ``objective`` therefore reads only the ``val_*`` keys of ``metrics.jsonl``, which
``partition.validation_fraction`` makes the run log (docs/tuning.md, "Validation data"), and refuses every other key.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Literal

from fedhet.errors import ConfigError
from fedhet.results.store import read_metrics

VALIDATION_PREFIX = "val_"
# the SQLite study a tune keeps in its folder (fedhet.tuning.study); a folder holding one is a tune's
STUDY_FILE = "study.db"
# "last", "best", or "last<K>": the mean of the last K evaluations (a steadier reading of a noisy curve)
Reduce = str
REDUCE_CHOICES = "'last', 'best' or 'last<K>' (the mean of the last K evaluations, K >= 2, e.g. last3)"


def reduce_window(reduce: str) -> int | None:
    """The K of ``last<K>`` (1 for ``last``), None for ``best``; anything else is refused in one line."""
    if reduce == "best":
        return None
    if reduce == "last":
        return 1
    match = re.fullmatch(r"last([0-9]+)", reduce) if isinstance(reduce, str) else None
    if match is None or int(match.group(1)) < 2:
        raise ConfigError(f"unknown reduce {reduce!r}; choose {REDUCE_CHOICES}")
    return int(match.group(1))


def check_objective_metric(metric: str) -> None:
    """Refuse a metric a tuner may not read: anything but a validation metric (``val_*``)."""
    if not isinstance(metric, str) or not metric.startswith(VALIDATION_PREFIX):
        raise ConfigError(
            f"tuning reads validation metrics only (val_acc, val_loss, val_client_acc_mean, ...), not {metric!r}; "
            "set partition.validation_fraction > 0 so runs log them"
        )


def direction(metric: str) -> Literal["maximize", "minimize"]:
    """Whether a larger value of ``metric`` is better ("maximize": accuracies) or a smaller one (losses)."""
    check_objective_metric(metric)
    return "minimize" if "loss" in metric else "maximize"


def objective(run_dir: str | Path, metric: str = "val_acc", reduce: Reduce = "last") -> float:
    """The value a tuner scores a finished (or pruned) run by: ``metric`` at the run's last evaluation
    (``reduce="last"``), its best over all evaluations (``"best"``: the largest accuracy, the smallest loss), or the
    mean of its last K evaluations (``"last3"``; all of them where it has fewer; NaN if one of them is).

    Only validation metrics (``val_*``) are read; any other, ``test_acc`` above all, is refused with one line. A
    diverged run's last value is NaN (metrics.jsonl stores it as null), and ``"best"`` skips NaN values (NaN when
    every value is). A run that logged no such metric (no validation data, or not evaluated yet) is an error naming
    the setting."""
    check_objective_metric(metric)
    window = reduce_window(reduce)
    path = Path(run_dir) / "metrics.jsonl"
    records = [r for r in read_metrics(path) if metric in r]
    if not records:
        raise ConfigError(
            f"{path} has no {metric!r}: the run logged no validation metrics yet "
            "(partition.validation_fraction > 0 makes it log them at every evaluation)"
        )
    values = [math.nan if r[metric] is None else float(r[metric]) for r in records]
    if window is not None:
        return float(sum(values[-window:]) / len(values[-window:]))
    finite = [v for v in values if not math.isnan(v)]
    if not finite:
        return math.nan
    return min(finite) if direction(metric) == "minimize" else max(finite)

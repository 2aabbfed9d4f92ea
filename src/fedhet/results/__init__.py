"""Run folders: durable metrics/JSON files, mean ± std tables over seeds, and plots."""

from fedhet.results.plots import plot_curves, plot_label_distribution
from fedhet.results.report import (
    Group,
    Row,
    Run,
    group_runs,
    load_runs,
    print_table,
    summary_table,
    to_markdown,
)
from fedhet.results.store import MetricsLog, read_json, read_metrics, truncate_after, write_json_atomic

__all__ = [
    "Group",
    "MetricsLog",
    "Row",
    "Run",
    "group_runs",
    "load_runs",
    "plot_curves",
    "plot_label_distribution",
    "print_table",
    "read_json",
    "read_metrics",
    "summary_table",
    "to_markdown",
    "truncate_after",
    "write_json_atomic",
]

"""Run folders: durable metrics/JSON files, mean ± std tables over seeds, plots and the HTML report."""

from fedhet.results.html import write_html
from fedhet.results.objective import direction, objective
from fedhet.results.plots import curves_figure, plot_curves, plot_label_distribution
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
    "curves_figure",
    "direction",
    "group_runs",
    "load_runs",
    "objective",
    "plot_curves",
    "plot_label_distribution",
    "print_table",
    "read_json",
    "read_metrics",
    "summary_table",
    "to_markdown",
    "truncate_after",
    "write_html",
    "write_json_atomic",
]

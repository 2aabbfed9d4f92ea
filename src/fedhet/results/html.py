"""`fedhet report --html`: one self-contained page (no server, no network) with the tables, curves and configs.

The page opens with the setting every row shares and the settings that tell the rows apart, then one section per
reported metric (the chosen one first, then every other metric some run recorded: METRIC_LABELS), each with its
table and curves, reached from the metric links at the top; then each run's config. Rows, legends and colours are
the same as in `fedhet report` and `compare` (one order; a swatch beside each row's name in its curve's colour).
The curves are PNGs embedded as data URIs and the styles are inline, so the file can be mailed or opened from disk
and shows the same everywhere.
"""

from __future__ import annotations

import base64
import io
import json
from datetime import datetime, timezone
from html import escape
from pathlib import Path

from fedhet.results.plots import METRIC_LABELS, colour_hex, curves_figure, row_styles
from fedhet.results.report import (
    AUTO,
    Group,
    Row,
    differing_keys,
    fmt,
    format_value,
    global_model_note,
    marked,
    partition_note,
    rank_table,
    rank_title,
    stat_cells,
    stats_notes,
    summary_table,
    table_cells,
)
from fedhet.results.store import to_json

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1400px; color: #222; padding: 0 1em; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 0.9em; }
th, td { padding: 0.3em 0.7em; border-bottom: 1px solid #e4e4e4; white-space: nowrap; }
th { background: #f3f3f3; text-align: right; white-space: normal; vertical-align: bottom; }
.wide { overflow-x: auto; } td { text-align: right; font-variant-numeric: tabular-nums; }
th:first-child, td:first-child { text-align: left; }
tbody tr:hover { background: #f7f9ff; }
img { max-width: 100%; } .note { color: #555; } .meta { color: #777; font-size: 0.85em; }
details { margin: 0.3em 0; } summary { cursor: pointer; }
nav a { margin-right: 0.8em; } .swatch { display: inline-block; width: 0.9em; height: 0.9em; margin-right: 0.4em;
  vertical-align: -0.1em; border-radius: 2px; } td.key { text-align: left; color: #444; }
td.wrap { white-space: normal; }
pre { background: #f7f7f7; padding: 0.8em; overflow-x: auto; font-size: 0.8em; }
"""


def write_html(
    groups: list[Group],
    path: str | Path,
    metrics: tuple[str, ...] = ("test_acc",),
    smooth: bool = False,
    panels: str | None = None,
    every_metric: bool = True,
    x: str = "round",
    baseline: str = AUTO,
) -> Path:
    """The report page for `groups`: the shared setting and what tells the rows apart; for each metric (`metrics`,
    then with ``every_metric`` each other metric of METRIC_LABELS that some run recorded) a mean ± std table with
    the statistics columns against ``baseline`` (report.summary_table), its legend and its curves (against ``x``:
    "round" or "sim/time"); then each run's config."""
    from fedhet.paths import check_output_file

    check_output_file(path, "HTML report")  # before the work: a folder, FIFO or dangling link there is refused
    shown = reported_metrics(groups, metrics) if every_metric else list(metrics)
    # every table first: a bad baseline fails before anything is drawn
    tables = {metric: summary_table(groups, metric=metric, baseline=baseline) for metric in shown}
    swatches = {label: colour_hex(style.colour) for label, style in row_styles(groups, panels).items()}
    sections = [f"<h1>fedhet report</h1><p class='meta'>{len(groups)} groups, {sum(len(g.runs) for g in groups)} "
                f"runs; written {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}</p>"]  # fmt: skip
    links = " ".join(f"<a href='#{anchor(m)}'>{escape(m)}</a>" for m in shown)
    sections.append(f"<nav>metrics: {links} <a href='#runs'>runs</a></nav>")
    sections.append(settings_summary(groups, swatches))
    note = partition_note(groups)
    for i, metric in enumerate(shown):
        sections.append(
            f"<h2 id='{anchor(metric)}'>{escape(METRIC_LABELS.get(metric, metric))} ({escape(metric)})</h2>"
        )
        # the chosen metric's table has every column (the global model's among them); the others' the columns that
        # depend on the metric
        rows = tables[metric]
        sections.append(html_table(rows, swatches) if i == 0 else metric_table(rows, swatches))
        ranks = rank_table(rows)
        if ranks is not None:
            sections.append(f"<p class='note'>{escape(rank_title(rows))}:</p>")
            sections.append(table_html(*ranks, {}))
        marks = global_model_note(rows, None if i == 0 else metric)
        for line in [text for text in (marks, note) if text] + stats_notes(rows):
            sections.append(f"<p class='note'>{escape(line)}</p>")
        sections.append(curves_image(groups, metric, smooth, panels, x))
    sections.append("<h2 id='runs'>runs</h2>")
    sections += [run_details(group) for group in groups]
    page = (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'><title>fedhet report</title>"
        f"<style>{STYLE}</style></head><body>\n" + "\n".join(sections) + "\n</body></html>\n"
    )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    return path


def reported_metrics(groups: list[Group], metrics: tuple[str, ...] | list[str]) -> list[str]:
    """`metrics`, then every other metric of METRIC_LABELS (in its order) that some run recorded."""
    recorded = {key for group in groups for run in group.runs for record in run.metrics for key in record}
    return list(dict.fromkeys([*metrics, *(m for m in METRIC_LABELS if m in recorded)]))


def anchor(metric: str) -> str:
    return "metric-" + "".join(c if c.isalnum() or c in "-_" else "-" for c in metric)


def label_cell(label: str, swatches: dict[str, str]) -> str:
    colour = swatches.get(label)
    swatch = f"<span class='swatch' style='background:{colour}'></span>" if colour else ""
    return f"<td>{swatch}{escape(label)}</td>"


def table_html(header: list[str], cells: list[list[str]], swatches: dict[str, str]) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + label_cell(line[0], swatches) + "".join(f"<td>{escape(c)}</td>" for c in line[1:]) + "</tr>"
        for line in cells
    )
    return f"<div class='wide'><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>"


def html_table(rows: list[Row], swatches: dict[str, str] | None = None) -> str:
    header, cells = table_cells(rows)
    return table_html(header, cells, swatches or {})


def metric_table(rows: list[Row], swatches: dict[str, str]) -> str:
    """Final (mean ± std, then the statistics columns) and best of one metric, a row per group in the main table's
    order."""
    metric = rows[0].metric if rows else "test_acc"
    stats_header, stats = stat_cells(rows)
    header = ["run", "seeds", f"final {metric}", *stats_header, f"best {metric}"]
    cells = [
        [r.label, str(r.seeds), marked(fmt(r.final_mean, r.final_std, metric=metric), r, metric), *extra]
        + [marked(fmt(r.best_mean, r.best_std, metric=metric), r, metric)]
        for r, extra in zip(rows, stats, strict=True)
    ]
    return table_html(header, cells, swatches)


def settings_summary(groups: list[Group], swatches: dict[str, str]) -> str:
    """The setting every group shares (section by section), and a table of the settings that differ per row."""
    settings = [g.settings for g in groups]
    differ = set(differing_keys(settings, presence_counts=True)) | {
        k
        for k in ("algorithm.name", "server.name", "server.aggregation")
        if len({json_value(s.get(k)) for s in settings}) > 1
    }
    shared = (
        {k: v for k, v in settings[0].items() if k not in differ and all(k in s for s in settings)} if settings else {}
    )
    sections: dict[str, list[str]] = {}
    for key, value in shared.items():
        section, _, name = key.partition(".")
        sections.setdefault(section, []).append(f"{name}={format_value(value)}")
    lines = "".join(
        f"<tr><td class='key'>{escape(section)}</td><td class='key wrap'>{escape(', '.join(items))}</td></tr>"
        for section, items in sections.items()
    )
    out = ["<h2 id='setting'>setting</h2>"]
    if lines:
        out.append(
            f"<p class='note'>Shared by every row:</p><div class='wide'><table><tbody>{lines}</tbody></table></div>"
        )
    keys = [k for k in dict.fromkeys(k for s in settings for k in s) if k in differ]
    if keys:
        cells = [[g.label, *(format_value(g.settings[k]) if k in g.settings else "—" for k in keys)] for g in groups]
        out.append("<p class='note'>Different between rows:</p>")
        out.append(table_html(["run", *keys], cells, swatches))
    return "\n".join(out)


def json_value(value: object) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def curves_image(groups: list[Group], metric: str, smooth: bool, panels: str | None, x: str = "round") -> str:
    """The curves as an embedded PNG, or a note when no run recorded the metric (with ``x``)."""
    wanted = [metric] if x == "round" else [metric, x]
    if not any(all(run.values(m) for m in wanted) for group in groups for run in group.runs):
        return f"<p class='note'>no run recorded {escape(' and '.join(wanted))}: no curves</p>"
    fig = curves_figure(groups, metric, smooth=smooth, panels=panels, x=x)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    data = base64.b64encode(buffer.getvalue()).decode("ascii")
    return f"<img alt='{escape(metric)} vs {escape(x)}' src='data:image/png;base64,{data}'>"


def run_details(group: Group) -> str:
    """One collapsible entry per run: where it is, how far it got, and its resolved config."""
    items = []
    for run in group.runs:
        seed = run.config.get("run", {}).get("seed")
        status = run.summary.get("status", "running or killed")
        head = f"{group.label} · seed {seed} · {status}, round {run.last_round} · {run.path}"
        config = json.dumps(json.loads(to_json(run.config)), indent=2)
        items.append(f"<details><summary>{escape(head)}</summary><pre>{escape(config)}</pre></details>")
    return "\n".join(items)

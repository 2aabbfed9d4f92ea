"""`fedhet report --html`: one self-contained page (no server, no network) with the tables, curves and configs.

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

from fedhet.results.plots import curves_figure
from fedhet.results.report import Group, partition_note, summary_table, table_cells
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
pre { background: #f7f7f7; padding: 0.8em; overflow-x: auto; font-size: 0.8em; }
"""


def write_html(
    groups: list[Group],
    path: str | Path,
    metrics: tuple[str, ...] = ("test_acc",),
    smooth: bool = False,
    panels: str | None = None,
) -> Path:
    """The report page for `groups`: for each metric a mean ± std table and its curves; then each run's config."""
    from fedhet.paths import check_output_file

    check_output_file(path, "HTML report")  # before the work: a folder, FIFO or dangling link there is refused
    sections = [f"<h1>fedhet report</h1><p class='meta'>{len(groups)} groups, {sum(len(g.runs) for g in groups)} "
                f"runs; written {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}</p>"]  # fmt: skip
    note = partition_note(groups)
    for metric in metrics:
        sections.append(f"<h2>{escape(metric)}</h2>")
        sections.append(html_table(groups, metric))
        if note:
            sections.append(f"<p class='note'>{escape(note)}</p>")
        sections.append(curves_image(groups, metric, smooth, panels))
    sections.append("<h2>runs</h2>")
    sections += [run_details(group) for group in groups]
    page = (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'><title>fedhet report</title>"
        f"<style>{STYLE}</style></head><body>\n" + "\n".join(sections) + "\n</body></html>\n"
    )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    return path


def html_table(groups: list[Group], metric: str) -> str:
    header, cells = table_cells(summary_table(groups, metric=metric))
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in line) + "</tr>" for line in cells)
    return f"<div class='wide'><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>"


def curves_image(groups: list[Group], metric: str, smooth: bool, panels: str | None) -> str:
    """The curves as an embedded PNG, or a note when no run recorded the metric."""
    if not any(run.values(metric) for group in groups for run in group.runs):
        return f"<p class='note'>no run recorded {escape(metric)}: no curves</p>"
    fig = curves_figure(groups, metric, smooth=smooth, panels=panels)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    data = base64.b64encode(buffer.getvalue()).decode("ascii")
    return f"<img alt='{escape(metric)} vs round' src='data:image/png;base64,{data}'>"


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

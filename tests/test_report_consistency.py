"""Tables, plots and the HTML page agree (issue 27): ± on every measured column wherever there are seeds and none
on counts, one row order in compare and report, one colour per method in every figure, a summary of the shared
setting and one section per reported metric in the HTML page."""

from __future__ import annotations

import re

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_hex
from rich.console import Console

from fedhet.comparison import tabulate
from fedhet.results import MetricsLog, group_runs, load_runs, summary_table, to_markdown, write_json_atomic
from fedhet.results.html import write_html
from fedhet.results.plots import curves_figure


def make_run(root, rel, algorithm, seed, alpha, accs, **metrics):
    folder = root / rel
    folder.mkdir(parents=True)
    config = {
        "run": {"name": folder.name, "seed": seed, "rounds": len(accs), "out_dir": str(folder.parent)},
        "dataset": {"name": "digits"},
        "partition": {"name": "dirichlet", "alpha": alpha, "num_clients": 10},
        "train": {"lr": 0.05},
        "algorithm": {"name": algorithm},
        "server": {"name": "sgd"},
    }
    write_json_atomic(folder / "config.json", config)
    log = MetricsLog(folder / "metrics.jsonl")
    for rnd, acc in enumerate(accs, start=1):
        extra = {k: v[rnd - 1] for k, v in metrics.items()}
        log.append({"round": rnd, "test_acc": acc, "test_loss": 2 - acc, "train_loss": 2.1 - acc, **extra})
    write_json_atomic(folder / "summary.json", {"status": "finished", "rounds_done": len(accs)})
    return folder


# a comparison's variants, in the order a user listed them (personalised first, FedAvg last)
VARIANTS = ("ditto", "fedprox", "fedavg")
ALPHAS = (10.0, 0.5)  # numbers: 0.5 sorts before 10, whatever the text order


@pytest.fixture
def cells(tmp_path):
    """compare's cells, in compare's order (grid point, seed, variant), and the folder they are in."""
    root = tmp_path / "cmp"
    dirs = []
    for alpha in ALPHAS:
        for seed in (0, 1):
            for i, variant in enumerate(VARIANTS):
                accs = [0.3, 0.5 + 0.05 * i + 0.01 * seed + alpha / 100]
                extra = {}
                if variant == "ditto":
                    extra = {"personal_acc_macro": [0.4, 0.7 + 0.02 * seed], "personal_never_sampled": [3, seed]}
                extra["client_acc_worst10"] = [0.1, 0.2 + 0.02 * seed]
                dirs.append(make_run(root, f"alpha{alpha:g}/{variant}-s{seed}", variant, seed, alpha, accs, **extra))
    return root, dirs


def test_every_measured_column_has_a_std_with_seeds_and_counts_show_a_range(cells):
    root, _ = cells
    markdown = to_markdown(summary_table(group_runs(load_runs([root]))))
    header, _, *lines = markdown.strip().splitlines()
    names = [c.strip() for c in header.strip("|").split("|")]
    for line in lines:
        row = dict(zip(names, (c.strip() for c in line.strip("|").split("|")), strict=True))
        assert row["seeds"] == "2"
        for column in ("final test_acc", "best test_acc", "worst-10% acc"):
            assert " ± " in row[column], (column, row)
        if row["run"].startswith("ditto"):
            assert " ± " in row["personal acc (macro)"]
            assert row["never sampled"] == "0–1"  # the seeds' counts, never "0 ± 0" or "0.5 ± 0.7"
        else:
            assert row["personal acc (macro)"] == row["never sampled"] == "—"


def test_one_seed_shows_no_std_and_a_count_that_agrees_shows_one_number(tmp_path):
    make_run(tmp_path, "d", "ditto", 0, 0.5, [0.4, 0.6], personal_never_sampled=[2, 0], client_acc_worst10=[0.1, 0.2])
    make_run(tmp_path, "d1", "ditto", 1, 0.5, [0.4, 0.7], personal_never_sampled=[2, 0], client_acc_worst10=[0.1, 0.3])
    [row] = summary_table(group_runs(load_runs([tmp_path / "d"])))
    assert row.best_std is None and "±" not in to_markdown([row])
    [row] = summary_table(group_runs(load_runs([tmp_path])))
    assert row.extras["personal_never_sampled"] == (0, 0) and "| 0 |" in to_markdown([row])
    assert row.client_acc_worst10_std == pytest.approx(0.0707, abs=1e-4) and "25.00 ± 7.07" in to_markdown([row])


def test_compare_and_report_list_the_rows_in_one_order(cells, tmp_path):
    root, dirs = cells
    from_compare = [g.label for g in group_runs(load_runs(dirs))]  # compare loads its cells in plan order
    from_report = [g.label for g in group_runs(load_runs([root]))]  # report finds them by folder name
    assert from_compare == from_report
    # by setting (numbers by value), then method family: FedAvg first, personalised methods last
    assert from_report == [f"{m} alpha={a:g}" for a in (0.5, 10) for m in ("fedavg", "fedprox", "ditto")]
    # the files compare writes hold the rows in the report's order too
    tabulate(dirs, tmp_path, Console(quiet=True), show=False)
    table = (tmp_path / "comparison.md").read_text().split("\n\n")[0]  # the main table; the rank table follows
    assert [line.split("|")[1].strip() for line in table.splitlines()[2:] if line.startswith("|")] == from_report


def legend_colours(fig):
    FigureCanvasAgg(fig).draw()
    (legend,) = fig.legends
    pairs = zip(legend.get_texts(), legend.legend_handles, strict=True)
    return {text.get_text().rsplit(" (n=", 1)[0]: to_hex(handle.get_color()) for text, handle in pairs}


def test_a_method_keeps_its_colour_and_rows_sharing_an_axes_get_their_own(cells):
    root, dirs = cells
    groups = group_runs(load_runs(dirs))
    alpha = [g for g in groups if g.settings["partition.alpha"] == 0.5]  # one setting: one line per method
    plain = legend_colours(curves_figure(alpha))
    family = legend_colours(curves_figure(alpha, panels="family"))
    assert plain == family and len(set(plain.values())) == 3
    by_setting = legend_colours(curves_figure(groups, panels="setting"))  # legend: one entry per method
    for method in ("fedavg", "fedprox", "ditto"):
        assert by_setting[method] == plain[f"{method} alpha=0.5"]
    # both settings in one axes: six rows, six colours, so neither curves nor bands nor swatches look alike
    everything = legend_colours(curves_figure(groups))
    assert len(set(everything.values())) == len(groups) == 6
    from fedhet.results.plots import row_styles  # what the HTML swatches use

    styles = row_styles(groups)
    assert {label: to_hex(style.colour) for label, style in styles.items()} == everything
    assert {label: to_hex(style.colour) for label, style in row_styles(alpha).items()} == plain


def test_each_band_is_outlined_in_its_curves_colour(cells):
    """Overlapping ± bands stay apart: a faint fill, and edges in the curve's colour and dashes."""
    _, dirs = cells
    fig = curves_figure(group_runs(load_runs(dirs)))
    FigureCanvasAgg(fig).draw()
    (ax,) = fig.axes
    bands = [c for c in ax.collections if len(c.get_paths())]
    assert len(bands) == len(ax.lines) == 6
    for line, band in zip(ax.lines, bands, strict=True):
        (edge,), (face,) = band.get_edgecolor(), band.get_facecolor()
        assert to_hex(edge) == to_hex(face) == to_hex(line.get_color())
        assert face[3] <= 0.15 < edge[3]


def test_the_html_page_summarises_the_setting_and_shows_every_reported_metric(cells, tmp_path):
    root, _ = cells
    groups = group_runs(load_runs([root]))
    page = write_html(groups, tmp_path / "report.html").read_text()
    # the setting every row shares, section by section, and what differs per row
    assert "Shared by every row" in page and "name=digits" in page and "lr=0.05" in page
    assert "Different between rows" in page and "partition.alpha" in page and "algorithm.name" in page
    # one section per metric some run recorded, reached from the links at the top
    for metric in ("test_acc", "test_loss", "train_loss", "client_acc_worst10", "personal_acc_macro"):
        assert f"<h2 id='metric-{metric}'>" in page and f"href='#metric-{metric}'" in page
    assert page.count("data:image/png;base64,") == 5
    assert "client_dist_acc" not in re.findall(r"<h2 id='metric-([^']+)'>", page)  # no run recorded it
    # each table lists the rows in the report's order, each name with its curve's colour, every row its own
    labels = [g.label for g in groups]
    first = page.split("<h2 id='metric-test_acc'>", 1)[1].split("</table>", 1)[0]
    assert re.findall(r"</span>([^<]+)</td>", first) == labels
    legend = legend_colours(curves_figure(groups))
    for label in labels:
        assert f"background:{legend[label]}'></span>{label}<" in first
    assert len(set(re.findall(r"background:(#[0-9a-f]{6})", first))) == len(labels)
    # ± in every table of a metric
    for metric in ("test_loss", "train_loss"):
        section = page.split(f"<h2 id='metric-{metric}'>", 1)[1].split("</table>", 1)[0]
        assert section.count(" ± ") == 2 * len(labels)  # final and best


def test_the_html_page_can_keep_to_the_chosen_metrics(cells, tmp_path):
    root, _ = cells
    groups = group_runs(load_runs([root]))
    page = write_html(groups, tmp_path / "report.html", metrics=("test_loss",), every_metric=False).read_text()
    assert re.findall(r"<h2 id='metric-([^']+)'>", page) == ["test_loss"]

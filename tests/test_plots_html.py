"""Curves that stay readable with 20 methods, and the self-contained HTML report (issue 16)."""

import re

import numpy as np
import pytest
from browser import MISSING, browser, headless
from matplotlib.backends.backend_agg import FigureCanvasAgg
from PIL import Image

from fedhet.errors import FedhetError
from fedhet.results import MetricsLog, group_runs, load_runs, write_json_atomic
from fedhet.results.html import write_html
from fedhet.results.plots import FAMILIES, curves_figure, family, pair, seed_curve

METHODS = [m for members in FAMILIES.values() for m in members][:20]


def make_run(root, algorithm, seed, accs, alpha=0.1, ema=0.9):
    folder = root / f"alpha{alpha}" / f"{algorithm}-s{seed}"
    folder.mkdir(parents=True)
    config = {
        "run": {"name": folder.name, "seed": seed, "out_dir": str(folder.parent), "ema": ema},
        "partition": {"name": "dirichlet", "alpha": alpha},
        "algorithm": {"name": algorithm},
    }
    write_json_atomic(folder / "config.json", config)
    log = MetricsLog(folder / "metrics.jsonl")
    smoothed = None
    for rnd, acc in enumerate(accs, start=1):
        smoothed = acc if smoothed is None else ema * smoothed + (1 - ema) * acc
        log.append({"round": rnd, "test_acc": acc, "test_acc_ema": smoothed, "train_loss": 2.0 - acc})
    write_json_atomic(folder / "summary.json", {"status": "finished", "rounds_done": len(accs)})
    return folder


@pytest.fixture
def twenty(tmp_path):
    """20 methods x 2 seeds x 2 settings with noisy, overlapping curves."""
    rng = np.random.default_rng(0)
    for alpha in (0.1, 0.5):
        for i, method in enumerate(METHODS):
            for seed in (0, 1):
                accs = 0.3 + 0.4 * (1 - np.exp(-np.arange(1, 9) / (2 + i / 5))) + rng.normal(0, 0.03, 8)
                make_run(tmp_path / "runs", method, seed, accs.tolist(), alpha=alpha)
    return group_runs(load_runs([tmp_path / "runs"]))


def drawn(fig):
    FigureCanvasAgg(fig).draw()
    return fig


def test_the_first_40_groups_get_distinct_colour_and_style_pairs_and_neighbours_differ_in_both():
    pairs = [pair(i) for i in range(40)]
    assert len({(tuple(c), s) for c, s in pairs}) == 40
    for (c1, s1), (c2, s2) in zip(pairs, pairs[1:], strict=False):
        assert c1 != c2 and s1 != s2


def test_twenty_methods_each_have_a_legend_entry_outside_the_axes(twenty):
    alpha01 = [g for g in twenty if g.settings["partition.alpha"] == 0.1]
    fig = drawn(curves_figure(alpha01))
    (ax,) = [a for a in fig.axes if a.get_visible()]
    (legend,) = fig.legends
    assert len(legend.get_texts()) == 20 and all("(n=2)" in t.get_text() for t in legend.get_texts())
    renderer = fig.canvas.get_renderer()
    assert legend.get_window_extent(renderer).x0 >= ax.get_window_extent(renderer).x1  # no curve is covered
    styles = {(line.get_color(), line.get_linestyle()) for line in ax.get_lines()}
    assert len(styles) == 20
    assert len(ax.collections) == 20  # one std band per method


def test_family_panels_keep_each_methods_style_and_setting_panels_split_by_the_setting(twenty):
    alpha01 = [g for g in twenty if g.settings["partition.alpha"] == 0.1]
    fig = drawn(curves_figure(alpha01, panels="family"))
    visible = [a for a in fig.axes if a.get_visible()]
    assert {a.get_title() for a in visible} == {family(m) for m in METHODS}
    assert sum(len(a.get_lines()) for a in visible) == 20
    fig = drawn(curves_figure(twenty, panels="setting"))
    visible = [a for a in fig.axes if a.get_visible()]
    assert [a.get_title() for a in visible] == ["alpha=0.1", "alpha=0.5"]
    first, second = ([(line.get_color(), line.get_linestyle()) for line in a.get_lines()] for a in visible)
    assert first == second and len(set(first)) == 20  # a method looks the same in both panels
    assert len(fig.legends[0].get_texts()) == 20 and "alpha" not in fig.legends[0].get_texts()[0].get_text()
    assert family("some-plugin") == "other"
    with pytest.raises(FedhetError, match="unknown panels 'colour'; choose one of: family, setting"):
        curves_figure(twenty, panels="colour")


def test_smoothing_uses_the_recorded_ema_or_computes_the_same_one(tmp_path):
    make_run(tmp_path / "runs", "fedavg", 0, [0.2, 0.6, 0.4], ema=0.5)
    (group,) = group_runs(load_runs([tmp_path / "runs"]))
    _, acc, _ = seed_curve(group.runs, "test_acc", smooth=True)
    assert np.allclose(acc, [0.2, 0.4, 0.4])  # 0.5 * 0.2 + 0.5 * 0.6 = 0.4; 0.5 * 0.4 + 0.5 * 0.4 = 0.4
    _, loss, _ = seed_curve(group.runs, "train_loss", smooth=True)  # no recorded EMA: the same factor here
    assert np.allclose(loss, [1.8, 1.6, 1.6])
    _, raw, _ = seed_curve(group.runs, "train_loss")
    assert np.allclose(raw, [1.8, 1.4, 1.6])


def test_the_html_report_is_one_self_contained_page(twenty, tmp_path):
    page = write_html(twenty, tmp_path / "out" / "report.html", smooth=True, panels="setting").read_text()
    assert not re.search(r"(src|href)=['\"]?(https?:|//|file:)", page)  # nothing loaded from elsewhere
    # after the setting's summary, one section per recorded metric (test_acc, test_acc_ema, train_loss), each a
    # table with a row per group and the curves
    test_acc = page.split("<h2 id='metric-test_acc'>", 1)[1].split("</table>", 1)[0]
    assert test_acc.count("<tr>") == 1 + 40 and " ± " in test_acc  # one row per group, mean ± std over the seeds
    assert page.count("data:image/png;base64,") == 3
    assert page.count("<details>") == 80 and "&quot;alpha&quot;: 0.5" in page  # every run's config
    assert "each seed draws its own partition" in page


@pytest.mark.slow
@pytest.mark.skipif(browser() is None, reason=MISSING)
def test_the_html_report_renders_in_headless_chromium(twenty, tmp_path):
    page = write_html(twenty[:20], tmp_path / "report.html", panels="family")
    shot = tmp_path / "shot.png"
    headless(page, tmp_path / "profile", "--window-size=1280,2000", f"--screenshot={shot}")
    image = np.asarray(Image.open(shot).convert("RGB")).astype(int)
    assert image.shape[:2] == (2000, 1280)
    dark = (image.sum(axis=2) < 200).mean()  # text and table rules
    coloured = (image.max(axis=2) - image.min(axis=2) > 80).mean()  # the curves' colours
    assert 0.005 < dark < 0.5 and coloured > 0.002, (dark, coloured)
    rows_with_ink = (image.sum(axis=2) < 600).any(axis=1).mean()
    assert rows_with_ink > 0.3  # the table and the figure fill the page, not a blank or an error page


def test_fedhet_report_writes_the_html_page_and_refuses_unknown_panels(twenty, tmp_path):
    from typer.testing import CliRunner

    from fedhet.cli import app

    runner = CliRunner()
    out = tmp_path / "report.html"
    plot = tmp_path / "curves.png"
    args = ["report", str(tmp_path / "runs" / "alpha0.1"), "--html", str(out), "--plot", str(plot)]
    result = runner.invoke(app, [*args, "--smooth", "--panels", "family"])
    assert result.exit_code == 0, result.output
    assert out.read_text().count("<details>") == 40 and plot.stat().st_size > 10_000
    result = runner.invoke(app, [*args, "--panels", "colour"])
    assert result.exit_code != 0 and "choose one of: family, setting" in str(result.exception)

"""Statistics in the tables (issue 45): the 95 % t interval over seeds, the paired comparison with a baseline
(bootstrap interval, Wilcoxon p, markers) over the seeds two rows ran on one partition, and average ranks over
settings; checked against values worked by hand and against scipy called independently here."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps

from fedhet.cli import main
from fedhet.comparison import plan_comparison
from fedhet.errors import ConfigError
from fedhet.results import MetricsLog, group_runs, load_runs, summary_table, to_markdown, write_json_atomic
from fedhet.results.html import write_html
from fedhet.results.report import Run, paired_finals, report_markdown
from fedhet.results.stats import average_ranks, paired_difference, seed_summary

# ---------------------------------------------------------------------------------------------- the statistics


def test_the_t_interval_of_one_two_three_is_the_one_worked_by_hand():
    # mean 2, sample std 1, standard error 1/sqrt(3); t(0.975, df=2) = 4.302653 (tables): 2 -+ 2.484138
    summary = seed_summary([1.0, 2.0, 3.0])
    assert (summary.mean, summary.std, summary.n) == (2.0, 1.0, 3)
    assert summary.ci_low == pytest.approx(2 - 4.302653 / math.sqrt(3), abs=1e-6) == pytest.approx(-0.484138, abs=1e-6)
    assert summary.ci_high == pytest.approx(4.484138, abs=1e-6)
    mean, std, low, high, n = summary  # a tuple too, for callers that unpack it (a tuning table)
    assert (mean, std, low, high, n) == (2.0, 1.0, summary.ci_low, summary.ci_high, 3)


def test_the_t_interval_matches_scipys_t_distribution():
    values = [0.81, 0.84, 0.79, 0.86]
    expected = sps.t.interval(0.95, df=3, loc=np.mean(values), scale=sps.sem(values))
    summary = seed_summary(values)
    assert (summary.ci_low, summary.ci_high) == pytest.approx(expected, abs=1e-12)
    assert summary.std == pytest.approx(np.std(values, ddof=1))  # the sample std, n - 1


def test_a_seed_summary_needs_two_values_for_spread_and_leaves_missing_ones_out():
    assert seed_summary([]) == seed_summary([None]) and (seed_summary([]).n, seed_summary([]).mean) == (0, None)
    one = seed_summary([0.7, None])
    assert (one.mean, one.std, one.ci_low, one.n) == (0.7, None, None, 1)
    same = seed_summary([0.5, 0.5, 0.5])  # every seed agrees: the interval is the value, not NaN
    assert (same.std, same.ci_low, same.ci_high) == (0.0, 0.5, 0.5)


def test_the_paired_bootstrap_of_two_pairs_is_the_range_worked_by_hand():
    # differences 1 and 3: a resample's mean is 1, 2 or 3 with chances 1/4, 1/2, 1/4, so the 2.5th and 97.5th
    # percentiles are 1 and 3; Wilcoxon's exact two-sided p for 2 pairs of one sign is 2 / 2**2 = 0.5
    result = paired_difference([2.0, 4.0], [1.0, 1.0])
    assert (result.mean, result.ci_low, result.ci_high, result.n) == (2.0, 1.0, 3.0, 2)
    assert result.p == pytest.approx(0.5) and result.marker == "▲"


def test_the_paired_comparison_matches_scipy_called_directly():
    a = np.array([0.80, 0.85, 0.90, 0.78, 0.83])
    b = np.array([0.70, 0.86, 0.82, 0.75, 0.80])
    expected = sps.bootstrap(
        (a, b),
        lambda x, y, axis=-1: np.mean(x - y, axis=axis),
        paired=True,
        vectorized=True,
        n_resamples=9999,
        method="percentile",
        rng=np.random.default_rng(0),
    ).confidence_interval
    result = paired_difference(list(a), list(b))
    assert result.mean == pytest.approx(np.mean(a - b)) == pytest.approx(0.046)
    assert (result.ci_low, result.ci_high) == pytest.approx((expected.low, expected.high))
    # differences 0.10, -0.01, 0.08, 0.03, 0.03: ranks 5, 1, 4, 2.5, 2.5; W- = 1, so p = 2 * P(W <= 1) = 4 / 32
    assert result.p == pytest.approx(sps.wilcoxon(a, b).pvalue) == pytest.approx(0.125, abs=0.01)
    assert paired_difference(list(a), list(b)) == result  # a fixed generator: the same table every time


def test_markers_only_where_the_interval_excludes_zero():
    assert paired_difference([1.0, 2.0, 3.0], [0.0, 0.0, 0.0]).marker == "▲"
    assert paired_difference([0.0, 0.0, 0.0], [1.0, 2.0, 3.0]).marker == "▼"
    straddles = paired_difference([1.0, -1.0, 2.0, -2.0], [0.0, 0.0, 0.0, 0.0])
    assert straddles.ci_low < 0 < straddles.ci_high and straddles.marker == ""
    equal = paired_difference([0.5, 0.6], [0.5, 0.6])  # no difference at all: no test, no marker
    assert (equal.mean, equal.ci_low, equal.ci_high, equal.p, equal.marker) == (0.0, 0.0, 0.0, None, "")


def test_fewer_than_two_pairs_give_no_statistic():
    for a, b in (([], []), ([0.9], [0.1])):
        result = paired_difference(a, b)
        assert (result.mean, result.ci_low, result.ci_high, result.p, result.marker) == (None, None, None, None, "")
        assert result.n == len(a)
    with pytest.raises(ValueError, match="as many values"):
        paired_difference([1.0, 2.0], [1.0])


def test_average_ranks_average_ties_and_skip_missing_settings():
    table = {"s1": {"a": 0.8, "b": 0.9, "c": 0.8}, "s2": {"a": 0.7, "b": 0.6}}
    ranks, average = average_ranks(table)
    assert ranks == {"s1": {"a": 2.5, "b": 1.0, "c": 2.5}, "s2": {"a": 1.0, "b": 2.0}}
    assert average == {"a": 1.75, "b": 1.5, "c": 2.5}  # c ran in one setting only
    # lower is better: s1 a = c = 1.5, b = 3; s2 b = 1, a = 2
    assert average_ranks(table, lower_is_better=True)[1] == {"a": 1.75, "b": 2.0, "c": 1.5}
    assert average_ranks({"s": {"a": float("nan"), "b": 0.3}})[0] == {"s": {"b": 1.0}}


# ---------------------------------------------------------------------------------------------- in the tables


def make_run(root: Path, rel: str, algorithm: str, seed: int, final: float, alpha: float = 0.5, **partition):
    folder = root / rel
    folder.mkdir(parents=True)
    config = {
        "run": {"name": folder.name, "seed": seed, "rounds": 2, "out_dir": str(folder.parent)},
        "dataset": {"name": "digits"},
        "partition": {"name": "dirichlet", "alpha": alpha, "num_clients": 10, **partition},
        "algorithm": {"name": algorithm},
        "server": {"name": "sgd"},
    }
    write_json_atomic(folder / "config.json", config)
    log = MetricsLog(folder / "metrics.jsonl")
    for rnd, acc in ((1, 0.1), (2, final)):
        log.append({"round": rnd, "test_acc": acc})
    return folder


FEDAVG = {0: 0.70, 1: 0.72, 2: 0.74}


def runs_with_seeds(root: Path, finals: dict[str, dict[int, float]], **kw) -> None:
    for algorithm, by_seed in finals.items():
        for seed, final in by_seed.items():
            make_run(root, f"{algorithm}-s{seed}", algorithm, seed, final, **kw)


def markdown_rows(markdown: str) -> dict[str, dict[str, str]]:
    header, _, *lines = markdown.split("\n\n")[0].strip().splitlines()
    names = [c.strip() for c in header.strip("|").split("|")]
    rows = [dict(zip(names, (c.strip() for c in line.strip("|").split("|")), strict=True)) for line in lines]
    return {row["run"]: row for row in rows}


def test_rows_pair_with_the_baseline_by_seed_and_unpaired_seeds_are_left_out(tmp_path):
    # fedprox ran seeds 0, 1 and 3: seed 3 has no fedavg partner and fedavg's seed 2 none in fedprox
    runs_with_seeds(tmp_path, {"fedavg": FEDAVG, "fedprox": {0: 0.75, 1: 0.78, 3: 0.99}})
    rows = {r.label: r for r in summary_table(group_runs(load_runs([tmp_path])))}
    prox = rows["fedprox"]
    assert prox.versus.n == 2 and prox.unpaired == 2
    assert prox.versus == paired_difference([0.75, 0.78], [0.70, 0.72])  # seeds 0 and 1 only
    assert prox.versus.mean == pytest.approx(0.055)
    table = markdown_rows(to_markdown(list(rows.values())))
    assert table["fedavg"]["Δ vs fedavg"] == "baseline"
    assert table["fedprox"]["Δ vs fedavg"] == "+5.50 [+5.00, +6.00] ▲" and table["fedprox"]["pairs"] == "2"
    assert table["fedprox"]["p (Wilcoxon)"] == "0.5"


def test_runs_on_different_partitions_never_pair():
    def run(algorithm: str, seed: int, partition_seed: int | None, final: float) -> Run:
        config = {"run": {"seed": seed}, "partition": {"seed": partition_seed}, "algorithm": {"name": algorithm}}
        return Run(Path(algorithm), config, [{"round": 1, "test_acc": final}])

    mine = [run("fedprox", 0, 0, 0.8), run("fedprox", 1, 0, 0.9)]  # one fixed partition (seed 0)
    theirs = [run("fedavg", 0, None, 0.7), run("fedavg", 1, None, 0.7)]  # one partition per seed
    assert paired_finals(mine, theirs, "test_acc") == ([0.8], [0.7], 2)  # seed 1 trained on partitions 0 and 1
    twice = [*mine, run("fedprox", 1, 0, 0.95)]  # seed 1 twice: which run pairs is unknowable, so neither
    assert paired_finals(twice, mine, "test_acc") == ([0.8], [0.8], 3)


def test_one_pair_says_n_a_and_a_straddling_interval_has_no_marker(tmp_path):
    runs_with_seeds(
        tmp_path,
        {"fedavg": FEDAVG, "fedprox": {0: 0.71, 1: 0.70, 2: 0.76}, "scaffold": {0: 0.60, 1: 0.61, 2: 0.62}},
    )
    make_run(tmp_path, "fednova-s0", "fednova", 0, 0.9)
    table = markdown_rows(to_markdown(summary_table(group_runs(load_runs([tmp_path])))))
    assert table["fednova"]["Δ vs fedavg"] == table["fednova"]["p (Wilcoxon)"] == "n/a"
    assert table["fednova"]["pairs"] == "1" and table["fednova"]["95% CI"] == "—"
    assert not table["fedprox"]["Δ vs fedavg"].endswith(("▲", "▼"))  # differences +1, -2, +2
    assert table["scaffold"]["Δ vs fedavg"].endswith("▼")
    assert table["fedavg"]["95% CI"] == "[67.03, 76.97]"  # 72 -+ 4.3027 * 2 / sqrt(3)


def test_markdown_and_html_carry_the_legend_and_the_rank_table(tmp_path):
    for alpha in (0.1, 1.0):
        for algorithm, shift in (("fedavg", 0.0), ("fedprox", 0.05 if alpha < 1 else -0.05)):
            for seed in (0, 1, 2):
                make_run(tmp_path, f"a{alpha}/{algorithm}-s{seed}", algorithm, seed, 0.6 + shift + seed / 100, alpha)
    groups = group_runs(load_runs([tmp_path]))
    rows = summary_table(groups)
    markdown = report_markdown(rows)
    page = write_html(groups, tmp_path / "report.html").read_text()
    for text in ("95% CI: Student t interval", "scipy.stats.ttest_1samp", "Δ vs fedavg: mean of the paired",
                 "3 pairs per row", "scipy.stats.bootstrap", "scipy.stats.wilcoxon", "▲ / ▼: the interval lies",
                 "avg rank: each method", "average rank over 2 settings"):  # fmt: skip
        assert text in markdown and text in page, text
    # fedprox is better at alpha=0.1 and worse at alpha=1: ranks 1 and 2, average 1.5, as fedavg's
    assert "| fedavg | 61.00 (2) | 61.00 (1) | 1.50 |" in markdown
    assert "| fedprox | 66.00 (1) | 56.00 (2) | 1.50 |" in markdown
    assert page.count("<th>Δ vs fedavg</th>") == 1 and page.count("<th>avg rank</th>") == 1  # test_acc's section
    assert "<td>fedavg</td><td>61.00 (2)</td><td>61.00 (1)</td><td>1.50</td>" in page


def test_without_seeds_or_a_baseline_the_table_keeps_its_columns(tmp_path):
    make_run(tmp_path, "fedavg-s0", "fedavg", 0, 0.7)
    make_run(tmp_path, "fedprox-s0", "fedprox", 0, 0.8)
    groups = group_runs(load_runs([tmp_path]))
    header = to_markdown(summary_table(groups)).splitlines()[0]
    assert header == "| run | seeds | final test_acc | best test_acc | client-dist acc | worst-10% acc | rounds |"
    assert report_markdown(summary_table(groups)) == to_markdown(summary_table(groups)) + "\n"  # nothing to explain
    # named, the baseline is shown even where it can say nothing yet
    assert markdown_rows(to_markdown(summary_table(groups, baseline="fedavg")))["fedprox"]["Δ vs fedavg"] == "n/a"


def test_a_baseline_compares_rows_of_its_own_setting_and_none_switches_it_off(tmp_path):
    for alpha in (0.1, 1.0):
        runs_with_seeds(tmp_path / f"a{alpha}", {"fedavg": FEDAVG, "fedprox": {0: 0.8, 1: 0.81}}, alpha=alpha)
    runs_with_seeds(tmp_path / "a5", {"fedprox": {0: 0.8, 1: 0.81}}, alpha=5.0)  # no fedavg at alpha=5
    groups = group_runs(load_runs([tmp_path]))
    table = markdown_rows(to_markdown(summary_table(groups)))
    assert table["fedprox alpha=0.1"]["Δ vs fedavg"].startswith("+9.50 ")  # (0.8 - 0.7 + 0.81 - 0.72) / 2
    assert table["fedprox alpha=1"]["Δ vs fedavg"].startswith("+9.50 ")
    assert table["fedprox alpha=5"]["Δ vs fedavg"] == "—"
    by_prox = markdown_rows(to_markdown(summary_table(groups, baseline="fedprox")))
    assert by_prox["fedavg alpha=0.1"]["Δ vs fedprox"].startswith("-9.50 ")
    assert "Δ vs" not in to_markdown(summary_table(groups, baseline="none"))
    with pytest.raises(ConfigError, match="baseline 'scaffold' is not a method of these runs; choose one of: fedavg, "):
        summary_table(groups, baseline="scaffold")


def test_a_baseline_that_is_two_rows_is_refused_by_name_and_dropped_by_default(tmp_path):
    runs_with_seeds(tmp_path / "old", {"fedavg": FEDAVG, "fedprox": {0: 0.8, 1: 0.81}})
    # the same method with an option the older runs lack: two rows that the method alone does not tell apart
    for seed, final in FEDAVG.items():
        folder = make_run(tmp_path / "new", f"fedavg-s{seed}", "fedavg", seed, final + 0.01)
        config = json.loads((folder / "config.json").read_text())
        write_json_atomic(folder / "config.json", {**config, "run": {**config["run"], "ema": 0.5}})
    groups = group_runs(load_runs([tmp_path]))
    assert [g.label for g in groups] == ["fedavg", "fedavg ema=0.5", "fedprox"]
    assert "Δ vs" not in to_markdown(summary_table(groups))  # the default cannot tell which: no comparison
    with pytest.raises(ConfigError, match=r"baseline 'fedavg' is two rows of one setting \(fedavg; fedavg ema=0.5\)"):
        summary_table(groups, baseline="fedavg")
    assert "Δ vs fedprox" in to_markdown(summary_table(groups, baseline="fedprox"))


def fedhet(monkeypatch, capsys, *args) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["fedhet", *map(str, args)])
    with pytest.raises(SystemExit) as info:
        main()
    out, err = capsys.readouterr()
    return info.value.code, out, err


def test_fedhet_report_takes_a_baseline_and_refuses_an_unknown_one_in_one_line(tmp_path, monkeypatch, capsys):
    runs_with_seeds(tmp_path / "runs", {"fedavg": FEDAVG, "fedprox": {0: 0.75, 1: 0.78, 2: 0.8}})
    markdown = tmp_path / "table.md"
    code, out, _ = fedhet(monkeypatch, capsys, "report", tmp_path / "runs", "--markdown", markdown)
    assert code == 0 and "Δ vs fedavg" in out and "scipy.stats.wilcoxon" in out
    assert "scipy.stats.bootstrap" in markdown.read_text()
    code, out, _ = fedhet(monkeypatch, capsys, "report", tmp_path / "runs", "--baseline", "fedprox")
    assert code == 0 and "Δ vs fedprox" in out
    code, _, err = fedhet(monkeypatch, capsys, "report", tmp_path / "runs", "--baseline", "fedsgd")
    assert code != 0 and "Traceback" not in err
    choices = "fedavg, fedprox, auto, none"
    assert err.strip() == f"error: baseline 'fedsgd' is not a method of these runs; choose one of: {choices}"


SETTING = """
[run]
rounds = 1
progress = false
[dataset]
name = "digits"
[partition]
num_clients = 4
"""


def test_compare_checks_its_baseline_before_any_cell_trains(tmp_path):
    path = tmp_path / "cmp.toml"
    path.write_text(SETTING + '[compare]\nvariants = ["fedavg", "fedprox"]\nbaseline = "fedprox"\n')
    assert plan_comparison(path, []).baseline == "fedprox"
    assert plan_comparison(path, [], baseline="none").baseline == "none"  # the flag over the config
    with pytest.raises(ConfigError, match="--baseline 'scaffold' is not a variant of this comparison; choose one of: "
                                          "fedavg, fedprox, auto, none"):  # fmt: skip
        plan_comparison(path, [], baseline="scaffold")


def test_fedhet_compare_refuses_an_unknown_baseline_in_one_line(tmp_path, monkeypatch, capsys):
    args = ["compare", "-d", "digits", "-v", "fedavg,fedprox", "-o", tmp_path, "--dry-run", "--baseline", "fedsgd"]
    code, _, err = fedhet(monkeypatch, capsys, *args)
    assert code != 0 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "--baseline 'fedsgd' is not a variant of this comparison; choose one of: fedavg, fedprox, auto, none" in err
    assert not (tmp_path / "comparison.md").exists()


def test_values_a_tuner_chose_are_the_methods_so_tuned_rows_share_a_setting_and_pair(tmp_path):
    """compare --tune runs each variant with its own chosen train.lr: that is part of the method (its label shows
    it), not another setting, so fedprox still pairs with fedavg and no rank table splits them."""
    for algorithm, lr, finals in (("fedavg", 0.02, FEDAVG), ("fedprox", 0.1, {0: 0.74, 1: 0.75, 2: 0.79})):
        for seed, final in finals.items():
            folder = make_run(tmp_path, f"{algorithm}-s{seed}", algorithm, seed, final)
            config = json.loads((folder / "config.json").read_text())
            config["train"] = {"lr": lr}
            write_json_atomic(folder / "config.json", config)
            write_json_atomic(folder / "provenance.json", {"tuning": {"tuned": True, "params": {"train.lr": lr}}})
    rows = summary_table(group_runs(load_runs([tmp_path])), baseline="fedavg")
    assert [r.label for r in rows] == ["fedavg lr=0.02", "fedprox lr=0.1"]
    assert [r.method for r in rows] == ["fedavg", "fedprox"] and {r.setting for r in rows} == {"all"}
    assert rows[1].versus is not None and rows[1].versus.n == 3
    assert math.isclose(rows[1].versus.mean, (0.04 + 0.03 + 0.05) / 3)
    assert "average rank" not in report_markdown(rows)  # one setting: no rank table

    for folder in tmp_path.iterdir():  # the same runs without the tuner's record: two settings, nothing to pair
        (folder / "provenance.json").unlink()
    rows = summary_table(group_runs(load_runs([tmp_path])), baseline="auto")
    assert {r.setting for r in rows} == {"lr=0.02", "lr=0.1"} and all(r.versus is None for r in rows)

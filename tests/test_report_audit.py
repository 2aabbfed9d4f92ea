"""What `fedhet report` shows a reader: an unrecorded --metric is an error listing the recorded ones; per-domain
accuracies appear as columns; the global-model cells of methods without a global model (FedBN) are marked and
explained under the table, in text, Markdown and HTML."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from fedhet import api
from fedhet.cli import app
from fedhet.errors import ConfigError
from fedhet.results.html import write_html
from fedhet.results.report import GLOBAL_MARK, group_runs, load_runs, summary_table, table_cells
from fedhet.results.store import MetricsLog, write_json_atomic

runner = CliRunner()
WIDE = {"COLUMNS": "300"}


def make_run(root, name, algorithm="fedavg", seed=0, records=({"test_acc": 0.5},)):
    """A run folder whose metrics.jsonl holds ``records`` (round 1, 2, ...)."""
    folder = root / name
    config = {
        "run": {"name": name, "seed": seed, "rounds": len(records), "out_dir": str(root)},
        "dataset": {"name": "digits"},
        "algorithm": {"name": algorithm},
    }
    write_json_atomic(folder / "config.json", config)
    (folder / "metrics.jsonl").touch()
    log = MetricsLog(folder / "metrics.jsonl")
    for rnd, record in enumerate(records, start=1):
        log.append({"round": rnd, **record})
    return folder


# ---------------------------------------------------------------------------------------------------- --metric
def test_a_metric_no_run_recorded_is_one_line_listing_the_recorded_ones(tmp_path):
    make_run(tmp_path, "a", records=[{"test_acc": 0.5, "test_loss": 1.2, "client_dist_acc": 0.4}])
    result = runner.invoke(app, ["report", str(tmp_path), "--metric", "test_accc"])
    assert isinstance(result.exception, ConfigError), result.output
    message = str(result.exception)
    assert message == "no run recorded the metric 'test_accc'; the runs recorded: test_acc, test_loss, client_dist_acc"
    with pytest.raises(ConfigError, match="the runs recorded: test_acc, test_loss"):
        api.report(tmp_path, metric="nope")
    # a metric that some run recorded is tabulated, and a run with no record yet refuses nothing
    assert runner.invoke(app, ["report", str(tmp_path), "--metric", "test_loss"]).exit_code == 0
    make_run(tmp_path / "fresh", "b", records=[])
    assert runner.invoke(app, ["report", str(tmp_path / "fresh"), "--metric", "anything"]).exit_code == 0


# ---------------------------------------------------------------------------------------------------- domains
def test_per_domain_accuracies_and_the_worst_domain_are_columns(tmp_path):
    domains = {"test_acc/domain/0": 0.9, "test_acc/domain/90": 0.6, "test_acc/domain/worst": 0.6}
    for seed, shift in ((0, 0.0), (1, 0.1)):
        make_run(
            tmp_path,
            f"rot-s{seed}",
            seed=seed,
            records=[{"test_acc": 0.7, **{k: v - shift for k, v in domains.items()}}],
        )
    make_run(tmp_path, "plain", algorithm="fedprox", records=[{"test_acc": 0.8}])
    header, cells = table_cells(summary_table(group_runs(load_runs([tmp_path]))))
    at = header.index("acc domain 0")
    assert header[at : at + 3] == ["acc domain 0", "acc domain 90", "worst domain acc"]
    fedavg, fedprox = (dict(zip(header, line, strict=True)) for line in cells)
    assert fedavg["acc domain 90"] == "55.00 ± 7.07" and fedavg["worst domain acc"] == "55.00 ± 7.07"
    assert fedprox["worst domain acc"] == "—"
    result = runner.invoke(app, ["report", str(tmp_path), "--markdown", str(tmp_path / "t.md")], env=WIDE)
    assert result.exit_code == 0, result.output
    assert "worst domain acc" in result.output and "acc domain 90" in result.output
    assert "| worst domain acc |" in (tmp_path / "t.md").read_text()


# ---------------------------------------------------------------------------------------------------- FedBN
def test_fedbn_global_model_cells_are_marked_and_explained(tmp_path):
    make_run(tmp_path, "avg", records=[{"test_acc": 0.8, "client_dist_acc": 0.7, "client_acc_worst10": 0.5}])
    make_run(
        tmp_path,
        "bn",
        algorithm="fedbn",
        records=[{"test_acc": 0.1, "client_dist_acc": 0.1, "client_acc_worst10": 0.1, "personal_acc_macro": 0.9}],
    )
    rows = summary_table(group_runs(load_runs([tmp_path])))
    header, cells = table_cells(rows)
    fedavg, fedbn = (dict(zip(header, line, strict=True)) for line in cells)
    assert fedbn["final test_acc"] == f"10.00 {GLOBAL_MARK}" and fedbn["client-dist acc"] == f"10.00 {GLOBAL_MARK}"
    assert fedbn["personal acc (macro)"] == "90.00"  # the personalised accuracy is FedBN's result: not marked
    assert GLOBAL_MARK not in "".join(fedavg.values())
    assert rows[1].no_global_model == "fedbn" and rows[0].no_global_model is None

    result = runner.invoke(
        app,
        ["report", str(tmp_path), "--markdown", str(tmp_path / "t.md"), "--html", str(tmp_path / "r.html")],
        env=WIDE,
    )
    assert result.exit_code == 0, result.output
    note = f"{GLOBAL_MARK} not a global model. fedbn: each client keeps its own BatchNorm layers"
    assert f"10.00 {GLOBAL_MARK}" in result.output and note in " ".join(result.output.split())
    markdown = (tmp_path / "t.md").read_text()
    assert f"| 10.00 {GLOBAL_MARK} |" in markdown and f"\n{note}" in markdown
    page = (tmp_path / "r.html").read_text()
    assert f"<td>10.00 {GLOBAL_MARK}</td>" in page and f"<p class='note'>{note}" in page


def test_a_report_of_methods_with_a_global_model_has_no_mark_or_footnote(tmp_path):
    make_run(tmp_path, "avg", records=[{"test_acc": 0.8}])
    groups = group_runs(load_runs([tmp_path]))
    page = write_html(groups, tmp_path / "r.html").read_text()
    assert GLOBAL_MARK not in page
    result = runner.invoke(app, ["report", str(tmp_path)], env=WIDE)
    assert result.exit_code == 0 and GLOBAL_MARK not in result.output


def test_every_method_without_a_global_model_is_a_registered_personalised_one():
    from fedhet.algorithms import ALGORITHMS
    from fedhet.results.report import NO_GLOBAL_MODEL

    for name in NO_GLOBAL_MODEL:  # each has a personalised accuracy to point the footnote at
        assert ALGORITHMS.get(name).obj.personalized, name

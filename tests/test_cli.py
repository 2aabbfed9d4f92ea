"""The command line: listing, one-line errors, run/report/partition/compare on a tiny setting."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from fedhet.cli import app
from fedhet.errors import ConfigError

runner = CliRunner()
TINY = ["-d", "digits", "-m", "mlp", "-n", "4", "-r", "2", "-s", "run.progress=false", "-s", "partition.min_size=20"]


def test_list_shows_every_registry():
    result = runner.invoke(app, ["list"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for word in ("fmnist", "dirichlet", "lenet5", "fedprox", "fedadam", "mu=0.01"):
        assert word in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-a", "fedprx"], "unknown algorithm 'fedprx'; choose one of:"),
        (["-s", "train.lrr=0.1"], "unknown key 'train.lrr'; valid keys in [train]:"),
        (["-s", "train.lr=-1"], "train.lr: Input should be greater than 0"),
        (["-s", "algorithm.name=fedprox", "-s", "algorithm.mu=-1"], "algorithm 'fedprox': mu"),
        (["-s", "partition.alpha=0"], "alpha"),
        (["-m", "resnet99"], "unknown model 'resnet99'"),
    ],
)
def test_bad_input_is_a_config_error_before_training(tmp_path, args, message):
    result = runner.invoke(app, ["run", *TINY, "-o", str(tmp_path), *args])
    assert isinstance(result.exception, ConfigError), result.output
    assert message in str(result.exception)
    assert not list(tmp_path.glob("*/metrics.jsonl"))  # nothing ran


def test_cli_prints_one_line_errors_without_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "fedhet.cli", "run", *TINY, "-o", str(tmp_path), "-a", "nope"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().startswith("error: unknown algorithm 'nope'")


def test_run_then_report(tmp_path):
    result = runner.invoke(app, ["run", *TINY, "-o", str(tmp_path), "--name", "a"])
    assert result.exit_code == 0, result.output
    assert "test_acc=" in result.output
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["rounds_done"] == 2 and summary["status"] == "finished"
    result = runner.invoke(
        app,
        ["report", str(tmp_path), "--plot", str(tmp_path / "c.png"), "--markdown", str(tmp_path / "t.md")],
        env={"COLUMNS": "200"},
    )
    assert result.exit_code == 0, result.output
    assert (tmp_path / "c.png").stat().st_size > 1000
    assert "| fedavg | 1 |" in (tmp_path / "t.md").read_text()


def test_partition_command_prints_counts_and_plots(tmp_path):
    plot = tmp_path / "split.png"
    result = runner.invoke(
        app,
        [
            "partition",
            "-d",
            "digits",
            "-n",
            "5",
            "-s",
            "partition.alpha=0.3",
            "-s",
            "partition.min_size=20",
            "--plot",
            str(plot),
        ],
        env={"COLUMNS": "200"},
    )
    assert result.exit_code == 0, result.output
    assert "clients=5 samples=" in result.output
    assert plot.stat().st_size > 1000


def test_compare_runs_variants_and_writes_table_and_plot(tmp_path):
    cfg = tmp_path / "cmp.toml"
    cfg.write_text(
        """
[run]
rounds = 2
progress = false
[dataset]
name = "digits"
[partition]
num_clients = 4
min_size = 20
[model]
name = "mlp"
[compare]
variants = ["fedavg", "fedprox", "fedavg+fedavgm"]
[compare.params.fedprox]
mu = 0.1
"""
    )
    result = runner.invoke(app, ["compare", "-c", str(cfg), "-o", str(tmp_path / "out")], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    table = (tmp_path / "out" / "comparison.md").read_text()
    for label in ("| fedavg |", "| fedprox |", "| fedavg+fedavgm |"):
        assert label in table
    assert (tmp_path / "out" / "comparison.png").exists()
    config = json.loads((tmp_path / "out" / "fedprox-s0" / "config.json").read_text())
    assert config["algorithm"] == {"name": "fedprox", "weighting": "samples", "mu": 0.1}


def test_ctrl_c_says_how_to_continue(tmp_path, monkeypatch):
    from fedhet.engine.simulation import Simulation
    from fedhet.errors import Interrupted

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(Simulation, "run", interrupted)
    result = runner.invoke(app, ["run", *TINY, "-o", str(tmp_path), "--name", "a"])
    assert isinstance(result.exception, Interrupted) and "continue with --resume" in str(result.exception)
    sets = ["dataset.name=digits", "model.name=mlp", "partition.num_clients=4", "partition.min_size=20"]
    sets = [arg for s in sets for arg in ("-s", s)]
    result = runner.invoke(app, ["compare", *sets, "-o", str(tmp_path / "c"), "-v", "fedavg", "--jobs", "1"])
    assert isinstance(result.exception, Interrupted)
    assert "run the same command again to continue" in str(result.exception)

"""The command line: listing, one-line errors, run/report/partition/compare on a tiny setting."""

from __future__ import annotations

import json
import os
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
    assert "hidden=[384, 192]" in result.output  # a default made by a factory is shown as its value
    assert "Undefined" not in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-a", "fedprx"], "unknown algorithm 'fedprx'; choose one of:"),
        (["-s", "train.lrr=0.1"], "unknown key 'train.lrr'; valid keys in [train]:"),
        (["-s", "train.lr=-1"], "train.lr: must be greater than 0 (got -1)"),
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


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.parametrize("how", ["--data-dir", "FEDHET_DATA"])
def test_a_data_location_without_the_data_is_one_error_line(tmp_path, how):
    # Even where the system copy of Fashion-MNIST is installed, an explicit location must not fall back to it.
    missing = tmp_path / "nonexistent"
    env = {k: v for k, v in os.environ.items() if k != "FEDHET_DATA"}
    args = ["partition", "-d", "fmnist"]
    if how == "--data-dir":
        args += ["--data-dir", str(missing)]
    else:
        env["FEDHET_DATA"] = str(missing)
    proc = subprocess.run(
        [sys.executable, "-m", "fedhet.cli", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    who = f"data_dir {missing}" if how == "--data-dir" else f"FEDHET_DATA={missing}"
    assert lines[0].startswith(f"error: dataset 'fmnist': {who} does not exist")
    assert "train-images-idx3-ubyte" in lines[0]
    assert not (tmp_path / "partition.png").exists()


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


def test_threads_option_sets_what_the_run_trains_with_and_records(tmp_path):
    import torch

    before = torch.get_num_threads()
    try:
        for threads, args in ((1, ["run", *TINY]), (2, ["resume", str(tmp_path / "t"), "-r", "3"])):
            if args[0] == "run":
                args += ["-o", str(tmp_path), "--name", "t"]
            result = runner.invoke(app, [*args, "--threads", str(threads)])
            assert result.exit_code == 0, result.output
            provenance = json.loads((tmp_path / "t" / "provenance.json").read_text())
            assert (provenance["resumes"] or [provenance])[-1]["torch_threads"] == threads
        assert "now train with 2" in result.output  # the resume says its sums will not match bit for bit
    finally:
        torch.set_num_threads(before)


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


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--seeds", "-1"], "--seeds must be a comma list of non-negative integers, e.g. 0,1,2 (got '-1')"),
        (["--seeds", "0,a"], "--seeds must be a comma list of non-negative integers, e.g. 0,1,2 (got '0,a')"),
        (["--seeds", ","], "--seeds must be a comma list of non-negative integers, e.g. 0,1,2 (got ',')"),
        (["-v", ","], "--variants names no variant (got ',')"),
        (["-s", "run.seed=-2"], "run.seed: must be greater than or equal to 0 (got -2)"),
    ],
)
def test_compare_arguments_are_config_errors(tmp_path, args, message):
    tiny = ["-s", "dataset.name=digits", "-s", "model.name=mlp", "-s", "partition.num_clients=4", "-r", "1"]
    tiny += ["-s", "run.progress=false", "-s", "partition.min_size=20"]
    result = runner.invoke(app, ["compare", *tiny, "-o", str(tmp_path), *args])
    assert isinstance(result.exception, ConfigError), result.output
    assert str(result.exception) == message


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ("seeds = [-1]", "compare.seeds.0: must be greater than or equal to 0 (got -1)"),
        ("seeds = 5", "compare.seeds: must be a list (got 5)"),
        ("seeds = [true]", "compare.seeds: must be a list of integers, not booleans (got [True])"),
        ("seeds = []", "compare.seeds: must have at least 1 items (got [])"),
        ("variants = 'fedavg'", "compare.variants: must be a list (got 'fedavg')"),
        ("variant = ['fedavg']", "unknown key 'compare.variant'; valid keys in [compare]: variants, seeds, params,"),
        ("params = {fedprox = 5}", "compare.params.fedprox: must be a table of keys (got 5)"),
    ],
)
def test_a_bad_compare_table_is_a_config_error(tmp_path, table, message):
    cfg = tmp_path / "cmp.toml"
    tiny = "[run]\nprogress = false\nrounds = 1\n[dataset]\nname = 'digits'\n[model]\nname = 'mlp'\n"
    cfg.write_text(f"{tiny}[partition]\nnum_clients = 4\nmin_size = 20\n[compare]\n{table}\n")
    result = runner.invoke(app, ["compare", "-c", str(cfg), "-o", str(tmp_path)])
    assert isinstance(result.exception, ConfigError), result.output
    assert str(result.exception).startswith(message)


def test_compare_refuses_a_compare_value_that_is_not_a_table(tmp_path):
    cfg = tmp_path / "cmp.toml"
    cfg.write_text("compare = 5\n")
    result = runner.invoke(app, ["compare", "-c", str(cfg), "-o", str(tmp_path)])
    assert isinstance(result.exception, ConfigError), result.output
    assert str(result.exception) == "compare: must be a table of keys (got 5)"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-s", "run.device=tpu9"], "run.device: not a device torch knows; available here: cpu"),
        (["--seed", "-1"], "run.seed: must be greater than or equal to 0 (got -1)"),
        (["-s", "partition.seed=-1"], "partition.seed: must be greater than or equal to 0 (got -1)"),
        (["-s", "run.rounds=true"], "run.rounds: must be an integer, not a boolean (got True)"),
        (["-s", "train.lr=inf"], "train.lr: must be a finite number (got 'inf')"),
        (["-s", "train.nesterov=true"], "train.nesterov=true needs train.momentum > 0"),
        (["-s", "foo.bar=1"], "unknown section 'foo'; valid sections: run,"),
    ],
)
def test_bad_run_settings_are_one_line_errors(tmp_path, args, message):
    result = runner.invoke(app, ["run", *TINY, "-o", str(tmp_path), *args])
    assert isinstance(result.exception, ConfigError), result.output
    assert str(result.exception).startswith(message) and "\n" not in str(result.exception)
    assert not list(tmp_path.glob("*/metrics.jsonl"))  # nothing ran


@pytest.mark.slow
def test_bad_config_files_are_one_line_errors_from_the_command_line(tmp_path):
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes('[run]\nname = "caf\xe9"\n'.encode("latin-1"))
    for path, message in [(latin1, "is not UTF-8 text (byte 17: b'\\xe9\"\\n')"), (tmp_path, "is a folder")]:
        proc = subprocess.run(
            [sys.executable, "-m", "fedhet.cli", "run", "-c", str(path), "-o", str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2, proc.stderr
        assert "Traceback" not in proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: config file") and message in lines[0], lines


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["-s", "run.foo=1", "-s", "train.lrr=1"],
            "error: unknown key 'run.foo'; unknown key 'train.lrr'; valid keys in [run]: name, seed,",
        ),
        (["-s", "algorithm.name='[/red]x'"], "error: unknown algorithm '[/red]x'; choose one of:"),
    ],
)
def test_cli_errors_print_on_one_line_with_brackets_kept(tmp_path, args, expected):
    """The message is printed as it is: not cut into lines at the console width, "[run]" not read as markup."""
    proc = subprocess.run(
        [sys.executable, "-m", "fedhet.cli", "run", "-o", str(tmp_path), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected), proc.stderr
    assert "valid keys in [train]: participation," in lines[0] or "algorithm" in expected


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


@pytest.mark.parametrize(
    "args",
    [["run", *TINY], ["partition", "-d", "digits"], ["flower", "simulate", *TINY], ["flower", "app", "APP", *TINY]],
)
def test_ctrl_c_while_the_config_is_built_says_so(tmp_path, monkeypatch, args):
    """Ctrl-C while make_config loads plug-ins and datasets is the same one-line 'interrupted' as in training (typer
    alone exits 130 without a word)."""
    import fedhet.api
    from fedhet.errors import Interrupted

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(fedhet.api, "make_config", interrupted)
    args = [str(tmp_path / "app") if a == "APP" else a for a in args]
    result = runner.invoke(app, [*args, "-o", str(tmp_path)] if args[0] != "partition" else args)
    assert isinstance(result.exception, Interrupted), (result.exit_code, result.output)
    assert "while the config was being built" in str(result.exception)

"""The Python API (``import fedhet``), the README's example, and the CLI's shared shortcuts and quiet libraries."""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import click
import pytest
import typer
from typer.testing import CliRunner

import fedhet
from fedhet.cli import app
from fedhet.cli_shared import quiet_libraries
from fedhet.errors import ConfigError

# The README's ten lines, read from README.md and run exactly as printed there.
README = Path(__file__).parents[1] / "README.md"
README_EXAMPLE = README.read_text().split("## Python\n\n```python\n", 1)[1].split("```", 1)[0]


def test_the_readme_example_runs(tmp_path, monkeypatch, capsys):
    assert len(README_EXAMPLE.strip().splitlines()) == 10
    monkeypatch.chdir(tmp_path)
    # compare gives its in-process cells every core; on a shared 2-core test machine one thread is much faster
    monkeypatch.setattr("fedhet.cells.usable_cores", lambda: 1)
    exec(compile(README_EXAMPLE, "README.md", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    acc, rounds = printed[0].split()
    assert 0.8 <= float(acc) <= 1 and rounds == "3"  # the README's settings learn (issue 27): 89 %
    assert [line.split(":")[0] for line in printed[1:]] == ["fedavg", "scaffold"]
    # the default name carries a hash of the non-default settings (issue 27)
    assert [p.name for p in (tmp_path / "runs").glob("scaffold-digits-dirichlet-s0-*/metrics.jsonl")] == [
        "metrics.jsonl"
    ]
    assert sorted(p.name for p in (tmp_path / "study").iterdir() if p.is_dir()) == [
        "fedavg-s0",
        "fedavg-s1",
        "scaffold-s0",
        "scaffold-s1",
    ]


def base(tmp_path, **run):
    return {
        "run": {"rounds": 2, "out_dir": str(tmp_path / "runs"), "progress": False, "workers": 1, **run},
        "dataset": {"name": "digits"},
        "partition": {"num_clients": 4, "min_size": 20},
        "model": {"name": "mlp", "hidden": [16]},
        "train": {"lr": 0.1, "batch_size": 16},
    }


def test_make_config_from_dict_toml_and_config_with_overrides_and_shortcuts(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('[dataset]\nname = "digits"\n[train]\nlr = 0.5\n[compare]\nvariants = ["fedavg"]\n')
    from_toml = fedhet.make_config(toml, ["train.lr=0.05"], algorithm="fedprox", rounds=7)
    assert (from_toml.train.lr, from_toml.algorithm.name, from_toml.run.rounds) == (0.05, "fedprox", 7)
    from_dict = fedhet.make_config({"algorithm": {"name": "fedprox"}}, {"train.lr": 0.05, "algorithm.mu": 0.1})
    assert from_dict.algorithm.params() == {"mu": 0.1} and from_dict.train.lr == 0.05
    again = fedhet.make_config(from_dict, seed=3, name="x", out=str(tmp_path))
    assert (again.run.seed, again.run.name, again.run.out_dir) == (3, "x", str(tmp_path))
    assert isinstance(again, fedhet.Config)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"algorithm": "fedprx"}, r"^unknown algorithm 'fedprx'; choose one of: "),
        ({"overrides": {"train.lr": -1}}, r"^train.lr: must be greater than 0 \(got -1\)$"),
        ({"lr": 0.1}, r"^unknown shortcut 'lr'; valid: algorithm, dataset, "),
        ({"overrides": "train.lr=1"}, r"^overrides must be a dict or a list"),
        ({"source": 3}, r"^a config is a Config, a dict or a TOML file's path, not int$"),
    ],
)
def test_api_errors_are_the_cli_ones(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        fedhet.make_config(**kwargs)


def test_run_returns_the_records_the_cli_writes(tmp_path):
    result = fedhet.run(base(tmp_path), algorithm="fedprox", name="api")
    cli = CliRunner().invoke(
        app,
        ["run", "-a", "fedprox", "--name", "cli", "-o", str(tmp_path / "runs"), "-s", "dataset.name=digits"]
        + ["-s", "partition.num_clients=4", "-s", "partition.min_size=20", "-s", "model.name=mlp"]
        + ["-s", "model.hidden=[16]", "-s", "train.lr=0.1", "-s", "train.batch_size=16", "-r", "2"]
        + ["-s", "run.progress=false", "-s", "run.workers=1"],
    )
    assert cli.exit_code == 0, cli.output
    from_cli = fedhet.load_run(tmp_path / "runs" / "cli")

    def strip(records):
        return [{k: v for k, v in r.items() if k != "elapsed_s"} for r in records]

    assert strip(result.records) == strip(from_cli.records) and len(result.records) == 2
    assert result.final["round"] == 2 and result.summary["rounds_done"] == 2
    assert result.metric("test_acc") == [(r["round"], r["test_acc"]) for r in result.records]
    assert result.config["algorithm"] == {"name": "fedprox", "weighting": "samples", "mu": 0.01}
    again = fedhet.resume(result.run_dir, rounds=3)
    assert [r["round"] for r in again.records] == [1, 2, 3]
    assert [r.name for r in fedhet.load_runs(tmp_path / "runs")] == ["api", "cli"]


def test_to_dataframe_or_a_clear_error_without_pandas(tmp_path):
    result = fedhet.run(base(tmp_path, rounds=1), name="df")
    try:
        import pandas  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"^to_dataframe needs pandas \(pip install 'fedhet\[pandas\]'"):
            result.to_dataframe()
        with pytest.raises(ImportError, match=r"^to_dataframe needs pandas"):
            fedhet.records_dataframe([result])
        return
    frame = result.to_dataframe()
    assert list(frame["round"]) == [1] and set(frame["run"]) == {"df"}
    assert len(fedhet.records_dataframe([result, result])) == 2


def test_compare_with_shortcuts_grid_and_report(tmp_path, monkeypatch):
    monkeypatch.setattr("fedhet.cells.usable_cores", lambda: 1)
    results = fedhet.compare(
        base(tmp_path),
        algorithm="fedavg",
        seed=1,
        name="study",
        grid={"train.lr": [0.05, 0.1]},
    )
    folders = sorted(str(r.run_dir.relative_to(tmp_path / "runs")) for r in results)
    assert folders == ["study/lr0.05/fedavg-s1", "study/lr0.1/fedavg-s1"]
    rows = fedhet.report(results)
    assert len(rows) == 2 and all(row.seeds == 1 for row in rows)
    assert (tmp_path / "runs" / "study" / "comparison.md").is_file()
    with pytest.raises(ConfigError, match=r"^compare: give variants or algorithm, not both$"):
        fedhet.compare(base(tmp_path), variants=["fedavg"], algorithm="fedprox")


# ------------------------------------------------------------------------------------------------- one CLI
SHORTCUTS = {"-a", "-d", "-p", "-m", "-n", "-r", "-o", "--name", "--seed", "--server", "--data-dir", "--plugin"}


def options_of(*path: str) -> set[str]:
    command = typer.main.get_command(app)
    for name in path:
        command = command.commands[name]
    return {opt for param in command.params if isinstance(param, click.Option) for opt in param.opts}


@pytest.mark.parametrize("command", [("run",), ("compare",), ("flower", "simulate"), ("flower", "app")])
def test_every_command_that_runs_a_config_takes_the_same_shortcuts(command):
    pytest.importorskip("flwr")
    assert options_of(*command) >= SHORTCUTS


def test_flower_app_takes_the_run_shortcuts(tmp_path):
    pytest.importorskip("flwr")
    result = CliRunner().invoke(
        app, ["flower", "app", str(tmp_path / "a"), "-a", "scaffold", "-d", "digits", "-n", "5", "--name", "x"]
    )
    assert result.exit_code == 0, result.output
    text = (tmp_path / "a" / "fedhet.toml").read_text()
    assert 'name = "scaffold"' in text and "num_clients = 5" in text and 'name = "x"' in text


def test_library_warnings_stay_quiet_unless_verbose():
    flwr_log = logging.getLogger("flwr")
    before = flwr_log.level

    def emit():
        warnings.warn_explicit("ray tip", FutureWarning, "worker.py", 1, module="ray._private.worker")
        warnings.warn_explicit("ours", UserWarning, "x.py", 1, module="fedhet.engine")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with quiet_libraries(verbose=False):
            emit()
            assert flwr_log.getEffectiveLevel() == logging.ERROR
        with quiet_libraries(verbose=True):
            emit()
    assert [str(w.message) for w in caught] == ["ours", "ray tip", "ours"]
    assert flwr_log.level == before


def test_import_fedhet_is_light_and_lists_its_api():
    import subprocess
    import sys

    code = "import sys, fedhet; print('torch' in sys.modules, sorted(fedhet.__all__))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.startswith("False")
    assert json.loads(out.split(" ", 1)[1].replace("'", '"')) == sorted(fedhet.__all__)
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        _ = fedhet.nope

"""Issue 28, "Defaults that fit the data": without a model the config gets one that takes the dataset's input, and
`fedhet list models` says which fit which; a model that cannot is one line naming those that can. Issue 26's
leftovers: `fedhet compare` checks its paths as `fedhet run` does, and the MLflow path checks follow the default
SQLite store (``<out_dir>/mlflow.db``, artifacts in ``<out_dir>/mlartifacts``)."""

from __future__ import annotations

import json
import os
import sys

import pytest
from typer.testing import CliRunner

from fedhet.cli import app, main
from fedhet.config import build_config
from fedhet.errors import ConfigError
from fedhet.models import fit
from fedhet.naming import check_config_paths, default_name
from fedhet.paths import mlflow_paths

QUIET = ["-s", "run.progress=false", "-s", "partition.min_size=20"]


def fedhet(monkeypatch, capsys, *args) -> tuple[int, str]:
    """(exit status, stderr) of ``fedhet ARGS``, run by the console script's ``main``."""
    monkeypatch.setattr(sys, "argv", ["fedhet", *map(str, args)])
    with pytest.raises(SystemExit) as info:
        main()
    return info.value.code or 0, capsys.readouterr().err


def one_error_line(code: int, err: str) -> str:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


# ---------------------------------------------------------------------------------------------- model defaults
def test_run_on_digits_without_a_model(tmp_path, monkeypatch, capsys):
    code, err = fedhet(monkeypatch, capsys, "run", "-d", "digits", "-r", "1", "-n", "4", "-o", tmp_path, *QUIET)
    assert code == 0, err
    [saved] = tmp_path.rglob("config.json")
    assert json.loads(saved.read_text())["model"]["name"] == "mlp"  # the resolved config records the choice


@pytest.mark.parametrize(
    "dataset, model", [("digits", "mlp"), ("synthetic", "mlp"), ("shakespeare", "lstm"), ("fmnist", "cnn")]
)
def test_the_default_model_follows_the_dataset(dataset, model):
    assert build_config({"dataset": {"name": dataset}}).model.name == model
    assert build_config({"dataset": {"name": dataset}, "model": {}}).model.name == model
    assert fit.default_model(dataset) == model


def test_an_explicit_model_wins_and_params_without_a_name_go_to_the_default():
    assert build_config({"dataset": {"name": "digits"}, "model": {"name": "convnet"}}).model.name == "convnet"
    cfg = build_config({"dataset": {"name": "digits"}, "model": {"hidden": [16]}})
    assert cfg.model.name == "mlp" and cfg.model.params() == {"hidden": [16]}
    assert build_config({}).model.name == "cnn"  # fmnist: as before
    # a saved config (config.json) holds model.name: building it again changes nothing
    raw = cfg.to_dict()
    assert build_config(raw).to_dict() == raw


def test_the_default_name_is_the_same_with_and_without_the_model_named(tmp_path):
    base = {"run": {"out_dir": str(tmp_path)}, "dataset": {"name": "digits"}}
    named = build_config({**base, "model": {"name": "mlp"}})
    assert default_name(build_config(base)) == default_name(named)


def test_every_built_in_dataset_gets_a_model_that_fits_it():
    for dataset in fit.datasets():
        task, shape = fit.dataset_input(dataset)
        assert fit.why_not(fit.default_model(dataset), task, shape) is None, dataset
        assert dataset in fit.fits(fit.default_model(dataset))


def test_list_models_shows_which_datasets_each_fits():
    result = CliRunner().invoke(app, ["list", "models"], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    assert "fits datasets" in result.output
    rows: dict[str, str] = {}
    last = ""
    for line in (line for line in result.output.splitlines() if line.startswith("│ ")):
        name = line.split("│")[1].strip()  # a row that wraps goes on in lines with an empty first cell
        last = name or last
        rows[last] = rows.get(last, "") + line
    assert "shakespeare" in rows["lstm"] and "digits" not in rows["lstm"]
    assert "digits" in rows["mlp"] and "synthetic" in rows["mlp"]
    assert "digits" not in rows["cnn"] and "cifar10" in rows["cnn"]
    result = CliRunner().invoke(app, ["list", "datasets"], env={"COLUMNS": "300"})
    assert "default model" in result.output


def test_a_model_that_cannot_take_the_input_names_those_that_can(tmp_path, monkeypatch, capsys):
    args = ["run", "-d", "digits", "-m", "cnn", "-r", "1", "-n", "4", "-o", tmp_path / "runs", *QUIET]
    line = one_error_line(*fedhet(monkeypatch, capsys, *args))
    assert "model 'cnn' cannot take the inputs of dataset 'digits'" in line
    assert "models that fit digits: cnn_bn, convnet, logreg, mlp, resnet18" in line
    assert not (tmp_path / "runs").exists()
    sequence_models = "bert_base, bert_tiny, distilbert, gpt2, gpt_tiny, lstm"
    with pytest.raises(ConfigError, match=f"models that fit shakespeare: {sequence_models} "):
        build_config({"dataset": {"name": "shakespeare"}, "model": {"name": "mlp"}})
    with pytest.raises(ConfigError, match="it reads sequences of character indices, not tabular inputs"):
        build_config({"dataset": {"name": "synthetic"}, "model": {"name": "lstm"}})


# ---------------------------------------------------------------------------------------------- compare's paths
COMPARE = ["compare", "-a", "fedavg", "-d", "digits", "-n", "4", "-r", "1", "--seed", "0", *QUIET]


def test_compare_into_a_file_is_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("")
    line = one_error_line(*fedhet(monkeypatch, capsys, *COMPARE, "-o", tmp_path / "file"))
    assert "run.out_dir" in line and "is a file, not a folder" in line
    line = one_error_line(*fedhet(monkeypatch, capsys, *COMPARE, "-o", tmp_path / "file", "--dry-run"))
    assert "is a file, not a folder" in line


def test_compare_with_a_fifo_data_dir_is_one_line(tmp_path, monkeypatch, capsys):
    os.mkfifo(tmp_path / "fifo")
    args = [*COMPARE, "-o", tmp_path / "runs", "--data-dir", tmp_path / "fifo"]
    line = one_error_line(*fedhet(monkeypatch, capsys, *args))
    assert "dataset.data_dir" in line and "FIFO" in line
    assert not (tmp_path / "runs").exists()


def test_compare_with_a_dangling_run_folder_link_is_one_line(tmp_path, monkeypatch, capsys):
    out = tmp_path / "runs"
    code, err = fedhet(monkeypatch, capsys, *COMPARE, "-o", out, "--dry-run")
    assert code == 0, err
    out.mkdir()
    (out / "fedavg-s0").symlink_to(tmp_path / "gone")
    line = one_error_line(*fedhet(monkeypatch, capsys, *COMPARE, "-o", out))
    assert "fedavg-s0" in line and "which does not exist" in line
    assert not (tmp_path / "gone").exists()


# ---------------------------------------------------------------------------------------------- MLflow's store
def test_mlflow_paths_follow_the_sqlite_store(tmp_path):
    assert mlflow_paths(None, tmp_path) == [
        (tmp_path / "mlflow.db", "MLflow database"),
        (tmp_path / "mlartifacts", "MLflow artifacts folder"),
    ]
    db = tmp_path / "x" / "t.db"
    assert mlflow_paths(f"sqlite:///{db}", tmp_path) == [
        (db, "MLflow database"),
        (db.parent / "mlartifacts", "MLflow artifacts folder"),
    ]
    assert mlflow_paths(f"file://{tmp_path / 'store'}", tmp_path) == [(tmp_path / "store", "MLflow store")]
    assert mlflow_paths("http://localhost:5000", tmp_path) == []


@pytest.mark.parametrize("blocker", ["mlflow.db", "mlartifacts"])
def test_the_default_mlflow_store_is_checked(tmp_path, blocker):
    pytest.importorskip("mlflow")
    out = tmp_path / "runs"
    cfg = build_config({"run": {"out_dir": str(out)}, "dataset": {"name": "digits"}, "tracking": {"mlflow": True}})
    check_config_paths(cfg, writable=True)  # nothing there yet: fine
    out.mkdir()
    if blocker == "mlflow.db":
        (out / blocker).mkdir()  # a folder where the database belongs
        message = "MLflow database .* is a folder, not a file"
    else:
        (out / blocker).write_text("")  # a file where the artifacts go
        message = "MLflow artifacts folder .* is a file, not a folder"
    with pytest.raises(ConfigError, match=message):
        check_config_paths(cfg, writable=True)

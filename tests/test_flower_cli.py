"""``fedhet flower app`` and ``fedhet flower export`` from the command line."""

from __future__ import annotations

import os

import numpy as np
import pytest
import tomli_w
from typer.testing import CliRunner

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # no calls home from Flower in tests (read when flwr loads)
pytest.importorskip("flwr")

from fedhet.cli import app  # noqa: E402
from fedhet.config import load_config, tomllib  # noqa: E402

runner = CliRunner()


@pytest.fixture
def config_file(tmp_path):
    raw = {
        "run": {"rounds": 2, "out_dir": str(tmp_path / "runs"), "progress": False},
        "dataset": {"name": "digits"},
        "partition": {"name": "dirichlet", "alpha": 0.5, "num_clients": 3, "min_size": 20, "local_test_fraction": 0.2},
        "model": {"name": "mlp", "hidden": [32]},
        "algorithm": {"name": "fedprox", "mu": 0.01},
    }
    path = tmp_path / "cfg.toml"
    path.write_text(tomli_w.dumps(raw))
    return path


def test_flower_app_writes_an_app_folder_with_the_config(tmp_path, config_file):
    out = tmp_path / "prox-app"
    result = runner.invoke(app, ["flower", "app", str(out), "-c", str(config_file), "-s", "train.lr=0.05"])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == ["fedhet.toml", "fedhet_app.py", "pyproject.toml"]
    written = load_config(out / "fedhet.toml")
    assert written == load_config(config_file, ["train.lr=0.05"])
    flwr_app = tomllib.loads((out / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    assert flwr_app["components"] == {"serverapp": "fedhet_app:server_app", "clientapp": "fedhet_app:client_app"}
    assert flwr_app["config"]["config"] == "fedhet.toml"

    again = runner.invoke(app, ["flower", "app", str(out), "-c", str(config_file)])
    assert again.exit_code != 0 and "not empty" in str(again.exception)


def test_flower_app_for_gpu_machines_can_be_written_on_a_cpu_one(tmp_path, config_file):
    """The app runs on the SuperLink's machines, so its run.device is checked there; a bad name still fails here."""
    out = tmp_path / "gpu-app"
    result = runner.invoke(app, ["flower", "app", str(out), "-c", str(config_file), "-s", "run.device=cuda:1"])
    assert result.exit_code == 0, result.output
    assert tomllib.loads((out / "fedhet.toml").read_text())["run"]["device"] == "cuda:1"
    bad = runner.invoke(app, ["flower", "app", str(out), "-c", str(config_file), "-s", "run.device=tpu9"])
    assert "run.device: not a device torch knows" in str(bad.exception)


def test_flower_export_writes_one_model_ready_file_per_client(tmp_path, config_file):
    out = tmp_path / "clients"
    result = runner.invoke(app, ["flower", "export", "-c", str(config_file), "-o", str(out)])
    assert result.exit_code == 0, result.output
    files = sorted(out.glob("client_*.npz"))
    assert [f.name for f in files] == ["client_0.npz", "client_1.npz", "client_2.npz"]
    with np.load(files[0]) as f:
        assert f["x"].dtype == np.float32 and f["x"].shape[1:] == (1, 8, 8)
        assert len(f["x"]) == len(f["y"]) and int(f["num_classes"]) == 10 and len(f["y_test"]) > 0

"""Plug-ins: components defined outside fedhet, from a file (--plugin, run.plugins) or an installed entry point.

The example of docs/extending.md (examples/label_smoothing.py) is checked by hand computation, learns on digits,
runs from the CLI, in worker processes (bit-identical), over Flower (in-process grid and an app folder) and resumes
after its file moved. Each test restores the registries, so a plug-in never leaks into other tests."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from fedhet import plugins
from fedhet.algorithms import ALGORITHMS, SERVER_OPTIMIZERS
from fedhet.cli import app
from fedhet.config import build_config, load_config
from fedhet.data.datasets import DATASETS
from fedhet.data.partition import PARTITIONERS
from fedhet.engine.simulation import Simulation
from fedhet.errors import ConfigError
from fedhet.models import MODELS

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "label_smoothing.py"
REGISTRIES = (ALGORITHMS, SERVER_OPTIMIZERS, DATASETS, PARTITIONERS, MODELS)
PLUGIN_MODULES = ("label_smoothing", "other_kinds", "my_fedhet_ext", "broken")  # the plug-ins these tests import


@pytest.fixture(autouse=True)
def isolated():
    """Whatever a test's plug-ins register or import is forgotten afterwards."""
    entries = [dict(r._entries) for r in REGISTRIES]
    loaded, flag = dict(plugins._loaded), plugins._entry_points_loaded
    yield
    for name in {*plugins._loaded.values(), *PLUGIN_MODULES} - set(loaded.values()):
        sys.modules.pop(name, None)
    for registry, saved in zip(REGISTRIES, entries, strict=True):
        registry._entries.clear()
        registry._entries.update(saved)
    plugins._loaded.clear()
    plugins._loaded.update(loaded)
    plugins._entry_points_loaded = flag


def with_plugin(tiny_config, path=EXAMPLE, **sections):
    cfg = tiny_config(**sections)
    return build_config({**cfg.to_dict(), "run": {**cfg.to_dict()["run"], "plugins": [str(path)]}})


def records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k != "elapsed_s"} for line in lines]


def test_label_smoothing_loss_matches_the_hand_computation():
    plugins.load([str(EXAMPLE)])
    algo_cls = ALGORITHMS.get("fedavg_ls").obj
    algo = algo_cls.__new__(algo_cls)
    algo.config = algo_cls.Config(smoothing=0.2)

    class Ctx:  # local_loss reads only the model
        @staticmethod
        def model(x):
            return x

    logits = torch.tensor([[2.0, 0.0, -1.0], [0.5, 0.5, 1.0]])
    y = torch.tensor([0, 2])
    # target (1 - ε) onehot + ε / C; loss = -Σ_c t_c log p_c, averaged over the batch
    expected = 0.0
    for row, label in zip(logits.tolist(), y.tolist(), strict=True):
        log_z = math.log(sum(math.exp(v) for v in row))
        log_p = [v - log_z for v in row]
        target = [0.8 * (c == label) + 0.2 / 3 for c in range(3)]
        expected -= sum(t * lp for t, lp in zip(target, log_p, strict=True)) / 2
    assert algo.local_loss(Ctx(), logits, y).item() == pytest.approx(expected, rel=1e-6)
    assert F.cross_entropy(logits, y).item() != pytest.approx(expected)  # the smoothing is really applied


def test_a_plugin_method_learns_on_digits(tiny_config):
    cfg = with_plugin(tiny_config, run={"rounds": 8, "name": "ls"}, algorithm={"name": "fedavg_ls", "smoothing": 0.1})
    summary = Simulation(cfg).run()
    assert summary["final"]["test_acc"] > 0.6  # 10 classes: chance is 0.1


def test_plugin_gets_builtin_validation_and_list_entry(tiny_config, tmp_path):
    cfg = with_plugin(tiny_config, algorithm={"name": "fedavg_ls", "smoothing": 1.5})
    with pytest.raises(ConfigError, match=r"^algorithm 'fedavg_ls': smoothing: must be less than 1 \(got 1.5\)$"):
        Simulation(cfg)
    cfg = with_plugin(tiny_config, algorithm={"name": "fedavg_ls", "mu": 1})
    with pytest.raises(ConfigError, match=r"unknown key 'algorithm.mu' for algorithm 'fedavg_ls'.*smoothing"):
        Simulation(cfg)
    listed = CliRunner().invoke(app, ["list", "algorithms", "--plugin", str(EXAMPLE)])
    assert listed.exit_code == 0, listed.output
    assert "fedavg_ls" in listed.output and "smoothing=0.1" in listed.output


def test_without_its_plugin_the_name_is_unknown_with_a_hint(tiny_config):
    with pytest.raises(ConfigError, match=r"unknown algorithm 'fedavg_ls'; choose one of: .*--plugin FILE.py"):
        Simulation(tiny_config(algorithm={"name": "fedavg_ls"}))


@pytest.mark.slow
def test_worker_processes_load_the_plugin_and_give_the_same_bits(tiny_config):
    def make(name, workers):
        return with_plugin(
            tiny_config, run={"rounds": 2, "name": name, "workers": workers}, algorithm={"name": "fedavg_ls"}
        )

    here, there = Simulation(make("here", 1)), Simulation(make("there", 2))
    here.run()
    there.run()
    assert there.workers == 2
    assert records(here.run_dir) == records(there.run_dir)


@pytest.mark.slow
def test_cli_run_then_resume_after_the_plugin_file_moved(tmp_path):
    """The saved config names the plug-in; a moved one stops the resume with one line (checked in a process of its
    own, as a user sees it) that --plugin on resume fixes."""
    plugin = tmp_path / "label_smoothing.py"
    shutil.copy(EXAMPLE, plugin)
    common = ["-d", "digits", "-m", "mlp", "-n", "4", "-o", str(tmp_path / "runs"), "--name", "ls"]
    quiet = ["-s", "run.progress=false", "-s", "model.hidden=[16]", "-s", "partition.min_size=20"]
    done = CliRunner().invoke(app, ["run", "--plugin", str(plugin), "-a", "fedavg_ls", "-r", "1", *common, *quiet])
    assert done.exit_code == 0, done.output
    run_dir = tmp_path / "runs" / "ls"
    assert json.loads((run_dir / "config.json").read_text())["run"]["plugins"] == [str(plugin)]

    moved = tmp_path / "elsewhere" / "label_smoothing.py"
    moved.parent.mkdir()
    plugin.rename(moved)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    lost = subprocess.run(
        [sys.executable, "-m", "fedhet.cli", "resume", str(run_dir), "-r", "2"], capture_output=True, text=True, env=env
    )
    assert lost.returncode == 2
    assert lost.stderr.strip() == (
        f"error: plug-in file '{plugin}' (run.plugins) does not exist; pass its current path with --plugin, or set "
        "run.plugins"
    )
    resumed = CliRunner().invoke(app, ["resume", str(run_dir), "-r", "2", "--plugin", str(moved)])
    assert resumed.exit_code == 0, resumed.output
    assert [r["round"] for r in records(run_dir)] == [1, 2]
    assert json.loads((run_dir / "config.json").read_text())["run"]["plugins"] == [str(moved)]


def test_a_toml_file_names_plugins_relative_to_itself(tmp_path):
    folder = tmp_path / "study"
    folder.mkdir()
    shutil.copy(EXAMPLE, folder / "label_smoothing.py")
    toml = folder / "run.toml"
    toml.write_text('[run]\nplugins = ["label_smoothing.py"]\n[algorithm]\nname = "fedavg_ls"\n')
    cfg = load_config(toml)
    assert cfg.run.plugins == [str(folder / "label_smoothing.py")]


def test_flower_runs_a_plugin_method_like_the_simulation(tiny_config):
    pytest.importorskip("flwr")
    from fedhet.flower.app import RunOptions, run_server
    from fedhet.flower.client import make_client_app
    from fedhet.flower.loopback import LoopbackGrid

    def make(name):
        return with_plugin(
            tiny_config,
            run={"rounds": 2, "name": name},
            partition={"num_clients": 4},
            algorithm={"name": "fedavg_ls", "smoothing": 0.2},
        )

    sim = Simulation(make("sim"))
    sim.run()
    cfg = make("flower")
    grid = LoopbackGrid(make_client_app(lambda _: cfg), {1: {"partition-ids": "0,1"}, 2: {"partition-ids": "2-3"}})
    run_server(grid, cfg, RunOptions())
    assert records(sim.run_dir) == records(Path(cfg.run.out_dir) / "flower")


def test_a_flower_app_folder_carries_its_plugin(tiny_config, tmp_path):
    pytest.importorskip("flwr")
    from flwr.app import Context, RecordDict

    from fedhet.flower.app import folder_client_app, folder_server_app
    from fedhet.flower.loopback import LoopbackGrid

    source = tmp_path / "src" / "label_smoothing.py"
    source.parent.mkdir()
    shutil.copy(EXAMPLE, source)
    out = tmp_path / "runs"
    result = CliRunner().invoke(
        app,
        ["flower", "app", str(tmp_path / "my-app"), "--plugin", str(source), "-a", "fedavg_ls", "-d", "digits"]
        + ["-m", "mlp", "-n", "4", "-r", "1", "-o", str(out), "--name", "ls", "-s", "run.progress=false"],
    )
    assert result.exit_code == 0, result.output
    app_dir = tmp_path / "my-app"
    assert (app_dir / "plugins" / "label_smoothing.py").read_text() == EXAMPLE.read_text()
    source.unlink()  # the app needs only its own copy
    grid = LoopbackGrid(folder_client_app(app_dir), {1: {"partition-ids": "0-3"}})
    folder_server_app(app_dir)(grid=grid, context=Context(1, 0, {}, RecordDict(), {}))
    config = json.loads((out / "ls" / "config.json").read_text())
    assert config["algorithm"]["name"] == "fedavg_ls"
    assert config["run"]["plugins"] == [str(app_dir.resolve() / "plugins" / "label_smoothing.py")]
    assert [r["round"] for r in records(out / "ls")] == [1]


OTHER_KINDS = """
import numpy as np
from torch import nn

from fedhet.data.datasets import DATASETS
from fedhet.data.partition import PARTITIONERS
from fedhet.data.types import ArrayDataset
from fedhet.models import MODELS, FedModel, ModelParams
from fedhet.params import Params
from fedhet.registry import parse_params


class BlobParams(Params):
    per_class: int = 40


@DATASETS.register("blobs", "three Gaussian blobs in 2-D", BlobParams)
def blobs(data_dir=None, **params):
    p = parse_params("dataset", "blobs", BlobParams, params)
    rng = np.random.default_rng(0)
    centres = np.array([[0.0, 3.0], [3.0, -2.0], [-3.0, -2.0]], np.float32)
    y = np.repeat(np.arange(3), p.per_class)
    x = (centres[y] + rng.normal(0, 0.5, (len(y), 2))).astype(np.float32)
    return ArrayDataset("blobs", x, y, x[::4].copy(), y[::4].copy(), 3, (2,), task="tabular")


class StripeParams(Params):
    pass


@PARTITIONERS.register("stripes", "sample i goes to client i mod n", StripeParams)
def stripes(labels, num_clients, rng, *, groups=None, **params):
    return [np.arange(c, len(labels), num_clients) for c in range(num_clients)]


class TinyParams(ModelParams):
    hidden: int = 8


@MODELS.register("tiny", "Linear-ReLU body", TinyParams)
def tiny(input_shape, num_classes, p):
    return FedModel({"fc": nn.Sequential(nn.Linear(input_shape[0], p.hidden), nn.ReLU())}, p.hidden, num_classes)
"""


def test_a_plugin_dataset_partitioner_and_model_run_end_to_end(tmp_path):
    path = tmp_path / "other_kinds.py"
    path.write_text(OTHER_KINDS)
    run = {"rounds": 5, "out_dir": str(tmp_path / "runs"), "progress": False, "workers": 1, "plugins": [str(path)]}
    raw = {
        "run": run,
        "dataset": {"name": "blobs", "per_class": 60},
        "partition": {"name": "stripes", "num_clients": 3},
        "model": {"name": "tiny", "hidden": 16},
        "train": {"lr": 0.2, "batch_size": 16},
    }
    summary = Simulation(build_config(raw)).run()
    assert summary["final"]["test_acc"] > 0.9  # separable blobs
    listed = CliRunner().invoke(app, ["list", "--plugin", str(path)])
    assert all(name in listed.output for name in ("blobs", "stripes", "tiny"))
    with pytest.raises(ConfigError, match=r"^dataset 'blobs': per_class: must be an integer \(got 1.5\)$"):
        Simulation(build_config({**raw, "dataset": {"name": "blobs", "per_class": 1.5}}))


def test_an_installed_entry_point_loads_without_naming_it(tmp_path, monkeypatch):
    (tmp_path / "my_fedhet_ext.py").write_text(
        "from fedhet.algorithms import ALGORITHMS\nfrom fedhet.algorithms.fedavg import FedAvg, FedAvgConfig\n\n"
        '@ALGORITHMS.register("fedavg_ext", "from an entry point", FedAvgConfig)\nclass Ext(FedAvg):\n    pass\n'
    )
    dist = tmp_path / "my_fedhet_ext-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-fedhet-ext\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[fedhet.plugins]\next = my_fedhet_ext\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    plugins._entry_points_loaded = False
    plugins.load()
    assert "fedavg_ext" in ALGORITHMS
    assert plugins.loaded()["entry-point:ext"] == "my_fedhet_ext"


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("def broken(:\n", r"^plug-in file '.*broken.py' failed to load: SyntaxError: "),
        (
            "from fedhet.algorithms import ALGORITHMS\nALGORITHMS.register('fedavg', 'again')(object)\n",
            r"^plug-in file '.*broken.py' failed to load: RuntimeError: algorithm 'fedavg' registered twice$",
        ),
    ],
)
def test_a_broken_plugin_is_one_line_naming_it(tmp_path, source, message):
    path = tmp_path / "broken.py"
    path.write_text(textwrap.dedent(source))
    with pytest.raises(ConfigError, match=message):
        plugins.load([str(path)])
    assert "broken" not in sys.modules


def test_plugin_specs_are_checked_when_the_config_is_built(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = build_config({"run": {"plugins": ["x.py", "pkg.module", "x.py"]}})
    assert cfg.run.plugins == [str(tmp_path / "x.py"), "pkg.module"]
    with pytest.raises(ConfigError, match=r"run.plugins: 'a b' is neither a .py file nor a module name"):
        build_config({"run": {"plugins": ["a b"]}})
    with pytest.raises(ConfigError, match=r"^plug-in module 'no_such_fedhet_plugin' \(run.plugins\) is not importable"):
        plugins.load(["no_such_fedhet_plugin"])


@pytest.mark.slow  # Ray start-up
def test_flower_simulate_runs_a_plugin_method_quietly(tmp_path):
    """`fedhet flower simulate --plugin FILE -a NAME` in a process of its own: the Ray actors load the plug-in from
    the config, and Flower's and Ray's warnings stay off the console."""
    pytest.importorskip("flwr")
    pytest.importorskip("ray")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "FLWR_TELEMETRY_ENABLED": "0"}
    args = ["flower", "simulate", "--plugin", str(EXAMPLE), "-a", "fedavg_ls", "-d", "digits", "-m", "mlp"]
    args += ["-n", "3", "-r", "1", "-o", str(tmp_path / "runs"), "--name", "ray", "--num-cpus", "1"]
    args += ["-s", "run.progress=false", "-s", "model.hidden=[16]", "-s", "partition.min_size=20"]
    done = subprocess.run([sys.executable, "-m", "fedhet.cli", *args], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == ""
    assert done.stdout.startswith("done ray: round 1, test_acc=")
    assert json.loads((tmp_path / "runs" / "ray" / "config.json").read_text())["algorithm"]["name"] == "fedavg_ls"

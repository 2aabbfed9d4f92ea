"""`fedhet compare` as a batch runner: parallel cells, skipping, resuming, config conflicts, grids, Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from fedhet.cells import Cell, by_data, parse_jobs, usable_cores
from fedhet.cli import app
from fedhet.comparison import grid_points, parse_grid_option, plan_comparison, split_values
from fedhet.engine.checkpoint import read_checkpoint
from fedhet.engine.simulation import Simulation
from fedhet.errors import ConfigError, RunFailed
from fedhet.results.store import read_metrics

runner = CliRunner()
SETTING = """
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
"""


def write_config(tmp_path: Path, compare: str) -> Path:
    path = tmp_path / "cmp.toml"
    path.write_text(SETTING + "[compare]\n" + compare)
    return path


def compare(*args: str):
    return runner.invoke(app, ["compare", *args], env={"COLUMNS": "200"})


def metrics(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "elapsed_s"} for r in read_metrics(run_dir / "metrics.jsonl")]


def same_tree(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_tree(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same_tree(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def final_state(run_dir: Path) -> dict:
    return read_checkpoint(run_dir / "checkpoints" / "last.pt")["algo"]


@pytest.mark.slow
def test_jobs_2_gives_the_same_runs_as_jobs_1_and_forwards_warnings_and_failures(tmp_path):
    cfg = write_config(
        tmp_path,
        'variants = ["fedavg", "perfedavg", "fedavg+fedadam"]\n[compare.server_params.fedadam]\nlr = 1e39\n',
    )
    results = {}
    for jobs in ("1", "2"):
        out = tmp_path / f"jobs{jobs}"
        result = compare("-c", str(cfg), "-o", str(out), "--jobs", jobs, "--threads", "1")
        results[jobs] = result
        # fedadam with lr 1e39 diverges: reported, the other cells go on, exit 1 naming it
        assert isinstance(result.exception, RunFailed), result.output
        assert "1 of 3 runs failed (fedavg+fedadam seed 0)" in str(result.exception)
        # a warning printed inside a cell reaches the user with the cell's name (through the queue for jobs 2)
        assert "perfedavg-s0: warning: perfedavg is personalised" in result.output
        assert "failed fedavg_fedadam-s0: round 1" in result.output
        assert "| fedavg |" in (out / "comparison.md").read_text()
    for cell in ("fedavg-s0", "perfedavg-s0", "fedavg_fedadam-s0"):
        one, two = tmp_path / "jobs1" / cell, tmp_path / "jobs2" / cell
        assert metrics(one) == metrics(two), cell
        for folder in (one, two):
            assert json.loads((folder / "provenance.json").read_text())["torch_threads"] == 1
    for cell in ("fedavg-s0", "perfedavg-s0"):
        assert same_tree(final_state(tmp_path / "jobs1" / cell), final_state(tmp_path / "jobs2" / cell))


def test_a_rerun_skips_finished_cells_without_loading_data(tmp_path, monkeypatch):
    cfg = write_config(tmp_path, 'variants = ["fedavg", "fedprox"]\nseeds = [0, 1]\n')
    out = tmp_path / "out"
    assert compare("-c", str(cfg), "-o", str(out), "--threads", "1").exit_code == 0
    files = sorted(out.glob("*/*.json*")) + sorted(out.glob("*/checkpoints/*"))
    before = {f: f.stat().st_mtime_ns for f in files}

    def no_training(*args, **kwargs):
        raise AssertionError("a finished cell was trained again")

    monkeypatch.setattr("fedhet.engine.simulation.build_federation", no_training)
    monkeypatch.setattr(Simulation, "__init__", no_training)
    result = compare("-c", str(cfg), "-o", str(out), "--jobs", "2")
    assert result.exit_code == 0, result.output
    assert "4 of 4 cells had finished before: skipped" in result.output
    assert "│ fedprox " in result.output  # the table is still made, from the folders
    assert {f: f.stat().st_mtime_ns for f in files} == before


def test_a_killed_cell_resumes_and_ends_as_an_uninterrupted_one(tmp_path):
    cfg = write_config(tmp_path, 'variants = ["fedprox", "fedavg"]\n[compare.params.fedprox]\nmu = 0.1\n')
    plan = plan_comparison(cfg, ["run.rounds=3", f"run.out_dir={str(tmp_path / 'cut')!r}"])
    killed = plan.cells[0]
    assert killed.name == "fedprox-s0"
    Simulation(killed.config).run(stop_after=1)  # the process "dies" after round 1's checkpoint
    result = compare("-c", str(cfg), "-r", "3", "-o", str(tmp_path / "cut"), "--threads", "1")
    assert result.exit_code == 0, result.output
    result = compare("-c", str(cfg), "-r", "3", "-o", str(tmp_path / "full"), "--threads", "1")
    assert result.exit_code == 0, result.output
    cut, full = tmp_path / "cut" / "fedprox-s0", tmp_path / "full" / "fedprox-s0"
    assert [r["round"] for r in json.loads((cut / "provenance.json").read_text())["resumes"]] == [1]
    assert metrics(cut) == metrics(full) and len(metrics(cut)) == 3
    assert same_tree(final_state(cut), final_state(full))


def test_a_cell_holding_a_run_of_another_config_is_a_one_line_error(tmp_path):
    cfg = write_config(tmp_path, 'variants = ["fedavg", "fedprox"]\n')
    out = tmp_path / "out"
    assert compare("-c", str(cfg), "-o", str(out), "--threads", "1").exit_code == 0
    stamp = (out / "fedavg-s0" / "metrics.jsonl").stat().st_mtime_ns
    result = compare("-c", str(cfg), "-o", str(out), "-s", "train.lr=0.05", "--jobs", "2")
    assert isinstance(result.exception, ConfigError), result.output
    message = str(result.exception)
    assert "\n" not in message
    assert "fedavg-s0 (train.lr: 0.01 -> 0.05); fedprox-s0 (train.lr: 0.01 -> 0.05)" in message
    assert "--overwrite" in message
    assert (out / "fedavg-s0" / "metrics.jsonl").stat().st_mtime_ns == stamp  # nothing trained
    # more rounds is not a conflict: the finished cells are extended
    result = compare("-c", str(cfg), "-o", str(out), "-r", "3", "--threads", "1")
    assert result.exit_code == 0, result.output
    assert [r["round"] for r in read_metrics(out / "fedprox-s0" / "metrics.jsonl")] == [1, 2, 3]


def test_grid_values_split_at_top_level_commas_only():
    assert split_values("0.1,0.5, 5") == ["0.1", "0.5", "5"]
    assert split_values("[32],[64,64]") == ["[32]", "[64,64]"]
    assert split_values("'a,b',c") == ["'a,b'", "c"]
    assert parse_grid_option(["model.hidden=[32],[64,64]", "partition.alpha=0.1,5"]) == {
        "model.hidden": [[32], [64, 64]],
        "partition.alpha": [0.1, 5],
    }
    for bad in ("partition.alpha", "partition.alpha=", "partition.alpha=0.1,,0.5"):
        with pytest.raises(ConfigError, match="section.key=v1,v2"):
            parse_grid_option([bad])


def test_grid_points_are_named_by_their_values():
    points = grid_points({"partition.alpha": [0.1, 5], "model.hidden": [[32, 64]], "model.name": ["mlp"]})
    assert [name for name, _ in points] == ["alpha0.1-hidden32-64-mlp", "alpha5-hidden32-64-mlp"]
    assert points[1][1] == {"partition.alpha": 5, "model.hidden": [32, 64], "model.name": "mlp"}
    both = grid_points({"train.lr": [0.1], "server.lr": [1.0]})
    assert both[0][0] == "train.lr0.1-server.lr1"
    with pytest.raises(ConfigError, match="use --seeds"):
        grid_points({"run.seed": [0, 1]})
    with pytest.raises(ConfigError, match="repeated"):
        grid_points({"partition.alpha": [0.1, 0.1]})


@pytest.mark.slow
def test_grid_runs_the_product_in_one_folder_per_point(tmp_path):
    cfg = write_config(
        tmp_path, 'variants = ["fedavg", "fedprox"]\nseeds = [0, 1]\n[compare.grid]\npartition.alpha = [0.3, 1.0]\n'
    )
    plan = plan_comparison(cfg, ["train.lr=0.05"], grid=["train.local_epochs=1,2"])
    assert len(plan.cells) == 2 * 2 * 2 * 2
    assert plan.cells[0].name == "alpha0.3-local_epochs1/fedavg-s0"
    assert plan.cells[-1].name == "alpha1-local_epochs2/fedprox-s1"
    last = plan.cells[-1].config
    assert (last.partition.params()["alpha"], last.train.local_epochs, last.train.lr) == (1.0, 2, 0.05)
    assert Path(last.run.out_dir) == Path("runs") / "alpha1-local_epochs2" and last.run.name == "fedprox-s1"
    # cells that share data are queued together: by seed and alpha, not by local_epochs or variant
    order = [c.name for c in by_data(plan.cells)]
    assert order[:4] == [
        "alpha0.3-local_epochs1/fedavg-s0",
        "alpha0.3-local_epochs1/fedprox-s0",
        "alpha0.3-local_epochs2/fedavg-s0",
        "alpha0.3-local_epochs2/fedprox-s0",
    ]
    # a real (small) grid: folders, the overall table labelled by what differs, a table per point
    out = tmp_path / "out"
    result = compare("-c", str(cfg), "-o", str(out), "-r", "1", "--seeds", "0", "-v", "fedavg")
    assert result.exit_code == 0, result.output
    assert (out / "alpha0.3" / "fedavg-s0" / "summary.json").exists()
    assert (out / "alpha1" / "fedavg-s0" / "summary.json").exists()
    table = (out / "comparison.md").read_text()
    assert "| fedavg alpha=0.3 |" in table and "| fedavg alpha=1 |" in table
    assert "| fedavg |" in (out / "alpha0.3" / "comparison.md").read_text()
    result = compare("-c", str(cfg), "-o", str(out), "-r", "1", "--seeds", "0,1", "-v", "fedavg", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "skip: finished round 1" in result.output and "start" in result.output


def test_jobs_option():
    assert parse_jobs("3") == 3
    assert parse_jobs("auto") == parse_jobs("0") == usable_cores()
    with pytest.raises(ConfigError, match="--jobs"):
        parse_jobs("-1")


def test_cells_sharing_a_folder_are_refused(tmp_path, tiny_config):
    from fedhet.cells import run_cells

    cfg = tiny_config(run={"name": "same"})
    with pytest.raises(ConfigError, match="would share the run folder"):
        run_cells([Cell("a", cfg), Cell("b", cfg)])


def worker_pids(pid: int) -> list[int]:
    """The spawned worker processes of ``pid`` (not its multiprocessing resource tracker)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    pids = []
    for child in map(int, children):
        try:
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                pids.append(child)
        except OSError:
            pass
    return pids


@pytest.mark.slow  # three worker processes start (torch import each); 20-40 s on a shared 2-core machine
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the worker processes in /proc")
def test_a_dead_worker_fails_its_cell_only_and_ctrl_c_stops_every_worker(tmp_path):
    cfg = write_config(tmp_path, 'variants = ["fedavg", "fedprox", "fedavg+fedavgm"]\n')
    out = tmp_path / "out"
    rounds = "100000"  # more than any cell can finish before the Ctrl-C below, however idle the machine
    command = [sys.executable, "-m", "fedhet.cli", "compare", "-c", str(cfg), "-o", str(out), "-r", rounds]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [*command, "--jobs", "2", "--threads", "1"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
        # and Ctrl-C reaching it as it does a foreground job: a shell that starts the test suite in the background
        # (`make test &`) leaves SIGINT ignored, and Python keeps an ignored SIGINT ignored
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    cells = [out / "fedavg-s0", out / "fedprox-s0", out / "fedavg_fedavgm-s0"]

    def wait_for_checkpoints(folders: list[Path]) -> None:
        deadline = time.monotonic() + 180
        while not all((c / "checkpoints" / "last.pt").exists() for c in folders):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)

    wait_for_checkpoints(cells[:2])
    workers = worker_pids(proc.pid)
    assert len(workers) == 2
    os.kill(workers[0], signal.SIGKILL)  # as the out-of-memory killer would
    wait_for_checkpoints(cells)  # a new worker took the third cell
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the terminal signals every process of the group
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.count("its worker process died (killed by SIGKILL, out of memory?)") == 1, err
    assert "interrupted: every cell keeps its last checkpoint; run the same command again to continue" in err
    assert "Traceback" not in err
    sizes = [(c / "metrics.jsonl").stat().st_size for c in cells]
    time.sleep(1.5)
    assert [(c / "metrics.jsonl").stat().st_size for c in cells] == sizes  # no worker trains on
    dry = subprocess.run([*command, "--dry-run"], env=env, capture_output=True, text=True, timeout=120)
    assert dry.returncode == 0 and dry.stdout.count("resume: metrics to round") == 3, dry.stdout + dry.stderr
    for cell in plan_comparison(cfg, [f"run.rounds={rounds}", f"run.out_dir={str(out)!r}"]).cells:
        assert Simulation(cell.config).prepare_dir(resume=True, overwrite=False) >= 1  # a checkpoint to go on from


def test_each_data_set_is_loaded_once_however_the_cells_are_listed(tmp_path, monkeypatch):
    import fedhet.engine.simulation as simulation

    loads = []
    real = simulation.build_federation

    def counting(cfg):
        loads.append(cfg.run.seed)
        return real(cfg)

    monkeypatch.setattr(simulation, "build_federation", counting)
    cfg = write_config(tmp_path, 'variants = ["fedavg", "fedprox"]\nseeds = [0, 1]\n')
    out = str(tmp_path / "out")
    result = compare("-c", str(cfg), "-o", out, "-r", "1", "-g", "train.lr=0.05,0.1", "--threads", "1")
    assert result.exit_code == 0, result.output
    assert sorted(loads) == [0, 1]  # 8 cells, 2 data sets (one per seed: the lr grid does not change the data)


def test_compare_runs_variants_and_writes_table_and_plot(tmp_path):
    cfg = write_config(
        tmp_path, 'variants = ["fedavg", "fedprox", "fedavg+fedavgm"]\n[compare.params.fedprox]\nmu = 0.1\n'
    )
    result = runner.invoke(app, ["compare", "-c", str(cfg), "-o", str(tmp_path / "out")], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    table = (tmp_path / "out" / "comparison.md").read_text()
    for label in ("| fedavg |", "| fedprox |", "| fedavg+fedavgm |"):
        assert label in table
    assert (tmp_path / "out" / "comparison.png").exists()
    config = json.loads((tmp_path / "out" / "fedprox-s0" / "config.json").read_text())
    assert config["algorithm"] == {"name": "fedprox", "weighting": "samples", "mu": 0.1}


@pytest.mark.parametrize(
    ("flag", "config_seed", "expected", "words"),
    [
        (None, None, [None, None], "one per seed"),  # as before: the partition follows run.seed
        (None, 5, [5, 5], "fixed for every seed (partition.seed = 5)"),
        ("fixed", None, [1, 1], "fixed for every seed (partition.seed = 1)"),  # the first seed
        ("fixed", 5, [5, 5], "partition.seed = 5"),
        ("per-seed", 5, [None, None], "one per seed"),  # the flag wins over the config
    ],
)
def test_partitions_flag_sets_the_cells_partition_seed(tmp_path, flag, config_seed, expected, words):
    setting = SETTING.replace("num_clients = 4", f"num_clients = 4\nseed = {config_seed}") if config_seed else SETTING
    path = tmp_path / "cmp.toml"
    path.write_text(setting + '[compare]\nvariants = ["fedavg"]\n')
    plan = plan_comparison(path, [], seeds="1,2", partitions=flag)
    assert [c.config.partition.seed for c in plan.cells] == expected
    assert words in plan.partitions


def test_partitions_in_the_compare_table_and_bad_values(tmp_path):
    cfg = write_config(tmp_path, 'variants = ["fedavg"]\npartitions = "fixed"\n')
    assert [c.config.partition.seed for c in plan_comparison(cfg, [], seeds="3,4").cells] == [3, 3]
    with pytest.raises(ConfigError, match="--partitions must be one of per-seed, fixed"):
        plan_comparison(cfg, [], seeds="3,4", partitions="shared")
    bad = write_config(tmp_path, 'partitions = "same"\n')
    with pytest.raises(ConfigError, match="compare.partitions"):
        plan_comparison(bad, [])


@pytest.mark.parametrize(
    ("flag", "sentence"),
    [
        ("fixed", "Seeds: the seeds of each row share one partition (partition seed 0), so ± is over training"),
        ("per-seed", "Seeds: each seed draws its own partition (partition.seed follows run.seed), so ± includes"),
    ],
)
def test_the_comparison_table_says_whether_seeds_share_a_partition(tmp_path, flag, sentence):
    cfg = write_config(tmp_path, 'variants = ["fedavg"]\n')
    out = tmp_path / flag
    result = compare("-c", str(cfg), "-o", str(out), "--seeds", "0,1", "--partitions", flag, "-r", "1")
    assert result.exit_code == 0, result.output
    assert sentence in (out / "comparison.md").read_text()
    assert sentence in " ".join(result.output.split())
    report = runner.invoke(app, ["report", str(out)], env={"COLUMNS": "200"})
    assert sentence in " ".join(report.output.split())


# ------------------------------------------------------------------ hyper-parameters shared by the variants
def algorithms_of(plan) -> dict[str, dict]:
    return {c.name: c.config.algorithm.params() for c in plan.cells}


def test_a_set_algorithm_parameter_reaches_every_variant_that_takes_it(tmp_path):
    cfg = write_config(tmp_path, 'variants = ["fedavg", "fedprox", "fedufo"]\n[compare.params.fedprox]\nmu = 0.1\n')
    plan = plan_comparison(cfg, ["algorithm.mu=0.5", "algorithm.discriminator=private", "algorithm.weighting=uniform"])
    params = algorithms_of(plan)
    assert params["fedprox-s0"]["mu"] == 0.5  # the command line wins over [compare.params]
    assert params["fedufo-s0"]["discriminator"] == "private"  # it was silently dropped before
    assert "mu" not in params["fedavg-s0"] and "discriminator" not in params["fedavg-s0"]
    assert {p["weighting"] for p in params.values()} == {"uniform"}  # a key every algorithm takes


def test_the_base_algorithm_section_reaches_the_variants_below_their_own_params(tmp_path):
    path = tmp_path / "cmp.toml"
    path.write_text(
        SETTING.replace("[model]", '[algorithm]\nname = "fedprox"\nmu = 0.3\n[model]')
        + '[compare]\nvariants = ["fedavg", "fedprox", "fedprox+fedadam"]\n[compare.params.fedprox]\nmu = 0.2\n'
    )
    params = algorithms_of(plan_comparison(path, []))
    assert params["fedprox-s0"]["mu"] == 0.2 and params["fedprox_fedadam-s0"]["mu"] == 0.2
    path.write_text(path.read_text().replace("[compare.params.fedprox]\nmu = 0.2\n", ""))
    assert algorithms_of(plan_comparison(path, []))["fedprox-s0"]["mu"] == 0.3


def test_a_parameter_no_variant_takes_is_refused_not_dropped(tmp_path):
    cfg = write_config(tmp_path, 'variants = ["fedavg", "fedprox"]\n')
    with pytest.raises(ConfigError, match=r"algorithm\.discriminator: no variant of this comparison takes it"):
        plan_comparison(cfg, ["algorithm.discriminator=private"])
    with pytest.raises(ConfigError, match="a comparison picks the algorithm per variant"):
        plan_comparison(cfg, ["algorithm.name=scaffold"])
    result = compare("-c", str(cfg), "-s", "algorithm.disc_epochs=2", "--dry-run")
    assert isinstance(result.exception, ConfigError), result.output  # main() prints it as one line, exit 2
    assert "algorithm.disc_epochs: no variant" in str(result.exception)


def test_server_parameters_and_fixed_fields_reach_a_variant_with_its_own_optimiser(tmp_path):
    cfg = write_config(tmp_path, 'variants = ["fedavg", "fedavg+fedadam"]\n')
    plan = plan_comparison(cfg, ["server.lr=0.02", "server.aggregation=gne"])
    servers = {c.name: c.config.server for c in plan.cells}
    assert servers["fedavg_fedadam-s0"].name == "fedadam" and servers["fedavg_fedadam-s0"].params()["lr"] == 0.02
    assert servers["fedavg_fedadam-s0"].aggregation == "gne"  # a fixed field was dropped with the section before
    assert servers["fedavg-s0"].name == "sgd" and servers["fedavg-s0"].params()["lr"] == 0.02

"""``fedhet.compare(jobs=2)`` and ``run.workers`` where users call them: a script without ``if __name__ ==
"__main__":``, a notebook (code with no file), plug-ins by path and by module name, components defined in
``__main__`` (refused in one line before anything starts), and ``jobs="auto"`` / ``0``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import fedhet
from fedhet.cells import parse_jobs, usable_cores
from fedhet.errors import ConfigError

SETTING = """
setting = {
    "dataset": {"name": "digits"},
    "model": {"name": "mlp", "hidden": [16]},
    "partition": {"name": "iid", "num_clients": 3},
    "train": {"lr": 0.1, "batch_size": 16},
    "run": {"rounds": 2, "progress": False},
}
"""

PLUGIN = """
from fedhet.algorithms import ALGORITHMS
from fedhet.algorithms.fedavg import FedAvg, FedAvgConfig


@ALGORITHMS.register("{name}", "FedAvg under another name, from a plug-in", FedAvgConfig)
class Renamed(FedAvg):
    name = "{name}"
"""


def python(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """Run Python in its own process group, with a temporary folder of its own (to see what it leaves there); on a
    timeout the whole group is killed, workers included, and the test fails with what it printed."""
    tmp = cwd / "tmp"
    tmp.mkdir(exist_ok=True)
    env = {**os.environ, "TMPDIR": str(tmp), "COLUMNS": "200"}
    proc = subprocess.Popen(
        [sys.executable, *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"still running after {timeout} s:\n{out}\n{err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.slow  # two worker processes import torch: 20-40 s on a shared 2-core machine
def test_compare_with_jobs_from_a_script_without_the_main_guard_and_plugins_by_path_and_module(tmp_path):
    (tmp_path / "my_method.py").write_text(PLUGIN.format(name="fedavg_file"))
    (tmp_path / "my_module.py").write_text(PLUGIN.format(name="fedavg_module"))
    script = tmp_path / "study.py"
    # no `if __name__ == "__main__":`: a worker that imported this file would start workers of its own (and fail)
    script.write_text(
        "import fedhet\n"
        + SETTING
        + textwrap.dedent("""
            results = fedhet.compare(setting, variants=["fedavg_file", "fedavg_module"], seeds=[0], out="study",
                                     plugins=["my_method.py", "my_module"], jobs=2, threads=1)
            print("cells", sorted(r.name for r in results), [r.summary["status"] for r in results])
        """)
    )
    done = python([str(script)], tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "cells ['fedavg_file-s0', 'fedavg_module-s0'] ['finished', 'finished']" in done.stdout
    assert "Traceback" not in done.stderr and "freeze_support" not in done.stderr, done.stderr[-3000:]
    assert "leaked" not in done.stderr, done.stderr  # no semaphore left for the resource tracker
    assert list((tmp_path / "tmp").iterdir()) == []  # its multiprocessing temporary folder is gone


REFUSED = (
    "import fedhet\n"
    "from fedhet.algorithms import ALGORITHMS\n"
    "from fedhet.algorithms.fedavg import FedAvg, FedAvgConfig\n"
    "from fedhet.errors import ConfigError\n"
    + SETTING
    + textwrap.dedent("""
        @ALGORITHMS.register("mine", "defined in the calling script", FedAvgConfig)
        class Mine(FedAvg):
            name = "mine"


        for call in (
            lambda: fedhet.compare(setting, variants=["fedavg", "mine"], out="study", jobs=2),
            lambda: fedhet.run(setting, {"run.workers": 2}, algorithm="mine", out="runs"),
        ):
            try:
                call()
            except ConfigError as err:
                print("refused:", err)
        print("in-process:", fedhet.compare(setting, variants=["mine"], out="alone", jobs=1)[0].summary["status"])
    """)
)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["script", "notebook"])
def test_a_component_defined_in_main_is_refused_in_one_line_before_any_worker_starts(tmp_path, where):
    """Workers never import ``__main__``: what it registers cannot reach them (a notebook's definitions never could),
    so a comparison or run that would need it in a worker is refused before anything is written; jobs=1 runs it."""
    if where == "script":
        (tmp_path / "study.py").write_text(REFUSED)
        done = python(["study.py"], tmp_path, timeout=180)
    else:  # code with no file, as in a notebook
        done = python(["-c", REFUSED], tmp_path, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    named = "your script" if where == "script" else "this notebook or session"
    assert lines[0] == (
        f"refused: algorithm 'mine' is defined in {named} (__main__), which worker processes do not import: put it "
        "in a .py file and pass it as a plug-in (plugins=['my_method.py'], or a module name), or run with jobs=1"
    )
    assert lines[1].startswith(f"refused: algorithm 'mine' is defined in {named} (__main__)")
    assert lines[1].endswith("or set run.workers = 1")
    assert lines[2] == "in-process: finished"
    assert not (tmp_path / "study").exists() and not (tmp_path / "runs").exists()  # nothing was written
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


@pytest.mark.parametrize("jobs", ["auto", "AUTO", 0, "0"])
def test_compare_takes_jobs_auto_and_zero_as_the_cli_does(tmp_path, monkeypatch, jobs):
    # one cell: whatever the number of workers, it runs in this process
    monkeypatch.setattr("fedhet.cells.usable_cores", lambda: 1)
    setting = {
        "dataset": {"name": "digits"},
        "model": {"name": "mlp", "hidden": [16]},
        "partition": {"num_clients": 3, "min_size": 20},
        "run": {"rounds": 1, "progress": False, "workers": 1},
    }
    results = fedhet.compare(setting, variants=["fedavg"], out=str(tmp_path / "study"), jobs=jobs)
    assert [r.summary["status"] for r in results] == ["finished"]


@pytest.mark.parametrize("jobs", [-1, "many", "1.5", True])
def test_compare_refuses_other_jobs_in_one_line(tmp_path, jobs):
    with pytest.raises(ConfigError, match=r"^jobs .*: give a number of worker processes, or 0 or auto for one per"):
        fedhet.compare({"run": {"out_dir": str(tmp_path)}}, variants=["fedavg"], jobs=jobs)
    assert not any(tmp_path.iterdir())


def test_parse_jobs_names_the_option():
    assert parse_jobs("auto", "jobs") == parse_jobs(0) == usable_cores()
    assert parse_jobs(" 2 ") == 2
    with pytest.raises(ConfigError, match=r"^--jobs 'x'"):
        parse_jobs("x")


def test_auto_workers_keep_a_component_defined_in_main_in_this_process(tiny_config, monkeypatch):
    from fedhet.engine import simulation, workers

    monkeypatch.setattr(simulation, "usable_cores", lambda: 8)
    cfg = tiny_config(run={"workers": 0}, train={"participation": 1.0})
    assert simulation.resolve_workers(cfg) == 6  # one per client of the round on 8 cores
    monkeypatch.setattr(workers, "main_components", lambda cfg: ["algorithm 'mine'"])
    assert simulation.resolve_workers(cfg) == 1

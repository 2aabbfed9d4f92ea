"""Defects found by trying to break fedhet: a foreign config.json in a run folder, usage errors, plug-ins that exit
or raise KeyboardInterrupt on import, where a comparison's cell runs, a torn metrics line at resume, Ray helpers
left behind by a killed Flower simulation, and one that Ctrl-C did not end. The commands run in this process through
``fedhet.cli.main``, as the ``fedhet`` script does (argv in, message on stderr, exit status out), except where a
process must be killed.
"""

from __future__ import annotations

import json
import sys
from contextlib import suppress
from pathlib import Path

import pytest

from fedhet.cli import main

TINY = ["-d", "digits", "-m", "mlp", "-n", "4", "-r", "1", "-s", "run.progress=false", "-s", "partition.min_size=20"]


def fedhet(monkeypatch, capsys, *args) -> tuple[int, str]:
    """(exit status, stderr) of ``fedhet ARGS``, run by the console script's ``main``."""
    monkeypatch.setattr(sys, "argv", ["fedhet", *map(str, args)])
    with pytest.raises(SystemExit) as info:
        main()
    return info.value.code, capsys.readouterr().err


def one_line(err: str, prefix: str = "error: ") -> str:
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix), err
    return lines[0]


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (hidden ones too) with its bytes: what a refused command must leave as it was."""
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else b"<dir>" for p in folder.rglob("*")}


# ---------------------------------------------------------------------------------------------- a foreign config.json
@pytest.mark.parametrize("content", ['{"precious": true}', "[1, 2]", '{"run": null}'])
@pytest.mark.parametrize("through_link", [False, True], ids=["folder", "link to an outside folder"])
def test_resume_into_a_folder_with_a_foreign_config_json_is_one_line_and_writes_nothing(
    tmp_path, monkeypatch, capsys, content, through_link
):
    out = tmp_path / "runs"
    folder = tmp_path / "elsewhere" if through_link else out / "x"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(content)
    (folder / "notes.txt").write_text("mine")
    if through_link:
        out.mkdir()
        (out / "x").symlink_to(folder)
    before = snapshot(folder)

    code, err = fedhet(monkeypatch, capsys, "run", *TINY, "-o", out, "--name", "x", "--resume")
    line = one_line(err)
    assert code == 2 and line.endswith("config.json: not a fedhet run config"), line
    assert snapshot(folder) == before  # no lock file, no truncated log, no config written

    code, err = fedhet(monkeypatch, capsys, "resume", out / "x")  # the same check, the same words
    assert code == 2 and one_line(err).endswith("config.json: not a fedhet run config"), err
    assert snapshot(folder) == before


# ---------------------------------------------------------------------------------------------- usage errors
@pytest.mark.parametrize(
    "args, says",
    [
        (["run", "--threads", "0"], "invalid value for '--threads': 0 is not in the range x>=1."),
        (["run", "-r", "ten"], "invalid value for '--rounds' / '-r': 'ten' is not a valid integer."),
        (["run", "--resum"], "no such option '--resum'. (Did you mean one of: '--resume', '--threads'?)"),
        (["resume", "somewhere", "--threads", "0"], "invalid value for '--threads': 0 is not in the range x>=1."),
        (["list", "--markdwn"], "no such option '--markdwn'. Did you mean '--markdown'?"),
        (["report"], "missing argument 'RUNS...'."),
    ],
)
def test_a_usage_error_is_one_error_line(monkeypatch, capsys, args, says):
    code, err = fedhet(monkeypatch, capsys, *args)
    line = one_line(err)
    assert code == 2 and says in line, line
    assert line.endswith(f"Try 'fedhet {args[0]} --help' for help."), line


def test_an_option_without_its_value_is_one_error_line(monkeypatch, capsys):
    code, err = fedhet(monkeypatch, capsys, "run", "-r")
    assert code == 2 and one_line(err) == "error: option '-r' requires an argument.", err


@pytest.mark.parametrize("args, command", [(["rn"], "fedhet"), (["flower", "simulat"], "fedhet flower")])
def test_an_unknown_command_is_one_line_with_its_suggestion_once(monkeypatch, capsys, args, command):
    code, err = fedhet(monkeypatch, capsys, *args)
    line = one_line(err)
    name = {"fedhet": "run", "fedhet flower": "simulate"}[command]
    assert code == 2 and line.count(f"Did you mean {name!r}?") == 1, line
    assert line.startswith(f"error: no such command {args[-1]!r}.") and line.endswith(f"'{command} --help' for help.")


@pytest.mark.parametrize("args", [["--help"], ["run", "--help"], ["--version"]])
def test_help_and_version_still_exit_0(monkeypatch, capsys, args):
    monkeypatch.setattr(sys, "argv", ["fedhet", *args])
    try:
        main()
        code = 0
    except SystemExit as info:
        code = info.code or 0
    out = capsys.readouterr()
    assert code == 0 and out.out.strip() and not out.err, out


def test_no_command_still_prints_the_help(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["fedhet"])
    with pytest.raises(SystemExit) as info:
        main()
    out = capsys.readouterr()
    assert info.value.code == 2 and "Commands" in out.out and "error" not in out.err, out


# ----------------------------------------------------------------------------------------- plug-ins that exit on import
@pytest.mark.parametrize(
    "source, code, prefix, says",
    [
        ("import sys\nsys.exit(3)\n", 2, "error: ", "failed to load: it called sys.exit(3)"),
        ("raise SystemExit\n", 2, "error: ", "failed to load: it called sys.exit(None)"),
        ("raise KeyboardInterrupt\n", 130, "interrupted: ", "was interrupted while it loaded"),
    ],
)
@pytest.mark.parametrize("command", ["run", "list"])
def test_a_plugin_that_exits_or_is_interrupted_on_import_is_one_line_naming_it(
    tmp_path, monkeypatch, capsys, source, code, prefix, says, command
):
    plugin = tmp_path / "abrupt.py"
    plugin.write_text(source)
    args = [*TINY, "-o", tmp_path / "runs"] if command == "run" else []
    got, err = fedhet(monkeypatch, capsys, command, *args, "--plugin", plugin)
    line = one_line(err, prefix)
    assert got == code and f"plug-in file {str(plugin)!r} " in line and says in line, line
    assert "abrupt" not in sys.modules  # a later attempt imports it afresh
    assert not (tmp_path / "runs").exists()


def test_a_plugin_module_that_exits_on_import_is_one_line_naming_it(tmp_path, monkeypatch, capsys):
    (tmp_path / "abrupt_module.py").write_text("import sys\nsys.exit('bye')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    got, err = fedhet(monkeypatch, capsys, "list", "--plugin", "abrupt_module")
    line = one_line(err)
    assert got == 2 and line == "error: plug-in module 'abrupt_module' failed to load: it called sys.exit('bye')", line


# ---------------------------------------------------------------------------------------------- a stray Ctrl-C
@pytest.mark.parametrize(
    "command, target",
    [
        (["list"], "fedhet.plugins.load"),
        (["report", "."], "fedhet.results.report.load_runs"),
        (["--version"], "fedhet.plugins.fedhet_version"),  # while the arguments are read, before any command
    ],
    ids=["list", "report", "--version"],
)
def test_ctrl_c_outside_training_is_the_one_interrupted_line(monkeypatch, capsys, command, target):
    """Ctrl-C where no command says how to continue (typer alone exits 130 without a word)."""

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(target, ctrl_c)
    code, err = fedhet(monkeypatch, capsys, *command)
    assert code == 130
    assert one_line(err, "interrupted: ") == "interrupted: before the command finished; run it again"


# ---------------------------------------------------------------------------------------------- where a cell runs
def test_a_cell_records_the_same_run_workers_in_a_worker_process_and_in_this_one(tmp_path):
    """With jobs=2, two cells run in worker processes; a lone cell left to run (here: a comparison of one) runs in
    this process. Both train their clients where the cell runs, and their folders say so alike."""
    import json

    import fedhet

    setting = {
        "dataset": {"name": "digits"},
        "model": {"name": "mlp", "hidden": [16]},
        "partition": {"num_clients": 3, "min_size": 20},
        "run": {"rounds": 1, "progress": False, "workers": 0},
    }
    pool = fedhet.compare(setting, variants=["fedavg", "fedprox"], out=str(tmp_path / "pool"), jobs=2)
    here = fedhet.compare(setting, variants=["fedavg"], out=str(tmp_path / "here"), jobs=2)

    def record(result) -> tuple:
        run = json.loads((result.run_dir / "config.json").read_text())["run"]
        workers = json.loads((result.run_dir / "provenance.json").read_text())["workers"]
        return run["workers"], workers, result.summary["final"]["test_acc"]

    assert record(pool[0]) == record(here[0]) == (1, 1, pool[0].summary["final"]["test_acc"])


# ---------------------------------------------------------------------------------------------- a torn metrics line
TORN = "skipping a torn last line (a crash mid-write?)"


@pytest.mark.parametrize("how", ["run --resume", "resume"])
def test_a_torn_metrics_line_at_resume_is_one_warning_line_printed_once(tmp_path, monkeypatch, capsys, how):
    """metrics.jsonl and client_metrics.jsonl (run.client_metrics) each torn by a kill mid-write: one ``warning:``
    line each (client_metrics.jsonl's was a Python UserWarning with its source line)."""
    import warnings

    out = tmp_path / "runs"
    args = [*TINY, "-o", out, "--name", "torn", "-s", "run.client_metrics=true"]
    assert fedhet(monkeypatch, capsys, "run", *args)[0] == 0
    logs = [out / "torn" / "metrics.jsonl", out / "torn" / "client_metrics.jsonl"]
    for log in logs:
        with log.open("a") as f:
            f.write('{"round": 2, "test_a')  # killed mid-write
    command = ["run", *args, "-r", "2", "--resume"] if how == "run --resume" else ["resume", out / "torn", "-r", "2"]
    with warnings.catch_warnings(record=True) as raw:
        warnings.simplefilter("always")
        code, err = fedhet(monkeypatch, capsys, *command)
    assert code == 0 and not [str(w.message) for w in raw], err  # no Python warning (file, line and code shown)
    torn = [line for line in err.splitlines() if "torn" in line]
    assert torn == [f"warning: {log}: {TORN}" for log in logs], err
    for log in logs:
        assert {json.loads(line)["round"] for line in log.read_text().splitlines()} == {1, 2}


def test_a_torn_metrics_line_before_a_comparison_resumes_is_one_warning_line(tmp_path, monkeypatch, capsys):
    """compare reads a killed cell's metrics.jsonl to say what it would do: --dry-run gives the torn line as one
    ``warning:`` line, and a run gives it once, from the cell's resume (the check gave a Python UserWarning)."""
    import warnings

    out = tmp_path / "cmp"
    sets = ["dataset.name=digits", "model.name=mlp", "partition.num_clients=4", "partition.min_size=20"]
    sets += ["run.progress=false"]
    compare = ["compare", *(a for s in sets for a in ("-s", s)), "-v", "fedavg", "--seeds", "0", "-o", out]
    assert fedhet(monkeypatch, capsys, *compare, "-s", "run.rounds=1")[0] == 0
    metrics = out / "fedavg-s0" / "metrics.jsonl"
    (metrics.parent / "summary.json").unlink()  # killed before it wrote its summary
    with metrics.open("a") as f:
        f.write('{"round": 2, "test_a')
    outputs = []
    with warnings.catch_warnings(record=True) as raw:
        warnings.simplefilter("always")
        for extra in (["--dry-run"], []):
            code, err = fedhet(monkeypatch, capsys, *compare, "-s", "run.rounds=2", *extra)
            assert code == 0, err
            outputs.append([line for line in err.splitlines() if "torn" in line])
    assert not [str(w.message) for w in raw]
    assert outputs == [[f"warning: {metrics}: {TORN}"], [f"fedavg-s0: warning: {metrics}: {TORN}"]]


def test_a_torn_metrics_line_in_a_report_is_one_warning_line(tmp_path, monkeypatch, capsys):
    """fedhet report on a run killed mid-write: the torn line is one ``warning:`` line (it was a Python UserWarning
    with its source line), and the table shows the rounds that were written."""
    import warnings

    out = tmp_path / "runs"
    assert fedhet(monkeypatch, capsys, "run", *TINY, "-o", out, "--name", "torn")[0] == 0
    metrics = out / "torn" / "metrics.jsonl"
    with metrics.open("a") as f:
        f.write('{"round": 2, "test_a')
    with warnings.catch_warnings(record=True) as raw:
        warnings.simplefilter("always")
        code, err = fedhet(monkeypatch, capsys, "report", out)
    assert code == 0 and not [str(w.message) for w in raw], err
    assert [line for line in err.splitlines() if "torn" in line] == [f"warning: {metrics}: {TORN}"], err


# ---------------------------------------------------------------------------------------------- a killed simulation
def start_simulation(tmp_path: Path, name: str, helpers: bool = False):
    """``fedhet flower simulate`` in a process group of its own (as a terminal gives a command), once it has trained
    two rounds (and, with ``helpers``, once Ray's raylet runs under it with both of its agents); returns the process,
    its run folder and what runs under it."""
    import os
    import signal
    import subprocess
    import time

    pytest.importorskip("ray")
    pytest.importorskip("flwr")
    psutil = pytest.importorskip("psutil")
    out = tmp_path / "runs"
    args = ["flower", "simulate", *TINY, "-r", "500", "-o", out, "--name", name, "--num-cpus", "2"]
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedhet.cli", *map(str, args)],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        # Ctrl-C reaching it as it does a terminal's foreground job: a suite started in the background (`make test &`,
        # nohup) leaves SIGINT ignored, and Python keeps an ignored SIGINT ignored
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    metrics, deadline = out / name / "metrics.jsonl", time.monotonic() + 240
    under: list = []
    try:
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, last_words(proc)
            time.sleep(0.2)
        under = psutil.Process(proc.pid).children(recursive=True)
        # The raylet starts its agents itself, and an agent takes its title only once it has set itself up: on a
        # loaded machine the DashboardAgent, which no round waits for, could be untitled after two rounds (a CI run)
        missing = missing_helpers(under) if helpers else []
        while missing:
            assert proc.poll() is None and time.monotonic() < deadline, f"{missing} not seen under it"
            time.sleep(0.2)
            under = psutil.Process(proc.pid).children(recursive=True)
            missing = missing_helpers(under)
    except BaseException:
        end_group(proc, under)
        raise
    return proc, out / name, under


def last_words(proc) -> str:
    """The end of what ``proc`` wrote to stderr, once its process group has ended (reading the pipe of a running one
    would wait for it to end)."""
    end_group(proc, [])
    return proc.stderr.read()[-3000:]


# What Ray starts under a simulation's process, each known by its command line: the raylet's program, or an agent's
# title (which it takes only once it has set itself up) or, until then, its script
RAY_HELPERS = {
    "raylet": ("/raylet",),
    "DashboardAgent": ("ray::DashboardAgent", "/dashboard/agent.py"),
    "RuntimeEnvAgent": ("ray::RuntimeEnvAgent", "/runtime_env/agent/main.py"),
}


def helper_of(cmdline: list[str]) -> str | None:
    """Which of RAY_HELPERS a process with this command line is, if any (only its program and script are read: the
    raylet's own arguments name the agents' scripts)."""
    head = [word.strip() for word in cmdline[:3]]
    for helper, forms in RAY_HELPERS.items():
        if any(word.startswith(form) or word.endswith(form) for word in head for form in forms):
            return helper
    return None


def missing_helpers(processes: list) -> list[str]:
    """Those of RAY_HELPERS that no running process of ``processes`` is."""
    import psutil

    found = set()
    for p in processes:
        with suppress(psutil.NoSuchProcess, psutil.ZombieProcess):
            found.add(helper_of(p.cmdline()))
    return [helper for helper in RAY_HELPERS if helper not in found]


def alive(processes: list) -> list[tuple[int, str]]:
    """Those of ``processes`` still running (a zombie has ended)."""
    import psutil

    running = []
    for p in processes:
        with suppress(psutil.NoSuchProcess):
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                running.append((p.pid, p.name()))
    return running


def wait_for_the_end(processes: list, seconds: float) -> list[tuple[int, str]]:
    """Those of ``processes`` still running after up to ``seconds``."""
    import time

    deadline = time.monotonic() + seconds
    while alive(processes) and time.monotonic() < deadline:
        time.sleep(0.5)
    return alive(processes)


def end_group(proc, under: list) -> None:
    """Kill this test's process group and what it started (only those: a failed test leaves nothing behind)."""
    import os
    import signal

    import psutil

    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for p in under:
        with suppress(psutil.NoSuchProcess):
            p.kill()


@pytest.mark.slow  # Ray start-up: about 30 s on two cores
def test_ray_helpers_end_with_a_flower_simulation_killed_outright(tmp_path):
    """kill -9 of ``fedhet flower simulate`` once it trains: no process that was running under it survives it (Ray's
    DashboardAgent and RuntimeEnvAgent did, reparented to init). Only the processes recorded under the killed one
    are looked at, and only they are killed should the test fail."""
    proc, _, under = start_simulation(tmp_path, "killed", helpers=True)  # every one of RAY_HELPERS runs under it
    proc.kill()  # SIGKILL: nothing in it runs any more
    proc.wait()
    left = wait_for_the_end(under, 20)  # the watcher's SIGTERM, then SIGKILL after a grace of 3 s
    end_group(proc, under)
    assert not left, left


@pytest.mark.slow  # Ray start-up: about 30 s on two cores
def test_ctrl_c_ends_a_flower_simulation_promptly(tmp_path):
    """Ctrl-C (SIGINT to the terminal's process group) once ``fedhet flower simulate`` trains: exit 130 within
    seconds with one 'interrupted' line, and nothing it started left running. It printed the line and Ray ended,
    but Flower's ServerApp thread (not a daemon) went on waiting for replies and kept the process alive."""
    import os
    import signal
    import subprocess

    proc, run, under = start_simulation(tmp_path, "ctrl-c")
    try:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            # its own shutdown may take 20 s at worst (5 s for the actors, 5 for the threads, 10 for the watcher)
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            code = None
        left = wait_for_the_end(under, 30)  # Ray's helpers see the raylet go, then exit
    finally:
        end_group(proc, under)
    err = proc.stderr.read()
    assert code == 130, f"still running 60 s after Ctrl-C (exit status {code}): {err[-3000:]}"
    assert not left, left
    assert "Traceback" not in err, err
    assert [line for line in err.splitlines() if "interrupted" in line] == [
        f"interrupted: the last checkpoint is kept; continue with --resume ({run})"
    ], err


@pytest.fixture
def sigint_raises():
    """SIGINT raises KeyboardInterrupt in this process, as at a terminal, whatever the suite inherited: started in the
    background (`make test &`, nohup), it would be ignored and these tests would see no Ctrl-C at all."""
    import signal

    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_after_ctrl_c_flower_and_ray_log_nothing_until_the_simulations_threads_end(sigint_raises):
    """What made the Ctrl-C test above flaky, without Ray: Ctrl-C kills the ClientApp actors, and Flower's worker
    thread then logs the ActorDiedError with its traceback. From the SIGINT on, Flower's and Ray's records are
    dropped until the threads started in the body have ended (the main thread waits for them); fedhet's records and
    those from before the Ctrl-C pass, and afterwards Flower logs as before."""
    import logging
    import os
    import signal
    import threading
    import time

    from fedhet.flower.raysim import silent_after_ctrl_c

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(f"{record.name}: {record.getMessage()}")

    handler, loggers = Keep(), [logging.getLogger(name) for name in ("flwr", "ray", "fedhet")]
    for logger in loggers:
        logger.addHandler(handler)
    handler_before = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(KeyboardInterrupt), silent_after_ctrl_c():
            logging.getLogger("flwr").error("a ClientApp failed")  # before Ctrl-C: shown

            def actor_dies() -> None:  # once the Ctrl-C has silenced Flower (the filter is on the handlers)
                deadline = time.monotonic() + 30
                while not handler.filters and time.monotonic() < deadline:
                    time.sleep(0.01)
                logging.getLogger("flwr").error("ActorDiedError: the actor died unexpectedly")
                logging.getLogger("fedhet").error("still shown")

            worker = threading.Thread(target=actor_dies)
            worker.start()
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the signal interrupts this
        assert not worker.is_alive()  # waited for, so its record came while Flower was silenced
        logging.getLogger("ray.worker").error("after the body")  # the filter is gone again
        logging.getLogger("fedhet").error("fedhet's own")
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
    assert seen == [
        "flwr: a ClientApp failed",
        "fedhet: still shown",
        "ray.worker: after the body",
        "fedhet: fedhet's own",
    ]
    assert signal.getsignal(signal.SIGINT) is handler_before


def test_threads_a_ctrl_c_leaves_blocked_are_abandoned_and_the_cli_ends_without_them(monkeypatch, sigint_raises):
    """The other half of the flaky Ctrl-C test: Flower's worker threads can wait in ray.get forever once Ray is shut
    down under them, and Python's exit waits for every non-daemon thread, so the process printed 'interrupted' and
    never ended. Threads still running after the grace period are abandoned(), and the CLI then exits 130 at once
    (os._exit, after flushing) instead of waiting for them."""
    import os
    import signal
    import threading

    import fedhet.cli as cli
    from fedhet.flower import raysim

    monkeypatch.setattr(raysim, "GRACE_S", 0.2)
    release = threading.Event()
    try:
        with pytest.raises(KeyboardInterrupt), raysim.silent_after_ctrl_c():
            blocked = threading.Thread(target=release.wait)  # as ray.get on a task of a dead actor
            blocked.start()
            os.kill(os.getpid(), signal.SIGINT)
            release.wait(5)  # the signal interrupts this
        assert raysim.abandoned() == [blocked]
        exits = []
        monkeypatch.setattr(cli.os, "_exit", lambda code: exits.append(code) or sys.exit(code))
        with pytest.raises(SystemExit):
            cli._exit_interrupted("the last checkpoint is kept")
        assert exits == [130]
    finally:
        release.set()
    blocked.join(5)
    assert raysim.abandoned() == []  # a thread that ended is no longer abandoned: a later Ctrl-C exits normally


def test_flowers_backend_shuts_ray_down_only_once_no_thread_waits_in_it(monkeypatch):
    """The third way the Ctrl-C test failed: Flower shut Ray down while a worker thread still waited in ray.get on
    a ClientApp task, and the destroyed core worker ended the process with status 1 and a C++ stack trace. The
    backend fedhet gives Flower kills the busy actors, waits for the threads to leave process_message, then shuts
    down; a message after that is refused without reaching Ray. A stand-in for Ray: a task ends when killed."""
    import threading
    from types import SimpleNamespace

    from fedhet.flower import raysim

    events: list[str] = []
    running = threading.Event()
    killed = threading.Event()

    class Flower:  # RayBackend's part the subclass relies on
        def __init__(self) -> None:
            self.pool = SimpleNamespace(_future_to_actor={})

        def process_message(self, message, context):
            self.pool._future_to_actor["future"] = "actor"
            running.set()
            killed.wait(5)  # ray.get on the actor's task
            events.append("the worker left ray.get")
            raise RuntimeError("ActorDiedError")

        def terminate(self) -> None:
            events.append("ray.shutdown")

    monkeypatch.setattr(raysim, "_kill", lambda actors: (events.append(f"kill {actors}"), killed.set()))
    backend = raysim.orderly(Flower)()
    worker = threading.Thread(target=lambda: _swallow(backend.process_message, "m", "c"))
    worker.start()
    assert running.wait(5)
    backend.terminate()
    worker.join(5)
    # terminate kills the busy actors again every 0.2 s until the thread has left, so a slow thread sees more kills
    assert events[0] == "kill ['actor']"
    assert [event for event in events if not event.startswith("kill")] == ["the worker left ray.get", "ray.shutdown"]
    with pytest.raises(RuntimeError, match="shutting down"):
        backend.process_message("late", "c")
    assert events[-1] == "ray.shutdown"  # the late message never reached Flower's Ray code


def _swallow(call, *args) -> None:
    with suppress(RuntimeError):
        call(*args)


REAPED = """
import subprocess, sys, time
from fedhet.flower.reaper import reaped_on_death

with reaped_on_death():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    print(child.pid, flush=True)
    time.sleep(float(sys.argv[1]))
"""


def _ended(pid: int) -> bool:
    """Gone, or a zombie no one has reaped yet (in a container, init may not reap)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


@pytest.mark.parametrize("killed", [True, False])
def test_the_watcher_ends_what_a_killed_process_started_and_leaves_a_finished_ones(tmp_path, killed):
    """reaped_on_death without Ray: a process killed outright takes what it started with it (the watcher notes it
    and ends it); one that ends normally says so, and the watcher touches nothing it started."""
    import os
    import signal
    import subprocess
    import sys
    import time

    pytest.importorskip("psutil")
    proc = subprocess.Popen([sys.executable, "-c", REAPED, "120" if killed else "1"], stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    try:
        if killed:
            time.sleep(1.0)  # the watcher lists the processes under its parent every 0.2 s
            proc.kill()
        proc.wait(timeout=30)  # a normal end waits for the watcher, so whatever it would do is done
        deadline = time.monotonic() + (15 if killed else 0)
        while not _ended(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _ended(child) == killed
    finally:
        if not _ended(child):
            os.kill(child, signal.SIGKILL)


# ------------------------------------------------------------------------------------------- without the flower extra
@pytest.mark.parametrize("command", ["app", "simulate"])
def test_flower_commands_without_flower_say_how_to_install_it(tmp_path, monkeypatch, capsys, command):
    """A bare install (no extras) has no flwr: `fedhet flower app/simulate` is one line naming the extra."""
    monkeypatch.setitem(sys.modules, "flwr", None)  # import flwr fails and find_spec finds nothing, as without it
    args = [tmp_path / "app"] if command == "app" else []
    code, err = fedhet(monkeypatch, capsys, "flower", command, *args, *TINY)
    line = one_line(err)
    assert code == 2 and line.endswith("needs Flower (flwr), not installed: pip install 'fedhet[flower]'"), line
    assert not any(tmp_path.iterdir())

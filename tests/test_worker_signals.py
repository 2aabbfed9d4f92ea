"""Worker processes (``run.workers``, ``compare --jobs``) under Ctrl-C and kill -9: one line, exit status 130, and
nothing left outside the run folder (multiprocessing's ``/tmp/pymp-*`` folder included), whenever it comes."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,  # each test starts fedhet and two workers (torch imports): 10-30 s on a shared 2-core machine
    pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the worker processes in /proc"),
]

COMMON = ["-d", "digits", "-m", "mlp", "-n", "4", "-r", "100000", "-s", "run.progress=false", "--threads", "1"]
COMMANDS = {
    "run": ["run", *COMMON, "-s", "run.workers=2"],
    "compare": ["compare", *COMMON, "-v", "fedavg,fedprox", "--jobs", "2"],
}
INTERRUPTED = {
    "run": "interrupted: the last checkpoint is kept; continue with --resume or: fedhet resume ",
    "compare": "interrupted: every cell keeps its last checkpoint; run the same command again to continue",
}


@pytest.fixture(autouse=True)
def _short_temp_folders():
    """Each test's temporary folder lies in the system's own (a socket path in it must fit in 107 bytes, and pytest's
    tmp_path under xdist does not leave room: workers.check_socket_folder); ``tmp`` in the test's folder links to it."""
    yield
    while SHORT:
        shutil.rmtree(SHORT.pop(), ignore_errors=True)


SHORT: list[str] = []


def start(argv: list[str], cwd: Path) -> subprocess.Popen:
    """Python in its own process group (a terminal's foreground job, which Ctrl-C signals as a whole) with a temporary
    folder of its own, so what it leaves there is seen."""
    SHORT.append(tempfile.mkdtemp(prefix="fedhet-"))
    (cwd / "tmp").symlink_to(SHORT[-1])
    return subprocess.Popen(
        [sys.executable, *argv],
        cwd=cwd,
        env={**os.environ, "TMPDIR": SHORT[-1], "COLUMNS": "200"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        # Ctrl-C reaching it as it does a foreground job: a shell that starts the tests in the background leaves
        # SIGINT ignored, and Python keeps an ignored SIGINT ignored
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def workers_of(pid: int) -> list[int]:
    """The spawned worker processes of ``pid`` (not multiprocessing's resource tracker)."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []
    found = []
    for child in map(int, children):
        try:
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(child)
        except OSError:
            pass
    return found


def catches_sigint(pid: int) -> bool:
    """Whether Python's own SIGINT handler (KeyboardInterrupt) is installed in the process: true from its start-up
    until a worker ignores SIGINT, after its imports (torch's take seconds)."""
    try:
        status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    except (OSError, ValueError):
        return False
    bit = 1 << (signal.SIGINT - 1)
    return bool(int(status["SigCgt"], 16) & bit) and not int(status["SigIgn"], 16) & bit


def wait_until(proc: subprocess.Popen, ready, what: str, limit: float = 240) -> None:
    deadline = time.monotonic() + limit
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            pytest.fail(f"never {what} (exit {proc.returncode}):\n{out}\n{err[-3000:]}")
        time.sleep(0.02)


def finish(proc: subprocess.Popen) -> tuple[str, str]:
    """What it printed, once it and every process that holds its output (workers, resource tracker) ended."""
    try:
        return proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"still running 120 s after the signal:\n{out}\n{err[-3000:]}")


def group_gone(pgid: int, limit: float = 15) -> bool:
    """No process of the group is left (one that just ended may be a zombie for a moment, until it is reaped)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def checkpointed(out: Path) -> bool:
    return any(out.glob("*/checkpoints/last.pt"))


@pytest.mark.slow
@pytest.mark.parametrize("when", ["workers importing", "workers training"])
@pytest.mark.parametrize("command", ["run", "compare"])
def test_ctrl_c_is_one_line_and_exit_130_and_leaves_nothing(tmp_path, command, when):
    out = tmp_path / "out"
    proc = start(["-m", "fedhet.cli", *COMMANDS[command], "-o", str(out)], tmp_path)
    if when == "workers importing":  # a worker's Python is up and it has not yet set its own SIGINT handling
        wait_until(proc, lambda: any(map(catches_sigint, workers_of(proc.pid))), "started a worker")
    else:
        wait_until(proc, lambda: checkpointed(out), "wrote a checkpoint")
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the terminal signals every process of the group
    _, err = finish(proc)
    assert proc.returncode == 130, err[-3000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(INTERRUPTED[command]), err[-3000:]
    assert group_gone(proc.pid)
    assert list((tmp_path / "tmp").iterdir()) == []  # nothing outside the run folder


@pytest.mark.slow
@pytest.mark.parametrize("command", ["run", "compare"])
def test_kill_9_of_the_parent_ends_its_workers_and_leaves_nothing(tmp_path, command):
    out = tmp_path / "out"
    proc = start(["-m", "fedhet.cli", *COMMANDS[command], "-o", str(out)], tmp_path)
    wait_until(proc, lambda: checkpointed(out) and len(workers_of(proc.pid)) == 2, "trained in two workers")
    assert list((tmp_path / "tmp").glob("pymp-*"))  # multiprocessing's folder exists while the workers run
    os.kill(proc.pid, signal.SIGKILL)
    _, err = finish(proc)  # returns once the workers (and the resource tracker) ended too
    assert proc.returncode == -signal.SIGKILL
    assert "Traceback" not in err and "leaked" not in err, err[-3000:]
    assert group_gone(proc.pid)
    assert list((tmp_path / "tmp").iterdir()) == []  # the workers removed the folder their parent could not


SHUTDOWN = """
import os
import signal

import fedhet
from fedhet.engine import workers

real = workers.WorkerPool.close


def close(self, now=False):
    if not now:  # Ctrl-C while the workers stop at exit
        os.kill(os.getpid(), signal.SIGINT)
    real(self, now)


workers.WorkerPool.close = close
setting = {"dataset": {"name": "digits"}, "model": {"name": "mlp", "hidden": [16]},
           "partition": {"num_clients": 4}, "run": {"rounds": 1, "progress": False, "workers": 2}}
print(fedhet.run(setting, out="runs").summary["status"])
"""


@pytest.mark.slow
def test_ctrl_c_while_the_workers_stop_at_exit_is_one_line_and_exit_130(tmp_path):
    """Python would print "Exception ignored in atexit callback" with a traceback, and exit 0."""
    proc = start(["-c", SHUTDOWN], tmp_path)
    out, err = finish(proc)
    assert out.strip() == "finished"
    assert proc.returncode == 130, err[-3000:]
    assert err.strip().splitlines() == [
        "interrupted: while the worker processes stopped; the run's files were complete"
    ], err[-3000:]
    assert group_gone(proc.pid)
    assert list((tmp_path / "tmp").iterdir()) == []


class _Ended(Exception):
    """Stands in for ``os._exit`` in ``orphaned``."""


@pytest.mark.parametrize("parent_killed", [True, False])
def test_a_helper_threads_error_after_the_parent_was_killed_ends_the_worker_without_a_traceback(
    monkeypatch, parent_killed
):
    """multiprocessing's resource sharer reports a connection the killed parent cut in mid-handshake through
    ``sys.excepthook``, from its own thread, a moment before the worker notices the parent's end: the worker ends as
    the kill would, silently; while the parent lives, an error is reported as before."""
    from fedhet.engine import workers

    reported = []

    def orphaned():
        raise _Ended

    monkeypatch.setattr(workers, "parent_gone", lambda timeout=1.0: parent_killed)
    monkeypatch.setattr(workers, "orphaned", orphaned)
    hook = workers.quiet_when_orphaned(lambda *args: reported.append(args))
    error = ConnectionResetError("reset by peer")
    if parent_killed:
        with pytest.raises(_Ended):
            hook(type(error), error, None)
        assert reported == []
    else:
        hook(type(error), error, None)
        assert reported == [(type(error), error, None)]


def _hooks_of_a_started_worker(queue) -> None:
    from fedhet.engine import workers

    workers.worker_started()
    queue.put((sys.excepthook.__qualname__, threading.excepthook.__qualname__))


def test_a_worker_process_reports_through_the_quiet_hooks():
    from fedhet.engine import workers

    queue = workers.CONTEXT.Queue()
    proc = workers.CONTEXT.Process(target=_hooks_of_a_started_worker, args=(queue,))
    proc.start()
    hooks = queue.get(timeout=60)
    proc.join(timeout=60)
    assert hooks == ("quiet_handover.<locals>.excepthook", "quiet_when_orphaned.<locals>.excepthook")


def _raised_in(filename: str, error: BaseException) -> tuple:
    """(type, value, traceback) of ``error`` raised by code that says it is in ``filename``."""
    try:
        exec(compile("raise error", filename, "exec"), {"error": error})
    except BaseException as raised:
        return type(raised), raised, raised.__traceback__
    raise AssertionError("not raised")


def test_a_connection_cut_while_shared_memory_is_handed_over_is_not_a_traceback():
    """Ctrl-C stops the workers while the parent's resource sharer hands one a tensor's shared memory: the sharer's
    thread reported the reset connection through sys.excepthook, a traceback under the one 'interrupted' line. Only
    a cut connection in the sharer is dropped; any other error, or one from elsewhere, is reported as before."""
    from fedhet.engine import workers

    reported = []
    hook = workers.quiet_handover(lambda *args: reported.append(args[0]))
    sharer = "/usr/lib/python3/multiprocessing/resource_sharer.py"
    hook(*_raised_in(sharer, ConnectionResetError(104, "Connection reset by peer")))
    hook(*_raised_in(sharer, EOFError()))
    assert reported == []
    hook(*_raised_in(sharer, ValueError("a real fault")))
    hook(*_raised_in("/somewhere/else.py", ConnectionResetError(104, "Connection reset by peer")))
    assert reported == [ValueError, ConnectionResetError]


def test_a_temporary_folder_too_long_for_a_socket_is_one_error_line(tmp_path, monkeypatch):
    """Worker processes get their clients' tensors through shared memory whose descriptors pass over a socket in
    multiprocessing's temporary folder: under a TMPDIR too long for a socket path, binding it failed while pickling,
    and the run said 'worker process 0 died while it set up'."""
    import multiprocessing.util

    from fedhet.engine import workers
    from fedhet.errors import ConfigError

    long = "/tmp/" + "x" * (workers.SOCKET_PATH_MAX - workers.LISTENER_NAME - len("/tmp/") + 1)
    monkeypatch.setattr(multiprocessing.util, "get_temp_dir", lambda: long)
    with pytest.raises(ConfigError, match=r"set TMPDIR to a shorter folder, or train in this process"):
        workers.check_socket_folder()
    monkeypatch.setattr(multiprocessing.util, "get_temp_dir", lambda: long[:-1])
    workers.check_socket_folder()  # one byte shorter: the socket fits


def test_a_run_with_workers_under_a_long_tmpdir_is_refused_in_one_line(tmp_path):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    argv = ["-m", "fedhet.cli", "run", "-d", "digits", "-m", "mlp", "-n", "4", "-r", "1", "-s", "run.workers=2"]
    argv += ["-o", str(tmp_path / "out")]
    proc = subprocess.run(
        [sys.executable, *argv],
        env={**os.environ, "TMPDIR": str(deep), "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("error: worker processes cannot get their data through the temporary folder")


def test_a_ctrl_c_in_another_thread_during_a_workers_start_is_raised_after_it():
    """The kernel may deliver a Ctrl-C to any thread that does not block it; Python then raises KeyboardInterrupt in
    the main thread, which must not happen in the middle of a worker's start (the worker would fail to read its
    preparation data and print a traceback): it is raised once the start is over."""
    import threading

    from fedhet.engine import workers

    finished = False
    with pytest.raises(KeyboardInterrupt), workers._sigint_held():
        other = threading.Thread(target=os.kill, args=(os.getpid(), signal.SIGINT))
        other.start()
        other.join()
        time.sleep(0.1)  # many bytecode boundaries: an undeferred handler would raise here
        finished = True
    assert finished


def test_a_ctrl_c_while_a_message_is_handed_over_is_raised_after_it():
    """Sending or receiving a message builds torch's shared-memory bookkeeping in several steps; a KeyboardInterrupt
    between two of them left a half-built ``StorageWeakRef`` whose finaliser printed a traceback after the one line.
    A Ctrl-C in the middle is raised once the hand-over is complete, with the message intact."""
    import multiprocessing

    import torch

    from fedhet.engine import workers

    sent = torch.arange(6.0)
    a, b = multiprocessing.Pipe()
    received, handler = None, signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt), workers._sigint_deferred():
        a.send(sent)
        signal.raise_signal(signal.SIGINT)
        time.sleep(0.1)  # many bytecode boundaries: an undeferred handler would raise here
        received = b.recv()
    assert torch.equal(received, sent)
    assert signal.getsignal(signal.SIGINT) is handler

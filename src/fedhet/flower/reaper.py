"""Ray's helper processes end with the simulation that started them, even when it is killed outright.

On Linux, Ray ties gcs_server and the raylet to the process that called ``ray.init`` (the kernel kills them when it
dies), but the raylet's own helpers, ``DashboardAgent`` and ``RuntimeEnvAgent``, notice the raylet's death and then
wait on the dead GCS for a minute or more before they exit: a ``fedhet flower simulate`` killed with ``kill -9`` left
them running, reparented to init. ``reaped_on_death`` starts a small watcher process beside the simulation: while
the simulation runs it notes every process started under it, and if the simulation dies without saying it is done,
it ends those that are still running (SIGTERM, then SIGKILL). A simulation that ends normally (also by Ctrl-C)
tells the watcher, which then ends nothing: Ray has shut its processes down itself.

The watcher runs as ``python -m fedhet.flower.reaper PID`` in a session of its own, so Ctrl-C in a terminal (meant
for the simulation) does not reach it; it reads the simulation's death from its stdin reaching end of file. The
simulation starts once the watcher has said that it watches, so nothing it starts escapes the watcher's notice.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress

DONE = b"done\n"  # what a simulation that ended normally writes to the watcher
WATCHING = b"watching\n"  # what the watcher writes once it lists the simulation's processes
INTERVAL_S = 0.2  # how often the watcher lists the simulation's processes
GRACE_S = 3.0  # how long a helper has to exit after SIGTERM before SIGKILL


@contextmanager
def reaped_on_death() -> Iterator[None]:
    """Run the body with a watcher that ends the processes started under this one if this process dies first."""
    try:
        import psutil  # noqa: F401  (the flower extra installs it; without it there is no watcher)
    except ImportError:
        yield
        return
    watcher = subprocess.Popen(
        [sys.executable, "-m", "fedhet.flower.reaper", str(os.getpid())],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    # the body starts once the watcher watches (its Python start-up takes a second on a loaded machine): a process
    # killed in that second would have left what it started running; end of file if the watcher failed to start
    watcher.stdout.readline()
    watcher.stdout.close()
    try:
        yield
    finally:
        with suppress(OSError):
            watcher.stdin.write(DONE)
            watcher.stdin.close()
        try:
            watcher.wait(timeout=10)
        except subprocess.TimeoutExpired:
            watcher.kill()
            watcher.wait()


def watch(parent_pid: int) -> None:
    """Note the processes started under ``parent_pid`` (after this watcher) until stdin closes; unless the parent
    wrote DONE first, end those still running. psutil identifies a process by its pid and start time, so a pid the
    system has reused since is never touched."""
    import psutil

    try:
        parent = psutil.Process(parent_pid)
    except psutil.NoSuchProcess:
        return
    ended, said = threading.Event(), []

    def read() -> None:
        said.append(sys.stdin.buffer.readline())
        ended.set()

    threading.Thread(target=read, daemon=True).start()
    seen: dict[int, psutil.Process] = {}
    # what was running under the parent before the watcher (the watcher too) is not the simulation's (a process is its
    # pid and start time since boot, so no clock adjustment can make a new one look old)
    before = set(_under(parent))
    with suppress(OSError):  # the parent's read end is closed once it has read the line
        sys.stdout.buffer.write(WATCHING)
        sys.stdout.buffer.flush()
    while not ended.wait(INTERVAL_S):
        for child in _under(parent):
            if child not in before:
                seen.setdefault(child.pid, child)
    if said == [DONE]:
        return
    left = [p for p in seen.values() if p.is_running()]
    for process in left:
        with suppress(psutil.Error):
            process.terminate()
    _, alive = psutil.wait_procs(left, timeout=GRACE_S)
    for process in alive:
        with suppress(psutil.Error):
            process.kill()


def _under(parent) -> list:
    """The processes running under ``parent`` now (none once it is gone)."""
    import psutil

    try:
        return parent.children(recursive=True)
    except psutil.Error:
        return []


if __name__ == "__main__":
    watch(int(sys.argv[1]))

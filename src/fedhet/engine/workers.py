"""Clients trained in parallel worker processes, with results identical to training them one after another.

``ProcessExecutor`` is a ``LocalExecutor`` whose ``run_phase`` hands the round's clients to a pool of worker
processes. Each worker builds the same ``ClientRunner`` as the simulation (``build_training``) and trains one client
at a time with one intra-op thread. A client's reply depends only on (config, message, data, state), and its random
streams on (seed, round, client, phase), so the results are bit-identical to the sequential executor run with one
thread, whatever the number of workers and whichever worker trains which client.

* Data: all clients' tensors are packed once into four shared-memory tensors (``SharedClients``); workers see them
  as views, so the data exists once however many workers there are.
* State: the parent keeps the state store. It sends a client's state with its task and writes the new state back when
  the client finished cleanly, exactly as ``LocalExecutor`` does, so no write is lost or doubled.
* Failures: a client that raises is a failure record, as in-process. A worker that dies (killed, out of memory) is a
  failure of the client it was training; a new worker replaces it and the round goes on.
* Ctrl-C: workers never see SIGINT (they start with it blocked and then ignore it, so a Ctrl-C while they import is
  no traceback there); the parent stops them all and re-raises, leaving the last checkpoint to resume from. A
  Ctrl-C while the workers are stopped at exit is one line and exit status 130.

Workers are started with ``spawn`` (fork is unsafe once torch's thread pools exist) and kept for the life of the
process, keyed by their number, so consecutive runs (a comparison's cells, the tests) pay their start-up once.

``CONTEXT`` starts every fedhet worker process (these and ``fedhet compare``'s cells, fedhet/cells.py). Its processes
never import the caller's ``__main__``: a script without ``if __name__ == "__main__":`` and a notebook work as a
module does (a worker needs only fedhet and the plug-ins its config names), and ``check_workers_can_build`` refuses,
before any starts, a component registered in ``__main__``, which no worker could find. They share this process's
multiprocessing temporary folder (``/tmp/pymp-*``) and remove it when this process is killed outright (SIGKILL), so
nothing is left behind; on any other exit this process removes it itself.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import multiprocessing
import multiprocessing.connection
import multiprocessing.context
import multiprocessing.spawn
import multiprocessing.util
import os
import shutil
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401  (registers torch's reductions: tensors pass through shared memory)

from fedhet.algorithms.base import Message
from fedhet.config import Config
from fedhet.data.types import ClientData
from fedhet.engine.client import ClientRunner, LocalExecutor, failure_record
from fedhet.errors import ConfigError, RunFailed

# ------------------------------------------------------------------ starting worker processes
_LAUNCH = threading.Lock()


@contextlib.contextmanager
def _main_left_out() -> Iterator[None]:
    """While a process is spawned: its preparation data names no ``__main__`` to re-import. multiprocessing would
    run the caller's script again in the worker (an unguarded one would start workers there, which fails and is
    retried forever) or look for a notebook's definitions it cannot import."""
    real = multiprocessing.spawn.get_preparation_data

    def prepare(name: str) -> dict[str, Any]:
        data = real(name)
        data.pop("init_main_from_name", None)
        data.pop("init_main_from_path", None)
        return data

    multiprocessing.spawn.get_preparation_data = prepare
    try:
        yield
    finally:
        multiprocessing.spawn.get_preparation_data = real


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[None]:
    """In the main thread, a Ctrl-C that comes during the body is raised once it has ended, not in its middle.

    Pickling and unpickling a message moves its tensors through shared memory, and torch's reductions build their
    bookkeeping (``StorageWeakRef``) in several steps: a KeyboardInterrupt between two of them leaves a half-built
    object whose finaliser prints a traceback at exit, after our one line."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    handler = signal.signal(signal.SIGINT, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler if handler is not None else signal.default_int_handler)
        if pending:
            signal.raise_signal(signal.SIGINT)


@contextlib.contextmanager
def _sigint_held() -> Iterator[None]:
    """SIGINT blocked in this thread for the instant a worker is started. The worker inherits the blocked signal, so a
    Ctrl-C while it imports (torch takes seconds) is never delivered there, no KeyboardInterrupt traceback, until it
    ignores SIGINT for good (``worker_started``); here, a Ctrl-C that came meanwhile is delivered once unblocked, not
    lost. (Ignoring SIGINT here instead would lose it.)"""
    if not hasattr(signal, "pthread_sigmask"):  # Windows: no POSIX signals to inherit
        yield
        return
    # The mask holds only this thread: the kernel may hand a Ctrl-C to another thread of the process, and Python then
    # runs its handler in the main thread, raising KeyboardInterrupt in the middle of the start (between spawning
    # the worker and sending it its preparation data, which it then fails to read, with a traceback). So in the main
    # thread the handler also waits: a Ctrl-C that came meanwhile is raised again once the worker has started.
    with _sigint_deferred():
        before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, before)


def _owned_temp_dir() -> str | None:
    """This process's multiprocessing temporary folder (``/tmp/pymp-*``), created now if need be, so that the workers
    started next share it; None when it belongs to a process above this one (which removes it)."""
    folder = multiprocessing.util.get_temp_dir()
    for finalizer in list(multiprocessing.util._finalizer_registry.values()):
        ours = getattr(finalizer, "_callback", None) is multiprocessing.util._remove_temp_dir
        if ours and folder in (getattr(finalizer, "_args", None) or ()):
            return folder
    return None


# An AF_UNIX socket's path holds at most 107 bytes on Linux (103 on macOS and the BSDs). Tensors reach a worker
# through shared memory whose file descriptors pass over such a socket, a "listener-XXXXXXXX" in multiprocessing's
# temporary folder (pymp-* under TMPDIR).
SOCKET_PATH_MAX = 107 if sys.platform.startswith("linux") else 103
LISTENER_NAME = len("/listener-") + 8


def check_socket_folder() -> None:
    """Refuse, in one line, a temporary folder too long for the sockets that hand the workers their data: binding one
    fails inside pickling, where it read as a worker that died while it set up."""
    folder = multiprocessing.util.get_temp_dir()
    length = len(os.fsencode(folder)) + LISTENER_NAME
    if length > SOCKET_PATH_MAX:
        raise ConfigError(
            f"worker processes cannot get their data through the temporary folder {folder}: a socket there needs "
            f"{length} bytes of path, at most {SOCKET_PATH_MAX} fit; set TMPDIR to a shorter folder, or train in "
            "this process (run.workers=1)"
        )


class WorkerProcess(multiprocessing.context.SpawnProcess):
    """A spawned process that needs nothing from ``__main__``, starts with SIGINT blocked, and knows the temporary
    folder of the process that started it, to remove it if that process is killed outright."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        folder = _owned_temp_dir()  # before the process copies this one's multiprocessing settings (its temp folder)
        super().__init__(*args, **kwargs)
        self.parent_temp_dir = folder

    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        with _LAUNCH:
            if sys.platform != "win32":
                # started first: starting it unblocks SIGINT in this thread, which would undo _sigint_held
                from multiprocessing import resource_tracker

                resource_tracker.ensure_running()
            with _main_left_out(), _sigint_held():
                return multiprocessing.context.SpawnProcess._Popen(process_obj)


class WorkerContext(multiprocessing.context.SpawnContext):
    Process = WorkerProcess


CONTEXT = WorkerContext()


def worker_started() -> None:
    """The first thing a worker process does: Ctrl-C is the parent's to handle (a terminal sends it to the whole
    process group), and a parent killed outright (SIGKILL) takes the worker with it, and its temporary folder."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # and a Ctrl-C pending since the start is dropped
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked while it started (_sigint_held)
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(target=_exit_with, args=(parent.sentinel,), daemon=True, name="fedhet-parent").start()
    sys.excepthook = quiet_handover(quiet_when_orphaned(sys.excepthook))
    threading.excepthook = quiet_when_orphaned(threading.excepthook)


def quiet_when_orphaned(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook``, but an error raised because the parent was killed ends the worker as the kill would, with no
    traceback: multiprocessing's resource sharer (which hands the parent a tensor's shared memory) reports a
    connection cut in mid-handshake through ``sys.excepthook``, from its own thread, before ``_exit_with`` runs."""

    def excepthook(*args: Any) -> None:
        if parent_gone():
            orphaned()
        hook(*args)

    return excepthook


def parent_gone(timeout: float = 1.0) -> bool:
    """Whether the parent ended, waiting up to ``timeout`` s for it: a pipe to it reads as closed a moment before its
    end does, and it may be ending now."""
    parent = multiprocessing.parent_process()
    return parent is not None and bool(multiprocessing.connection.wait([parent.sentinel], timeout))


def _exit_with(sentinel: int) -> None:
    multiprocessing.connection.wait([sentinel])
    orphaned()


def orphaned() -> None:
    """The parent is gone: remove the temporary folder it would have removed at exit, and end at once, as a kill would
    (the checkpoints on disk are complete at every instant). fedhet's workers talk to their parent through pipes
    only, so no named semaphore is left for multiprocessing's resource tracker to warn about."""
    folder = getattr(multiprocessing.current_process(), "parent_temp_dir", None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
    os._exit(1)


def main_components(cfg: Config | dict[str, Any]) -> list[str]:
    """The components a config (or its ``to_dict()``) uses that were registered in ``__main__`` (a script or a
    notebook), as "algorithm 'x'": a worker process never imports ``__main__``, so none of them exists there."""
    from fedhet.components import component_registries

    raw = cfg.to_dict() if isinstance(cfg, Config) else cfg
    found = []
    for section, registry in component_registries():
        name = (raw.get(section) or {}).get("name")
        if not isinstance(name, str) or name not in registry:
            continue  # an unknown name is refused where the config is resolved
        module = getattr(registry.get(name).obj, "__module__", None)
        if module in ("__main__", "__mp_main__"):
            found.append(f"{registry.kind} {name!r}")
    return found


def check_workers_can_build(configs: list[Config | dict[str, Any]], alternative: str) -> None:
    """Refuse, in one line, configs whose components only ``__main__`` knows, before any worker starts."""
    found = list(dict.fromkeys(item for cfg in configs for item in main_components(cfg)))
    if found:
        script = getattr(sys.modules.get("__main__"), "__file__", None)
        where = "your script" if script and os.path.isfile(script) else "this notebook or session"
        raise ConfigError(
            f"{', '.join(found)} {'is' if len(found) == 1 else 'are'} defined in {where} (__main__), which worker "
            f"processes do not import: put {'it' if len(found) == 1 else 'them'} in a .py file and pass it as a "
            f"plug-in (plugins=['my_method.py'], or a module name), or {alternative}"
        )


# ------------------------------------------------------------------ data in shared memory
def shared_memory_short(clients: list[ClientData]) -> str | None:
    """Why the clients' data cannot go to shared memory (/dev/shm too small: Docker's default is 64 MB), or None."""
    need = sum(t.numel() * t.element_size() for c in clients for t in (c.x, c.y, c.x_test, c.y_test) if t is not None)
    try:
        free = shutil.disk_usage("/dev/shm").free
    except OSError:
        return None  # not Linux: torch picks its own shared-memory mechanism
    if need * 1.1 > free:
        return f"the data needs {need / 2**20:.0f} MB of shared memory and /dev/shm has {free / 2**20:.0f} MB free"
    return None


@dataclass
class SharedClients:
    """Every client's data as views into four shared tensors (train x/y, local test x/y)."""

    x: torch.Tensor
    y: torch.Tensor
    x_test: torch.Tensor | None
    y_test: torch.Tensor | None
    bounds: list[tuple[int, int, int, int]]  # per client: train [a, b), test [c, d)
    num_classes: int

    @classmethod
    def pack(cls, clients: list[ClientData]) -> SharedClients:
        has_test = clients[0].x_test is not None
        x = torch.cat([c.x for c in clients]).share_memory_()
        y = torch.cat([c.y for c in clients]).share_memory_()
        x_test = torch.cat([c.x_test for c in clients]).share_memory_() if has_test else None
        y_test = torch.cat([c.y_test for c in clients]).share_memory_() if has_test else None
        bounds, a, c = [], 0, 0
        for client in clients:
            b, d = a + len(client.y), c + (len(client.y_test) if has_test else 0)
            bounds.append((a, b, c, d))
            a, c = b, d
        return cls(x, y, x_test, y_test, bounds, clients[0].num_classes)

    def unpack(self) -> list[ClientData]:
        def test(t, c, d):
            return None if t is None else t[c:d]

        return [
            ClientData(self.x[a:b], self.y[a:b], self.num_classes, test(self.x_test, c, d), test(self.y_test, c, d))
            for a, b, c, d in self.bounds
        ]


# ------------------------------------------------------------------ the worker process
def _worker(conn: Connection) -> None:
    worker_started()  # the parent decides what Ctrl-C stops; a killed parent ends this worker
    try:
        _serve(conn)
    except BaseException:
        if parent_gone():  # what failed was talking to a parent that was killed: nothing to report, no traceback
            orphaned()
        raise


def _serve(conn: Connection) -> None:
    torch.set_num_threads(1)
    runner: ClientRunner | None = None
    clients: list[ClientData] = []
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):  # the parent is gone (killed): nothing to report to
            if parent_gone():  # end as a kill would, leaving none of its files to multiprocessing's finalizers
                orphaned()
            return
        if task is None:
            return
        if task[0] == "setup":
            try:
                runner, clients = _setup(*task[1:])
            except Exception as err:  # told to the parent, which raises it (as one line when a ConfigError)
                conn.send(("setup failed", type(err).__name__, str(err)))
                continue
            conn.send(("ready",))
            continue
        _, cid, rnd, phase_idx, phase, msg, state = task
        try:
            reply, new_state = runner.run(cid, rnd, phase_idx, phase, msg, clients[cid], state)
        except Exception as err:  # a failing client is reported, never the worker's end
            answer = ("failed", cid, failure_record(rnd, phase, cid, err))
        else:
            answer = ("ok", cid, reply, new_state)
        try:
            conn.send(answer)
        except OSError:  # the parent is gone
            if parent_gone():
                orphaned()
            return


def _setup(cfg_raw: dict[str, Any], fed, shared: SharedClients) -> tuple[ClientRunner, list[ClientData]]:
    from fedhet.config import build_config
    from fedhet.engine.training import build_training

    clients = shared.unpack()
    return build_training(build_config(cfg_raw), dataclasses.replace(fed, clients=clients)).runner, clients


class WorkerDied(RunFailed):
    """A worker process ended while it set up: the run stops at its last checkpoint, in one line (a worker that dies
    while it trains a client is a failed client instead, and a new worker takes its place)."""


class WorkerPool:
    """``size`` worker processes, each serving one task at a time through its own pipe."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.procs: list[Any] = [None] * size
        self.conns: list[Connection | None] = [None] * size
        self.setup_msg: tuple | None = None

    def _start(self, i: int) -> None:
        parent, child = CONTEXT.Pipe()
        proc = CONTEXT.Process(target=_worker, args=(child,), daemon=True, name=f"fedhet-worker-{i}")
        proc.start()
        child.close()
        self.procs[i], self.conns[i] = proc, parent
        if self.setup_msg is not None:
            self._setup_one(i)

    def _setup_one(self, i: int) -> None:
        try:
            with _sigint_deferred():
                self.conns[i].send(self.setup_msg)
            self.conns[i].poll(None)  # the worker may still import torch: a Ctrl-C meanwhile stops at once
            with _sigint_deferred():
                answer = self.conns[i].recv()
        except (EOFError, OSError):
            self.procs[i].join(timeout=5)
            raise WorkerDied(
                f"worker process {i} died while it set up ({_exit_reason(self.procs[i].exitcode)})"
            ) from None
        if answer[0] == "setup failed":
            _, kind, text = answer
            raise (ConfigError(text) if kind == "ConfigError" else WorkerDied(f"worker {i} failed to set up: {text}"))

    def setup(self, cfg_raw: dict[str, Any], fed, shared: SharedClients) -> None:
        check_socket_folder()
        self.setup_msg = ("setup", cfg_raw, fed, shared)
        try:
            for i in range(self.size):
                if self.procs[i] is None or not self.procs[i].is_alive():
                    self._start(i)
                else:
                    self._setup_one(i)
        except BaseException:  # Ctrl-C while the workers import, or one that could not set up: none is left
            self.close(now=True)
            raise

    def run(self, cids: list[int], make_task):
        """Yield ``("ok", cid, reply, state)`` or ``("failed", cid, record)`` for each client, as workers finish.

        ``make_task(cid)`` builds a client's task when a worker is free for it, so only the clients in training
        have their state in memory."""
        pending = list(reversed(cids))
        busy: dict[int, tuple] = {}
        try:
            while pending or busy:
                for i in range(self.size):
                    if i not in busy and pending:
                        if not self.procs[i].is_alive():  # died while idle: nothing was lost, replace it
                            self._start(i)
                        busy[i] = make_task(pending.pop())
                        # died since the check: its sentinel reports it below
                        with contextlib.suppress(OSError), _sigint_deferred():
                            self.conns[i].send(busy[i])
                ready = wait([self.conns[i] for i in busy] + [self.procs[i].sentinel for i in busy])
                for i in list(busy):
                    if self.conns[i] in ready or self.conns[i].poll():
                        try:
                            with _sigint_deferred():
                                answer = self.conns[i].recv()
                        except (EOFError, OSError):  # a dead worker reads as EOF, or as a reset connection when
                            answer = None  # it died with our task unread in its socket (seen under load)
                        if answer is not None:
                            busy.pop(i)
                            yield answer
                            continue
                    if not self.procs[i].is_alive() or self.procs[i].sentinel in ready:
                        task = busy.pop(i)
                        yield ("failed", task[1], self._died(i, task))
        except BaseException:
            self.close(now=True)  # Ctrl-C or an error here: no worker is left training
            raise

    def _died(self, i: int, task: tuple) -> dict[str, Any]:
        proc = self.procs[i]
        proc.join(timeout=5)
        code = proc.exitcode
        self._start(i)
        why = _exit_reason(code)
        _, cid, rnd, _, phase, _, _ = task
        return {
            "round": rnd,
            "phase": phase,
            "client": cid,
            "error": f"WorkerDied: the worker process training this client died ({why}); a new one replaced it",
            "where": ["fedhet.engine.workers"],
        }

    def close(self, now: bool = False) -> None:
        """Stop the workers: asked to end (each finishes its client first), or, ``now``, terminated at once."""
        for i, proc in enumerate(self.procs):
            if proc is None:
                continue
            if proc.is_alive() and not now:
                with contextlib.suppress(OSError, BrokenPipeError):
                    self.conns[i].send(None)
                proc.join(timeout=2)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=2)
            if proc.is_alive():
                proc.kill()
                proc.join()
            self.procs[i] = self.conns[i] = None
        self.setup_msg = None
        _POOLS.pop(self.size, None)


def _exit_reason(code: int | None) -> str:
    return f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"


_POOLS: dict[int, WorkerPool] = {}


def pool(size: int) -> WorkerPool:
    """The process's pool of ``size`` workers (started on first use, kept for later runs)."""
    if size not in _POOLS:
        if not _POOLS:
            sys.excepthook = quiet_handover(sys.excepthook)
        _POOLS[size] = WorkerPool(size)
    return _POOLS[size]


def quiet_handover(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook``, but a connection that ends while multiprocessing's resource sharer hands a tensor's shared memory
    to the process at its other end is not reported: that process is gone (a worker stopped by Ctrl-C, or its
    parent killed), and what follows from it (a failed client, an interrupted run) is reported where it happens.
    The sharer's thread reports such an error through ``sys.excepthook``, as a traceback on the console."""

    def excepthook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if issubclass(kind, (ConnectionError, EOFError)) and any(
            frame.f_code.co_filename.endswith("resource_sharer.py") for frame, _ in traceback.walk_tb(tb)
        ):
            return
        hook(kind, value, tb)

    return excepthook


@atexit.register
def _close_pools() -> None:
    """At exit, the kept workers are asked to end. A Ctrl-C meanwhile is one line and exit status 130, not Python's
    "Exception ignored in atexit callback" and status 0: the workers are killed, multiprocessing's own exit work
    (its temporary folder) is done, and the process ends."""
    try:
        for p in list(_POOLS.values()):
            p.close()
    except KeyboardInterrupt:
        with contextlib.suppress(ValueError):  # a second Ctrl-C cannot cut this short (main thread only)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        for p in list(_POOLS.values()):
            p.close(now=True)
        with contextlib.suppress(Exception):
            multiprocessing.util._exit_function()
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        with contextlib.suppress(Exception):
            sys.stderr.write("interrupted: while the worker processes stopped; the run's files were complete\n")
            sys.stderr.flush()
        os._exit(130)


# ------------------------------------------------------------------ the executor
class ProcessExecutor(LocalExecutor):
    """``LocalExecutor`` whose phases run in ``workers`` processes (evaluation and state stay in this process)."""

    def __init__(self, runner: ClientRunner, fed, store, cfg_raw: dict[str, Any], workers: int) -> None:
        check_workers_can_build([cfg_raw], "set run.workers = 1")
        self.shared = SharedClients.pack(fed.clients)
        fed.clients[:] = self.shared.unpack()  # this process's clients become views of the shared copy too
        super().__init__(runner, fed.clients, store)
        empty = fed.x_test.new_empty((0, *fed.x_test.shape[1:]))
        self.fed = dataclasses.replace(fed, clients=[], x_test=empty, y_test=fed.y_test[:0].clone())
        self.cfg_raw = cfg_raw
        self.workers = workers
        self.pool: WorkerPool | None = None

    def _pool(self) -> WorkerPool:
        if self.pool is None or self.pool.setup_msg is None:
            self.pool = pool(self.workers)
            self.pool.setup(self.cfg_raw, self.fed, self.shared)
        return self.pool

    def run_phase(
        self, rnd: int, phase_idx: int, phase: str, msgs: dict[int, Message]
    ) -> tuple[dict[int, Any], list[dict[str, Any]]]:
        def task(cid: int) -> tuple:
            return ("train", cid, rnd, phase_idx, phase, msgs[cid], self.store.get(cid))

        replies, failures = {}, []
        for answer in self._pool().run(self.order(list(msgs)), task):
            if answer[0] == "ok":
                _, cid, reply, state = answer
                self.store.put(cid, state)
                replies[cid] = reply
            else:
                failures.append(answer[2])
        return replies, sorted(failures, key=lambda f: f["client"])

    def close(self) -> None:
        """Keep the workers for the next run; they are stopped at exit (or by ``WorkerPool.close``)."""

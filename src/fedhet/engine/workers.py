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
* Ctrl-C: workers ignore SIGINT; the parent stops them all and re-raises, leaving the last checkpoint to resume from.

Workers are started with ``spawn`` (fork is unsafe once torch's thread pools exist) and kept for the life of the
process, keyed by their number, so consecutive runs (a comparison's cells, the tests) pay their start-up once.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import shutil
import signal
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.multiprocessing as mp

from fedhet.algorithms.base import Message
from fedhet.data.types import ClientData
from fedhet.engine.client import ClientRunner, LocalExecutor, failure_record

_CTX = mp.get_context("spawn")


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
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides what Ctrl-C stops
    torch.set_num_threads(1)
    runner: ClientRunner | None = None
    clients: list[ClientData] = []
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):  # the parent is gone (killed): nothing to report to
            return
        if task is None:
            return
        if task[0] == "setup":
            runner, clients = _setup(*task[1:])
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
            return


def _setup(cfg_raw: dict[str, Any], fed, shared: SharedClients) -> tuple[ClientRunner, list[ClientData]]:
    from fedhet.config import build_config
    from fedhet.engine.training import build_training

    clients = shared.unpack()
    return build_training(build_config(cfg_raw), dataclasses.replace(fed, clients=clients)).runner, clients


class WorkerDied(RuntimeError):
    pass


class WorkerPool:
    """``size`` worker processes, each serving one task at a time through its own pipe."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.procs: list[Any] = [None] * size
        self.conns: list[Connection | None] = [None] * size
        self.setup_msg: tuple | None = None

    def _start(self, i: int) -> None:
        parent, child = _CTX.Pipe()
        proc = _CTX.Process(target=_worker, args=(child,), daemon=True, name=f"fedhet-worker-{i}")
        proc.start()
        child.close()
        self.procs[i], self.conns[i] = proc, parent
        if self.setup_msg is not None:
            self._setup_one(i)

    def _setup_one(self, i: int) -> None:
        self.conns[i].send(self.setup_msg)
        answer = self.conns[i].recv()
        if answer[0] != "ready":  # pragma: no cover - _worker answers nothing else to a setup
            raise RuntimeError(f"worker {i} failed to set up: {answer}")

    def setup(self, cfg_raw: dict[str, Any], fed, shared: SharedClients) -> None:
        self.setup_msg = ("setup", cfg_raw, fed, shared)
        for i in range(self.size):
            if self.procs[i] is None or not self.procs[i].is_alive():
                self._start(i)
            else:
                self._setup_one(i)

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
                        with contextlib.suppress(OSError):  # died since the check: its sentinel reports it below
                            self.conns[i].send(busy[i])
                ready = wait([self.conns[i] for i in busy] + [self.procs[i].sentinel for i in busy])
                for i in list(busy):
                    if self.conns[i] in ready or self.conns[i].poll():
                        try:
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
            self.close()  # Ctrl-C or an error here: no worker is left training
            raise

    def _died(self, i: int, task: tuple) -> dict[str, Any]:
        proc = self.procs[i]
        proc.join(timeout=5)
        code = proc.exitcode
        self._start(i)
        why = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        _, cid, rnd, _, phase, _, _ = task
        return {
            "round": rnd,
            "phase": phase,
            "client": cid,
            "error": f"WorkerDied: the worker process training this client died ({why}); a new one replaced it",
            "where": ["fedhet.engine.workers"],
        }

    def close(self) -> None:
        for i, proc in enumerate(self.procs):
            if proc is None:
                continue
            if proc.is_alive():
                with contextlib.suppress(OSError, BrokenPipeError):
                    self.conns[i].send(None)
                proc.join(timeout=2)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=2)
            self.procs[i] = self.conns[i] = None
        self.setup_msg = None
        _POOLS.pop(self.size, None)


_POOLS: dict[int, WorkerPool] = {}


def pool(size: int) -> WorkerPool:
    """The process's pool of ``size`` workers (started on first use, kept for later runs)."""
    if size not in _POOLS:
        _POOLS[size] = WorkerPool(size)
    return _POOLS[size]


@atexit.register
def _close_pools() -> None:
    for p in list(_POOLS.values()):
        p.close()


# ------------------------------------------------------------------ the executor
class ProcessExecutor(LocalExecutor):
    """``LocalExecutor`` whose phases run in ``workers`` processes (evaluation and state stay in this process)."""

    def __init__(self, runner: ClientRunner, fed, store, cfg_raw: dict[str, Any], workers: int) -> None:
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

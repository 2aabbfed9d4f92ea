"""Flower's Ray-based simulation of a fedhet run: one virtual SuperNode per client, ClientApps in Ray actors.

The ServerApp and ClientApp are the deployment ones; only the runtime differs. Ray can span a cluster
(``ray start --head`` on one machine, ``ray start --address=...`` on the others, then run this with
``RAY_ADDRESS`` set), so this is the way to spread a large simulation over several machines.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import replace
from pathlib import Path
from typing import Any

from fedhet.config import Config
from fedhet.flower.app import RunOptions, make_client_app, make_server_app
from fedhet.flower.reaper import reaped_on_death
from fedhet.naming import run_dir as run_dir_of
from fedhet.results.store import read_json


def run_ray_simulation(
    cfg: Config,
    options: RunOptions | None = None,
    client_cpus: float = 1.0,
    client_gpus: float = 0.0,
    num_cpus: int | None = None,
    verbose: bool = False,
    node_state_dir: str | Path | None = None,
    node_state: bool = True,
) -> dict[str, Any]:
    """Run ``cfg`` in Flower's simulation runtime (Ray backend); returns the run's summary.

    ``client_cpus`` / ``client_gpus`` are the resources of one ClientApp worker (Ray runs
    floor(CPUs / client_cpus) workers at once); ``num_cpus`` caps what Ray may use on this machine.

    The virtual nodes keep their clients' state in a folder each under ``node_state_dir`` (default: the run folder's
    ``node_state``), so ``resume`` continues it exactly; ``node_state=False`` keeps it in Flower's Context.state
    only (lost when this Flower run ends)."""
    from flwr.simulation import run_simulation

    # Flower runs the ServerApp in a thread that is not a daemon: when Ctrl-C ends the runtime in this thread, the
    # ServerApp would wait for replies that never come and keep the process alive; ``stop`` ends it
    stop = threading.Event()
    options = replace(options or RunOptions(), stop=stop)
    # no dashboard: fedhet never shows it, and it is one more web server on this machine
    init_args: dict[str, Any] = {"include_dashboard": False, **({"num_cpus": num_cpus} if num_cpus else {})}
    if not verbose:
        # The actors' own log lines (Flower's "Manually terminating ClientAppActor" as the pool shuts down, at a
        # moment that races the driver's exit) would reach this console; a ClientApp that fails still raises here.
        init_args["log_to_driver"] = False
    run_dir = run_dir_of(cfg)
    # absolute: Ray's workers need not share this process's working directory
    root = str(Path(node_state_dir or run_dir / "node_state").expanduser().resolve()) if node_state else None
    # Ray's helpers end with this process, even killed outright; after Ctrl-C, only fedhet's own line is printed
    with warnings.catch_warnings(), reaped_on_death(), silent_after_ctrl_c(), orderly_ray_shutdown(), pythonpath_kept():
        # Ray's tip that a future release stops hiding GPUs from actors that ask for none: fedhet asks for
        # client_gpus explicitly, so the tip is noise on every run (the behaviour is left as Ray has it today).
        warnings.filterwarnings("ignore", message="Tip: In future versions of Ray", category=FutureWarning)
        try:
            run_simulation(
                server_app=make_server_app(lambda _: cfg, lambda _: options),
                client_app=make_client_app(lambda _: cfg, (lambda _: root) if root else None),
                num_supernodes=cfg.partition.num_clients,
                backend_name="ray",
                backend_config={
                    "client_resources": {"num_cpus": client_cpus, "num_gpus": client_gpus},
                    "init_args": init_args,
                },
                verbose_logging=verbose,
            )
        finally:
            stop.set()
    return read_json(run_dir / "summary.json")


@contextmanager
def pythonpath_kept() -> Iterator[None]:
    """This process's PYTHONPATH as it was before the body. Flower's Ray backend sets it to this process's sys.path
    (for Ray's workers) and leaves it so: every process the caller started afterwards would see this environment's
    packages, and a ``pip --python`` into a fresh environment would then find every requirement "already satisfied"
    and install none. Ray's workers got their copy when Ray started."""
    before = os.environ.get("PYTHONPATH")
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before


LIBRARIES = ("flwr", "ray")  # the loggers (and their children) silenced after Ctrl-C
GRACE_S = 5.0  # how long the main thread waits, after Ctrl-C, for the threads the simulation started to end
# Threads a Ctrl-C left blocked for good: Flower's workers waiting in ray.get on a task whose actor died as Ray shut
# down (no error ever comes). Python's exit waits for every such thread; ``abandoned`` lets the CLI end without it.
_ABANDONED: list[threading.Thread] = []


def abandoned() -> list[threading.Thread]:
    """The threads a Ctrl-C'd simulation left running after the grace period (alive still)."""
    return [t for t in _ABANDONED if t.is_alive()]


def _not_a_library(record: logging.LogRecord) -> bool:
    return record.name.split(".", 1)[0] not in LIBRARIES


@contextmanager
def silent_after_ctrl_c() -> Iterator[None]:
    """From a Ctrl-C (SIGINT) on, Flower and Ray log nothing, until the threads started in the body have ended (or
    ``GRACE_S`` has passed: those still running are then ``abandoned()``).

    Ctrl-C ends Ray under Flower's worker threads: a ClientApp actor dies with its owner while a message is in
    flight, and Flower's worker logs the ``ActorDiedError`` with its traceback (Ray may add an "Unhandled error"),
    before or after fedhet's one ``interrupted`` line. That is the shutdown the user asked for, not a failure. The
    SIGINT handler marks the moment before Python raises KeyboardInterrupt, so no record logged after it gets
    through; without a Ctrl-C nothing is dropped (a ClientApp that fails still shows). Only in the main thread,
    where Python runs signal handlers, and only over Python's own handler (an ignored SIGINT stays ignored)."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(previous):
        yield
        return
    seen = threading.Event()
    filtered: list[logging.Handler] = []
    before = set(threading.enumerate())

    def on_sigint(signum: int, frame: Any) -> None:
        if not seen.is_set():  # the handlers as they are now: Ray adds its own when it starts
            seen.set()
            filtered.extend({h for name in ("", *LIBRARIES) for h in logging.getLogger(name).handlers})
            for handler in filtered:
                handler.addFilter(_not_a_library)
        previous(signum, frame)

    signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if seen.is_set():  # Flower's workers log the actors' deaths as they end: they end first
            _join_new_threads(before)
        for handler in filtered:
            handler.removeFilter(_not_a_library)


def _join_new_threads(before: set[threading.Thread]) -> None:
    deadline = time.monotonic() + GRACE_S
    started = [t for t in set(threading.enumerate()) - before if not t.daemon and t is not threading.current_thread()]
    for thread in started:
        thread.join(max(0.0, deadline - time.monotonic()))
    _ABANDONED[:] = [t for t in started if t.is_alive()]


@contextmanager
def orderly_ray_shutdown() -> Iterator[None]:
    """Flower, in this block, shuts Ray down only once no worker thread is inside Ray.

    Flower's runtime stops its worker threads (an event) and at once calls ``RayBackend.terminate``, which shuts
    Ray down; a worker still waiting in ``ray.get`` on a ClientApp task then either waits forever or, when the
    driver's core worker is destroyed under it, ends the whole process with status 1 and a C++ stack trace ("The
    core worker process is not initialized yet or already shutdown"), both seen after Ctrl-C under load. Flower
    builds its backend from the module attribute when the simulation starts; this block puts a subclass there whose
    ``terminate`` first kills the actors that run a task (their ``ray.get`` fails at once), waits up to ``GRACE_S``
    for the threads to leave ``process_message``, and only then shuts Ray down; a message after that is refused
    without touching Ray. flwr 1.41.0's RayBackend and BasicActorPool (pyproject pins the version checked)."""
    from flwr.server.superlink.fleet.vce.backend import raybackend

    original = raybackend.RayBackend
    raybackend.RayBackend = orderly(original)
    try:
        yield
    finally:
        raybackend.RayBackend = original


def orderly(base: type) -> type:
    """``base`` (Flower's RayBackend) with a ``terminate`` that waits for the worker threads to leave Ray."""

    class OrderlyRayBackend(base):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._cv = threading.Condition()
            self._busy = 0  # threads inside process_message
            self._closing = False
            super().__init__(*args, **kwargs)

        def process_message(self, message: Any, context: Any) -> Any:
            with self._cv:
                if self._closing:
                    raise RuntimeError("the simulation is shutting down")
                self._busy += 1
            try:
                return super().process_message(message, context)
            finally:
                with self._cv:
                    self._busy -= 1
                    self._cv.notify_all()

        def terminate(self) -> None:
            with self._cv:
                self._closing = True
            deadline = time.monotonic() + GRACE_S
            while self._busy and time.monotonic() < deadline:
                # the actors running a task, again each time: a task submitted meanwhile gets its actor killed too
                _kill(list(getattr(self.pool, "_future_to_actor", {}).values()))
                with self._cv:
                    self._cv.wait_for(lambda: not self._busy, timeout=0.2)
            super().terminate()

    return OrderlyRayBackend


def _kill(actors: list) -> None:
    """End the actors running a task: Flower waits on them, and Ray's kill makes the wait fail at once."""
    import ray

    for actor in actors:
        with suppress(Exception):  # an actor that is gone already
            ray.kill(actor, no_restart=True)

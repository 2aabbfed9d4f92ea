"""Which executor trains a round's clients: batched in this process, in worker processes, or one after another.
Above both the executors and ``engine/training.py`` (which worker processes import), so no import runs in a circle."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fedhet.config import Config
from fedhet.data.federated import FederatedDataset
from fedhet.engine.batched import BatchedExecutor, choose_executor
from fedhet.engine.client import ClientRunner, Executor, LocalExecutor, why_uncompiled
from fedhet.engine.workers import ProcessExecutor, shared_memory_short


def build_executor(
    cfg: Config, runner: ClientRunner, fed: FederatedDataset, store: Any, workers: int, warn: Callable[[str], None]
) -> tuple[Executor, int]:
    """Batched clients, worker processes or one client after another, as ``run.executor`` and ``run.workers``
    decide; returns the executor and the worker count it really uses. Batching runs in this process: asked for, it
    wins over workers; chosen automatically, only where no workers would run (on two cores or more, workers are the
    faster way: docs/performance.md)."""
    kind, why = choose_executor(cfg, runner)
    if cfg.run.executor == "batched" and kind != "batched":
        warn(f"{why}; its clients train one after another")
    if kind == "batched" and (cfg.run.executor == "batched" or workers == 1):
        return BatchedExecutor(runner, fed.clients, store, cfg.run.max_group, compile_mode=cfg.run.compile), 1
    uncompiled = why_uncompiled(runner.algo)
    if cfg.run.compile != "off" and uncompiled:
        warn(f"run.compile = {cfg.run.compile!r}: {uncompiled}, so its local steps run uncompiled")
    short = None if workers == 1 else shared_memory_short(fed.clients)
    if short:
        warn(f"run.workers={workers} needs the data in shared memory, but {short}: clients train here")
        workers = 1
    if workers == 1:
        return LocalExecutor(runner, fed.clients, store), 1
    return ProcessExecutor(runner, fed, store, cfg.to_dict(), workers), workers


def executor_kind(executor: Executor) -> str:
    """ "batched" or "sequential" (in-process, worker processes and Flower clients give the same bits)."""
    return "batched" if isinstance(executor, BatchedExecutor) else "sequential"

"""The run folder: where it may be, what --overwrite may delete, and what provenance.json records of the machine."""

from __future__ import annotations

import os
import platform
import shutil
import time
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from fedhet.errors import ConfigError


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS has one), not the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def check_run_flags(resume: bool, overwrite: bool) -> None:
    if resume and overwrite:
        raise ConfigError("--resume continues a run and --overwrite deletes it: give one of them, not both")


OUT_DIR_ROLE = "the output folder"


def make_out_dir(out_dir: Path) -> None:
    """Make run.out_dir, after checking it can be one (fedhet/paths.py): not a file, FIFO or dangling link."""
    from fedhet.paths import check_folder

    check_folder(out_dir, "run.out_dir", creatable=True, role=OUT_DIR_ROLE)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        why = "it is a file" if out_dir.is_file() else (err.strerror or str(err))
        raise ConfigError(f"run.out_dir {str(out_dir)!r} cannot be used as {OUT_DIR_ROLE}: {why}") from None
    if not out_dir.is_dir():
        raise ConfigError(f"run.out_dir {str(out_dir)!r} cannot be used as {OUT_DIR_ROLE}: it is a file")


RUN_MARKERS = ("config.json", "metrics.jsonl", "checkpoints")
# Held (an OS file lock, gone with the process however it ends) by the process that trains the folder's run.
LOCK_FILE = ".fedhet.lock"


def lock_run_dir(folder: Path) -> FileLock | None:
    """Claim the run folder for this process, or refuse: two processes writing one run (the same command started
    twice, two sweeps over one output folder) would interleave their metrics and checkpoints. None where the folder
    cannot hold a lock (a file or a link in its place: preparing the folder refuses those with its own message)."""
    if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
        return None
    folder.mkdir(parents=True, exist_ok=True)
    lock = FileLock(folder / LOCK_FILE, timeout=0)
    try:
        lock.acquire()
    except Timeout:
        raise ConfigError(
            f"run folder {str(folder)!r} is in use: another fedhet process is training this run right now (it holds "
            f"{LOCK_FILE} there); wait for it to end or stop it, or choose another run.name or run.out_dir"
        ) from None
    return lock


def holds_run(folder: Path) -> bool:
    return any((folder / m).exists() for m in RUN_MARKERS)


def check_removable(folder: Path) -> None:
    """--overwrite may empty ``folder``: it looks like a run folder; a symbolic link is refused (deleting what it
    points to would reach outside run.out_dir, and removing the link would not replace the run)."""
    if folder.is_symlink():
        target = os.readlink(folder)
        raise ConfigError(
            f"--overwrite: run folder {str(folder)!r} is a symbolic link (to {target!r}); not deleting it or what it "
            "points to: remove the link yourself, or choose another run.name or run.out_dir"
        )
    if not folder.is_dir():
        raise ConfigError(f"--overwrite: {str(folder)!r} is a file, not a run folder; not deleting it")
    if not holds_run(folder) and any(p.name != LOCK_FILE for p in folder.iterdir()):
        raise ConfigError(
            f"--overwrite: {str(folder)!r} is not a fedhet run folder (no config.json, metrics.jsonl or "
            "checkpoints/); not deleting it: choose another run.name or run.out_dir"
        )


def remove_run_dir(folder: Path) -> None:
    """--overwrite: empty a run folder that check_removable passed, keeping the lock this process holds on it."""
    for path in folder.iterdir():  # all but this process's lock: a file removed under a lock frees it for others
        if path.name == LOCK_FILE:
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def environment() -> dict[str, Any]:
    """What can change a run's last bits or explain a difference: versions, platform and processor (the simulation
    adds the thread count its clients train with)."""
    import numpy as np
    import torch

    from fedhet import __version__  # not importlib.metadata: a source checkout on PYTHONPATH has no metadata

    return {
        "fedhet": __version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        # the processor and the kernels torch picked for it: the same code and seed on another CPU type (AVX2 vs
        # AVX-512) rounds differently, and adversarial or oscillating methods grow that to points within rounds
        "cpu": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


# what changes a run's floats when it continues elsewhere (the thread count is checked from the checkpoint)
BIT_RELEVANT = ("torch", "cpu", "cpu_capability")


def cpu_model() -> str:
    """The processor's model name (Linux /proc/cpuinfo), else what the platform module says, else 'unknown'."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def environment_changes(before: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """'key: old -> new' for each bit-relevant entry recorded in both that differs."""
    return [f"{k}: {before[k]} -> {now[k]}" for k in BIT_RELEVANT if k in before and k in now and before[k] != now[k]]

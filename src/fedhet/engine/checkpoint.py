"""Checkpoint files a run can trust: sealed with a hash, loaded without running code, with a fallback.

A checkpoint file is ``MAGIC``, the SHA-256 of the payload in hex, a newline, then the payload (``torch.save`` of
plain data: dicts, lists, strings, numbers and tensors). Reading checks the hash before anything is unpickled and
unpickles with ``weights_only=True``, so a truncated, bit-flipped or foreign file is refused with its reason and a
checkpoint from someone else cannot run code.

A folder keeps two: ``last.pt`` and ``prev.pt`` (the one before). Writing goes to a temporary file that is renamed
over ``last.pt`` after the old ``last.pt`` has been hard-linked to ``prev.pt``, so at every instant ``last.pt`` is a
complete checkpoint (or absent before the first one) and ``prev.pt`` the one before it.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fedhet.errors import FedhetError
from fedhet.results.store import fsync_dir

MAGIC = b"FEDHET-CHECKPOINT-1\n"
LAST, PREV = "last.pt", "prev.pt"


class CheckpointError(FedhetError):
    """A checkpoint cannot be used: unreadable, corrupt, or referring to state that is gone."""


@dataclass
class Loaded:
    path: Path
    state: dict[str, Any]


def write_checkpoint(folder: Path, state: dict[str, Any], rotate: bool = True) -> Path:
    """Seal ``state`` into ``folder/last.pt``; the previous ``last.pt`` becomes ``prev.pt`` when ``rotate``."""
    folder.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".ckpt-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n")
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        last = folder / LAST
        if rotate and last.exists():
            _link_over(last, folder / PREV)
        os.replace(tmp, last)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(folder)
    return last


def read_checkpoint(path: Path) -> dict[str, Any]:
    """The state sealed in ``path``; a ``CheckpointError`` says why it cannot be trusted."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise CheckpointError(f"{path}: cannot be read ({err.strerror or err})") from None
    if not data.startswith(MAGIC):
        raise CheckpointError(f"{path}: not a fedhet checkpoint (no header; truncated, or another kind of file)")
    digest, _, payload = data[len(MAGIC) :].partition(b"\n")
    if hashlib.sha256(payload).hexdigest().encode() != digest:
        raise CheckpointError(f"{path}: corrupt (its content does not match its SHA-256; truncated or modified)")
    try:
        state = torch.load(io.BytesIO(payload), weights_only=True, map_location="cpu")
    except Exception as err:  # a sealed payload that still does not load: refuse, never execute it
        raise CheckpointError(f"{path}: unreadable payload ({type(err).__name__}: {_first_line(err)})") from None
    if not isinstance(state, dict) or "round" not in state:
        raise CheckpointError(f"{path}: holds no fedhet run state")
    return state


def load_latest(folder: Path, use=None) -> tuple[Loaded | None, list[str]]:
    """The newest usable checkpoint in ``folder`` (``last.pt``, else ``prev.pt``) and why others were skipped.

    ``use(state)`` takes a checkpoint up; it may raise ``CheckpointError``, having changed nothing, for one that reads
    fine but cannot be used (client states it names are gone), and the next candidate is tried then."""
    problems = []
    for name in (LAST, PREV):
        path = folder / name
        if not path.exists():
            continue
        try:
            state = read_checkpoint(path)
        except CheckpointError as err:
            problems.append(str(err))
            continue
        try:
            if use is not None:
                use(state)
            return Loaded(path, state), problems
        except CheckpointError as err:
            problems.append(f"{path}: {err}")
    return None, problems


def remove_temporaries(folder: Path) -> None:
    """Temporary files a killed write left in ``folder``: fedhet's own, hidden and ending in ``.tmp``."""
    for tmp in folder.glob(".*.tmp") if folder.is_dir() else []:
        tmp.unlink(missing_ok=True)


def _link_over(src: Path, dst: Path) -> None:
    """Make ``dst`` another name of ``src`` atomically (copying where hard links are not supported)."""
    fd, tmp = tempfile.mkstemp(dir=dst.parent, prefix=".ckpt-", suffix=".tmp")
    os.close(fd)
    os.unlink(tmp)
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copy2(src, tmp)
    os.replace(tmp, dst)


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else ""

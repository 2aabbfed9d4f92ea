"""Per-client persistent state (SCAFFOLD's c_i, FedDyn's gradient, MOON's previous models, personal heads).

The engine owns the store; an algorithm only sees one client's state dict at a time. A client gets a copy, and the
copy is written back only when the client finishes cleanly, so a dropped client leaves its state untouched.

Three stores, chosen by ``run.client_state``:

* ``memory``: a dict of tensors. Checkpoints embed it.
* ``disk``: one file per client under the run folder; memory holds only the clients of the current round, so
  10,000 SCAFFOLD clients do not need 10,000 models in RAM. Checkpoints are hard-link snapshots of the folder (no
  data is copied: files are replaced, never rewritten, so a snapshot keeps the version it linked). A snapshot is
  deleted only once no kept checkpoint names it.
* ``auto`` (default): memory until the states exceed ``run.client_state_budget_mb``, then everything moves to disk.

Every state file is sealed like a checkpoint (``fedhet.engine.checkpoint``: a header with the payload's SHA-256,
checked on every read, ``STATE_MAGIC``), and a checkpoint records each snapshot file's SHA-256 too. Taking up a
snapshot verifies all its files before anything changes, so a damaged, truncated or swapped file makes that checkpoint
unusable (the resume falls back to ``prev.pt`` or refuses, naming the file); a damaged file read while training raises
``StateFileError``, which stops the run. Files without the header (written before fedhet sealed them) are refused.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from fedhet.engine.checkpoint import (
    STATE_MAGIC,
    CheckpointError,
    StateFileError,
    read_sealed,
    sealed_digest,
    sealed_payload,
    write_sealed,
)

State = dict[str, torch.Tensor]


def _copy(state: State) -> State:
    return {k: v.clone() for k, v in state.items()}


def state_bytes(state: State) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


class MemoryStateStore:
    def __init__(self) -> None:
        self._states: dict[int, State] = {}
        self.nbytes = 0

    def get(self, cid: int) -> State:
        return _copy(self._states.get(cid, {}))

    def put(self, cid: int, state: State) -> None:
        self.nbytes -= state_bytes(self._states.pop(cid, {}))
        if state:
            self._states[cid] = state
            self.nbytes += state_bytes(state)

    def items(self):
        return self._states.items()

    def clear(self) -> None:
        self._states, self.nbytes = {}, 0

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "memory", "states": self._states}

    def check(self, saved: dict[str, Any]) -> None:
        """Nothing to verify: the checkpoint holds the states themselves."""

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.clear()
        for cid, state in saved["states"].items():
            self.put(int(cid), state)

    def retain(self, saved: list[dict[str, Any]]) -> None:
        """Nothing to free: the checkpoints hold the states themselves."""

    def __len__(self) -> int:
        return len(self._states)


class DiskStateStore:
    """One file per client in ``root/current``; ``state_dict`` snapshots it by hard links in ``root/snapshots``.

    A snapshot is named in the checkpoint relative to ``root`` (a moved run folder stays resumable) together with
    the clients it holds and each file's SHA-256, so a checkpoint whose snapshot lost files, or holds one that is
    damaged or not the one recorded, is refused instead of resuming on empty or wrong states.
    Snapshots are freed only through ``retain``, after the checkpoints that name them have been replaced.
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.current = self.root / "current"
        self.snapshots = self.root / "snapshots"

    def _path(self, cid: int) -> Path:
        return self.current / f"{cid}.pt"

    def get(self, cid: int) -> State:
        p = self._path(cid)
        return load_state_file(p) if p.exists() else {}

    def put(self, cid: int, state: State) -> None:
        if not state:
            self._path(cid).unlink(missing_ok=True)
            return
        self.current.mkdir(parents=True, exist_ok=True)
        save_state_file(state, self._path(cid))  # replaced, never rewritten in place: snapshots keep their version

    def _clients(self) -> list[int]:
        return sorted(int(p.stem) for p in self.current.glob("*.pt")) if self.current.exists() else []

    def items(self):
        for cid in self._clients():
            yield cid, load_state_file(self._path(cid))

    def clear(self) -> None:
        """Forget every state, live or snapshotted (a run starting from round 0)."""
        shutil.rmtree(self.current, ignore_errors=True)
        shutil.rmtree(self.snapshots, ignore_errors=True)

    def state_dict(self) -> dict[str, Any]:
        name = f"{time.time_ns():020d}-{uuid.uuid4().hex[:8]}"  # names sort by creation
        snap = self.snapshots / name
        snap.mkdir(parents=True)
        clients = self._clients()
        for cid in clients:
            _link_or_copy(self._path(cid), snap / f"{cid}.pt")
        digests = [sealed_digest(snap / f"{cid}.pt", STATE_MAGIC) or "" for cid in clients]
        return {"kind": "disk", "snapshot": name, "clients": clients, "sha256": digests}

    def _snapshot(self, saved: dict[str, Any]) -> Path:
        return self.snapshots / Path(saved["snapshot"]).name  # older checkpoints stored an absolute path

    def check(self, saved: dict[str, Any]) -> None:
        """Raise ``CheckpointError`` if the snapshot ``saved`` names is gone or lost client files, and
        ``StateFileError`` (naming the file) if one of its files fails its SHA-256 or is not the one recorded."""
        if saved["kind"] != "disk":
            return
        snap = self._snapshot(saved)
        if not snap.is_dir():
            raise CheckpointError(f"the client states it refers to ({snap}) are missing")
        lost = [c for c in saved.get("clients", []) if not (snap / f"{c}.pt").exists()]
        if lost:
            raise CheckpointError(f"{snap} lost the states of clients {lost[:10]}{'...' if len(lost) > 10 else ''}")
        recorded = dict(zip(saved.get("clients", []), saved.get("sha256", []), strict=False))  # older: no digests
        for path in sorted(snap.glob("*.pt")):
            payload = sealed_payload(path, STATE_MAGIC, "fedhet client state", StateFileError)
            want = recorded.get(int(path.stem)) if path.stem.isdigit() else None
            if want and hashlib.sha256(payload).hexdigest() != want:
                raise StateFileError(
                    f"{path}: not the client state its checkpoint recorded (another SHA-256: replaced or copied here)"
                )

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.check(saved)  # before anything is changed, so a refused checkpoint leaves the store as it was
        shutil.rmtree(self.current, ignore_errors=True)
        self.current.mkdir(parents=True)
        if saved["kind"] == "memory":
            for cid, state in saved["states"].items():
                self.put(int(cid), state)
            return
        for p in self._snapshot(saved).glob("*.pt"):
            _link_or_copy(p, self.current / p.name)

    def retain(self, saved: list[dict[str, Any]]) -> None:
        """Delete the snapshots that none of the ``saved`` states (those the kept checkpoints hold) names."""
        keep = {self._snapshot(s).name for s in saved if s.get("kind") == "disk"}
        for snap in sorted(self.snapshots.iterdir()) if self.snapshots.exists() else []:
            if snap.name not in keep:
                shutil.rmtree(snap, ignore_errors=True)

    def __len__(self) -> int:
        return len(self._clients())


class AutoStateStore:
    """Memory until the states pass ``budget_bytes``, then a disk store under ``root`` for the rest of the run."""

    def __init__(self, root: str | Path, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self.disk = DiskStateStore(root)
        self.store: MemoryStateStore | DiskStateStore = MemoryStateStore()

    @property
    def on_disk(self) -> bool:
        return self.store is self.disk

    def get(self, cid: int) -> State:
        return self.store.get(cid)

    def put(self, cid: int, state: State) -> None:
        self.store.put(cid, state)
        if not self.on_disk and self.store.nbytes > self.budget:
            self.disk.clear()  # no checkpoint names a snapshot yet: all of them held the states in memory
            for other, saved in self.store.items():
                self.disk.put(other, saved)
            self.store = self.disk

    def items(self):
        return self.store.items()

    def clear(self) -> None:
        self.disk.clear()
        self.store = MemoryStateStore()

    def state_dict(self) -> dict[str, Any]:
        return self.store.state_dict()

    def check(self, saved: dict[str, Any]) -> None:
        self.disk.check(saved)  # a memory checkpoint holds its states: nothing to verify

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        if saved["kind"] == "disk":
            self.disk.load_state_dict(saved)  # checks (verifies every file) before it changes anything
            self.store = self.disk
        else:  # back before the spill: files a later round wrote must not come back when it spills again
            self.disk.clear()
            self.store = MemoryStateStore()
            self.store.load_state_dict(saved)

    def retain(self, saved: list[dict[str, Any]]) -> None:
        self.disk.retain(saved)

    def __len__(self) -> int:
        return len(self.store)


def save_state_file(state: State, path: Path) -> None:
    """Seal ``state`` into ``path`` atomically (``STATE_MAGIC``, its SHA-256, the payload): a temporary file
    ``tmp*.tmp`` in the same folder, then renamed over ``path``."""
    write_sealed(path, state, STATE_MAGIC, prefix="tmp")


def load_state_file(path: Path) -> State:
    """The state sealed in ``path``; ``StateFileError`` naming ``path`` if it is damaged, truncated or unsealed.
    Tensors come back on the device they were saved from, as ``torch.load`` gives them."""
    state = read_sealed(path, STATE_MAGIC, "fedhet client state", StateFileError, map_location=None)
    if not isinstance(state, dict):
        raise StateFileError(f"{path}: holds no client state")
    return state


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem, or links not supported
        shutil.copy2(src, dst)


def build_state_store(kind: str, root: str | Path, budget_mb: float):
    if kind == "memory":
        return MemoryStateStore()
    if kind == "disk":
        return DiskStateStore(root)
    return AutoStateStore(root, int(budget_mb * 2**20))

"""Per-client persistent state (SCAFFOLD's c_i, FedDyn's gradient, MOON's previous models, personal heads).

The engine owns the store; an algorithm only sees one client's state dict at a time. A client gets a copy, and the
copy is written back only when the client finishes cleanly, so a dropped client leaves its state untouched.

Three stores, chosen by ``run.client_state``:

* ``memory``: a dict of tensors. Checkpoints embed it.
* ``disk``: one file per client under the run folder; memory holds only the clients of the current round, so
  10,000 SCAFFOLD clients do not need 10,000 models in RAM. Checkpoints are hard-link snapshots of the folder (no
  data is copied: files are replaced, never rewritten, so a snapshot keeps the version it linked).
* ``auto`` (default): memory until the states exceed ``run.client_state_budget_mb``, then everything moves to disk.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch

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

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "memory", "states": self._states}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self._states = {}
        self.nbytes = 0
        for cid, state in saved["states"].items():
            self.put(int(cid), state)

    def __len__(self) -> int:
        return len(self._states)


class DiskStateStore:
    """One file per client in ``root/current``; ``state_dict`` snapshots it by hard links in ``root/snapshots``."""

    keep_snapshots = 2  # the newest checkpoint references one of the last two (a crash may fall between them)

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.current = self.root / "current"
        self.snapshots = self.root / "snapshots"

    def _path(self, cid: int) -> Path:
        return self.current / f"{cid}.pt"

    def get(self, cid: int) -> State:
        p = self._path(cid)
        return torch.load(p, weights_only=True) if p.exists() else {}

    def put(self, cid: int, state: State) -> None:
        if not state:
            self._path(cid).unlink(missing_ok=True)
            return
        self.current.mkdir(parents=True, exist_ok=True)
        save_state_file(state, self._path(cid))  # replaced, never rewritten in place: snapshots keep their version

    def items(self):
        for p in sorted(self.current.glob("*.pt"), key=lambda q: int(q.stem)):
            yield int(p.stem), torch.load(p, weights_only=True)

    def state_dict(self) -> dict[str, Any]:
        snap = self.snapshots / f"{time.time_ns():020d}-{uuid.uuid4().hex[:8]}"  # names sort by creation
        snap.mkdir(parents=True)
        for p in self.current.glob("*.pt") if self.current.exists() else []:
            _link_or_copy(p, snap / p.name)
        self._prune(keep=snap)
        return {"kind": "disk", "snapshot": str(snap)}

    def _prune(self, keep: Path) -> None:
        snaps = sorted(self.snapshots.iterdir())
        for old in snaps[: -self.keep_snapshots]:
            if old != keep:
                shutil.rmtree(old, ignore_errors=True)

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        shutil.rmtree(self.current, ignore_errors=True)
        self.current.mkdir(parents=True)
        if saved["kind"] == "memory":
            for cid, state in saved["states"].items():
                self.put(int(cid), state)
            return
        for p in Path(saved["snapshot"]).glob("*.pt"):
            _link_or_copy(p, self.current / p.name)

    def __len__(self) -> int:
        return len(list(self.current.glob("*.pt"))) if self.current.exists() else 0


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
            for other, saved in self.store.items():
                self.disk.put(other, saved)
            self.store = self.disk

    def items(self):
        return self.store.items()

    def state_dict(self) -> dict[str, Any]:
        return self.store.state_dict()

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.store = self.disk if saved["kind"] == "disk" else MemoryStateStore()
        self.store.load_state_dict(saved)

    def __len__(self) -> int:
        return len(self.store)


def save_state_file(state: State, path: Path) -> None:
    """Write ``state`` to ``path`` atomically: a temporary file in the same folder, then renamed over ``path``."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix="tmp", suffix=".tmp")
    os.close(fd)
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_state_file(path: Path) -> State:
    return torch.load(path, weights_only=True)


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

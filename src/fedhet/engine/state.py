"""Per-client persistent state (SCAFFOLD's c_i, FedDyn's gradient, MOON's previous model, personal heads).

The engine owns the store; an algorithm only sees one client's state dict at a time. A client gets a copy, and the
copy is written back only when the client finishes cleanly, so a dropped client leaves its state untouched.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

State = dict[str, torch.Tensor]


def _copy(state: State) -> State:
    return {k: v.clone() for k, v in state.items()}


class MemoryStateStore:
    def __init__(self) -> None:
        self._states: dict[int, State] = {}

    def get(self, cid: int) -> State:
        return _copy(self._states.get(cid, {}))

    def put(self, cid: int, state: State) -> None:
        if state:
            self._states[cid] = state
        else:
            self._states.pop(cid, None)

    def state_dict(self) -> dict[int, State]:
        return self._states

    def load_state_dict(self, states: dict[int, State]) -> None:
        self._states = {int(k): v for k, v in states.items()}

    def __len__(self) -> int:
        return len(self._states)


class DiskStateStore:
    """One file per client under ``root``; memory holds only the clients of the current round."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, cid: int) -> Path:
        return self.root / f"{cid}.pt"

    def get(self, cid: int) -> State:
        p = self._path(cid)
        return torch.load(p, weights_only=True) if p.exists() else {}

    def put(self, cid: int, state: State) -> None:
        if not state:
            self._path(cid).unlink(missing_ok=True)
            return
        fd, tmp = tempfile.mkstemp(dir=self.root, suffix=".tmp")
        os.close(fd)
        torch.save(state, tmp)
        os.replace(tmp, self._path(cid))

    def state_dict(self) -> dict[int, State]:
        return {int(p.stem): torch.load(p, weights_only=True) for p in sorted(self.root.glob("*.pt"))}

    def load_state_dict(self, states: dict[int, State]) -> None:
        for p in self.root.glob("*.pt"):
            p.unlink()
        for cid, state in states.items():
            self.put(int(cid), state)

    def __len__(self) -> int:
        return len(list(self.root.glob("*.pt")))

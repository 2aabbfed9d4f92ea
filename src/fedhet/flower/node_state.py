"""Client-held state on a Flower node: in Flower's ``Context.state`` (one Flower run), or in a state folder of the
node's own that survives Flower runs, so that a resumed fedhet run continues every client's own state exactly.

A fedhet run on Flower is one or more *attempts* (Flower runs): a fresh start, then one per ``resume``. The server
keeps the history of the attempts that led to its checkpoint and sends it with every message (``History``):

* ``run``: the run's key, a folder per fedhet run under the node's state folder;
* per attempt: its id, the round it started from and the last round it counts for. The current attempt counts
  for every round up to the message's; an earlier one for the rounds in (start, end], where ``end`` is the round of
  the checkpoint the next attempt resumed from. What a killed attempt wrote after that checkpoint belongs to no
  attempt of the history, so it is never read again, however far that attempt got;
* ``checkpoints``: the rounds of the checkpoints the server keeps (``last.pt`` and ``prev.pt``: it may resume from
  either).

A node with a state folder (``--node-config 'state-dir="/var/lib/fedhet"'``) writes each client's state after each
training as a new file ``<state-dir>/<run>/client-<id>/r<round>-p<phase>-<attempt>.pt`` (a temporary file, then
renamed: a crash leaves the previous versions intact) and reads the newest version that the history counts. A version
is sealed with the SHA-256 of its content, as a checkpoint is (``fedhet.engine.state.save_state_file``), and checked
when read: a damaged, truncated or unsealed one raises ``StateFileError`` naming the file, which the node answers
with ``DAMAGED_STATE`` and the server turns into a stopped run naming the client, the node and the file, as the
simulation stops (an older version is never silently used in its place, nor the client dropped round after round). After
writing, it deletes the client's versions that no resume can need any more: it keeps the newest counted version at
or before each kept checkpoint's round and the newest counted version overall. It never deletes anything but
version files in its own client folders.

A node without a state folder keeps the state in ``Context.state``, which ends with the Flower run: it says so in its
answer to the server's query (``durable``), and every training reply says whether the client found the state the
server expected, so the server notices lost state (``fedhet.flower.server``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from flwr.app import ConfigRecord, RecordDict

from fedhet.engine.state import State, load_state_file, save_state_file
from fedhet.errors import ConfigError
from fedhet.flower import codec

STATE_DIR_KEY = "state-dir"  # node config key of a node's state folder
# how a node's error reply starts when a client's state file fails its seal: the server stops the run on it (as the
# simulation does), rather than dropping that client from every round
DAMAGED_STATE = "damaged client state: "
ATTEMPT = re.compile(r"[0-9a-f]{1,64}")
VERSION = re.compile(r"^r(\d+)-p(\d+)-([0-9a-f]{1,64})\.pt$")
SAFE = re.compile(r"[^A-Za-z0-9._-]+")


def safe_name(text: str, limit: int = 80) -> str:
    """``text`` as one harmless path component (letters, digits, ``._-``; never empty, never ``.``/``..``)."""
    name = SAFE.sub("-", str(text)).strip(".-")[:limit]
    return name or "run"


@dataclass(frozen=True)
class Attempt:
    id: str  # hex
    start: int  # the round it resumed from (0: a fresh run)
    end: int  # the last round it counts for


@dataclass(frozen=True)
class History:
    """What a node needs to pick the right version of a client's state (see the module docstring)."""

    run: str
    attempts: tuple[Attempt, ...]
    checkpoints: tuple[int, ...]

    def counts(self, attempt: str, rnd: int) -> bool:
        """Whether a version written by ``attempt`` at round ``rnd`` belongs to this history."""
        return any(a.id == attempt and a.start < rnd <= a.end for a in self.attempts)

    def to_record(self) -> ConfigRecord:
        return ConfigRecord(
            {
                "run": self.run,
                "attempts": [a.id for a in self.attempts],
                "starts": [a.start for a in self.attempts],
                "ends": [a.end for a in self.attempts],
                "checkpoints": list(self.checkpoints),
            }
        )

    @classmethod
    def from_content(cls, content: RecordDict) -> History | None:
        record = content.get(codec.HISTORY)
        if record is None:
            return None
        ids, starts, ends = list(record["attempts"]), list(record["starts"]), list(record["ends"])
        if not all(isinstance(i, str) and ATTEMPT.fullmatch(i) for i in ids):
            raise ConfigError(f"attempt ids must be hexadecimal, got {ids}")
        attempts = tuple(Attempt(str(i), int(s), int(e)) for i, s, e in zip(ids, starts, ends, strict=True))
        return cls(str(record["run"]), attempts, tuple(int(c) for c in record["checkpoints"]))


class NodeStateStore(Protocol):
    durable: bool

    def get(self, cid: int, history: History | None) -> State: ...

    def put(self, cid: int, history: History | None, rnd: int, phase_idx: int, state: State) -> None: ...


class ContextStore:
    """State in Flower's ``Context.state``: kept between the messages of one Flower run, lost with it."""

    durable = False

    def __init__(self, records: RecordDict, device: torch.device | str = "cpu") -> None:
        self.records = records
        self.device = device

    def get(self, cid: int, history: History | None) -> State:
        return codec.load_state(self.records, cid, self.device)

    def put(self, cid: int, history: History | None, rnd: int, phase_idx: int, state: State) -> None:
        codec.save_state(self.records, cid, state)


@dataclass(frozen=True)
class Version:
    round: int
    phase: int
    attempt: str
    path: Path


class FolderStore:
    """Versions of each client's state in a folder of the node's own, chosen by the server's ``History``."""

    durable = True

    def __init__(self, root: str | Path, device: torch.device | str = "cpu") -> None:
        self.root = Path(root).expanduser()
        self.device = device

    def folder(self, run: str, cid: int) -> Path:
        return self.root / safe_name(run) / f"client-{int(cid)}"

    def versions(self, folder: Path) -> list[Version]:
        """The client's version files, oldest first."""
        out = []
        for p in folder.iterdir() if folder.is_dir() else []:
            m = VERSION.match(p.name)
            if m:
                out.append(Version(int(m[1]), int(m[2]), m[3], p))
        return sorted(out, key=lambda v: (v.round, v.phase))

    def counted(self, folder: Path, history: History) -> list[Version]:
        return [v for v in self.versions(folder) if history.counts(v.attempt, v.round)]

    @staticmethod
    def need(history: History | None) -> History:
        if history is None:
            raise ConfigError("this node keeps client state in a folder, but the server's message has no run history")
        return history

    def get(self, cid: int, history: History | None) -> State:
        versions = self.counted(self.folder(self.need(history).run, cid), self.need(history))
        if not versions:
            return {}
        return {k: v.to(self.device) for k, v in load_state_file(versions[-1].path).items()}

    def put(self, cid: int, history: History | None, rnd: int, phase_idx: int, state: State) -> None:
        history = self.need(history)
        folder = self.folder(history.run, cid)
        current = history.attempts[-1].id
        if state or self.counted(folder, history):  # an emptied state shadows the older versions
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"r{rnd:08d}-p{phase_idx:03d}-{current}.pt"
            save_state_file({k: v.detach().cpu() for k, v in state.items()}, path)
        self.prune(folder, history)

    def prune(self, folder: Path, history: History) -> None:
        """Delete the versions no resume can need: all but the newest counted one at or before each kept
        checkpoint's round and the newest counted one. Versions of attempts outside the history (what a killed attempt
        wrote after its last checkpoint, or a run started afresh) are never read again, so they go too; so do leftover
        temporaries."""
        counted = self.counted(folder, history)
        keep = {v.path for v in counted[-1:]}
        for rnd in history.checkpoints:
            keep.update(v.path for v in [v for v in counted if v.round <= rnd][-1:])
        for v in self.versions(folder):
            if v.path not in keep:
                v.path.unlink(missing_ok=True)
        for tmp in folder.glob("tmp*.tmp") if folder.is_dir() else []:  # save_state_file's leftovers
            tmp.unlink(missing_ok=True)


def node_store(context: Any, state_root: str | Path | None, device: torch.device | str = "cpu") -> NodeStateStore:
    """The node's store: its ``state-dir`` node config; else, when the ClientApp was given ``state_root`` (Flower's
    simulation, all nodes on one machine), a subfolder per node under it; else ``Context.state``."""
    node_config = dict(context.node_config)
    if STATE_DIR_KEY in node_config and str(node_config[STATE_DIR_KEY]):
        return FolderStore(str(node_config[STATE_DIR_KEY]), device)
    if state_root is not None:
        node = node_config.get("partition-id", node_config.get("partition-ids", context.node_id))
        return FolderStore(Path(state_root) / f"node-{safe_name(str(node))}", device)
    return ContextStore(context.state, device)


def state_info(found: bool, state: State) -> ConfigRecord:
    """A training reply's note on the client's state: whether it found a stored one, and what it keeps now."""
    return ConfigRecord({"found": bool(found), "keys": sorted(state)})

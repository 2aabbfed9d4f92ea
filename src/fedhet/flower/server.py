"""The ServerApp side: the engine's round loop with an executor that talks to SuperNodes through a Flower Grid.

``Simulation`` runs unchanged (client sampling, the algorithm's configure / aggregate and phases, evaluation,
metrics.jsonl, checkpoints); only the executor differs. ``FlowerExecutor`` sends each sampled client's ``Message``
to the node that holds that client and turns the replies back into ``Reply`` objects. A client whose node fails,
raises or does not answer in time is dropped from the round and recorded in failures.jsonl, as in the simulation.

Server-held per-client state (FedBC's lambda_i) lives in the algorithm object, so it is in the ServerApp's
checkpoints. Client-held state lives on the SuperNodes: in a state folder of the node's own, which survives Flower
runs, or in Flower's ``Context.state``, which does not (``fedhet.flower.node_state``). The executor's checkpointed
state is the run's history of attempts (which of the nodes' state versions a resume continues from) and which
clients keep state. Lost client state (a resume over nodes without a state folder, a node that restarted, a
deleted folder) is never passed over silently: it is written to the run folder's ``notices.jsonl``, logged as a
warning, and stops the run unless the run accepts the loss (``accept_state_loss``).
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import Message as FlowerMessage
from flwr.app import RecordDict
from flwr.serverapp import Grid

from fedhet.algorithms.base import Message, Reply
from fedhet.config import Config
from fedhet.data.federated import FederatedDataset
from fedhet.data.types import ClientData
from fedhet.engine.checkpoint import StateFileError
from fedhet.errors import FedhetError
from fedhet.flower import codec
from fedhet.flower.client import label_counts_from
from fedhet.flower.node_state import DAMAGED_STATE, Attempt, History, safe_name
from fedhet.flower.secagg import SecureAggregation
from fedhet.results.store import MetricsLog

log = logging.getLogger("fedhet.flower")


class NodeError(FedhetError):
    """The SuperNodes cannot serve this run (missing partitions, a node that rejects the config, ...)."""


@dataclass
class Nodes:
    """Which Flower node holds each client, and what the nodes told the server about their data."""

    holder: dict[int, int] = field(default_factory=dict)  # client id -> node id
    label_counts: dict[int, np.ndarray] = field(default_factory=dict)  # only for nodes with their own data files
    from_file: bool = False
    durable: dict[int, bool] = field(default_factory=dict)  # node id -> keeps client state in a state folder

    def volatile(self, cids) -> list[int]:
        """Those of ``cids`` whose node keeps their state only in Context.state (lost with the Flower run)."""
        return sorted(c for c in cids if c in self.holder and not self.durable.get(self.holder[c], False))


class Stopped(Exception):
    """The caller ended the run while the ServerApp waited on the nodes (Ctrl-C in ``fedhet flower simulate``)."""


def pause(seconds: float, stop: threading.Event | None) -> None:
    """Wait ``seconds``, or raise ``Stopped`` as soon as ``stop`` is set: the simulation runs the ServerApp in a
    thread that is not a daemon, so a thread left polling nodes that are gone would keep the process alive."""
    if stop is None:
        time.sleep(seconds)
    elif stop.wait(seconds):
        raise Stopped("the run was stopped while it waited for the nodes")


class Exchange:
    """Push messages through a Grid and pull the replies, polling quickly (replies in deployment take seconds);
    ``stop``, once set, ends the wait with ``Stopped``."""

    def __init__(
        self,
        grid: Grid,
        timeout: float | None = None,
        poll: float = 0.05,
        max_poll: float = 0.5,
        stop: threading.Event | None = None,
    ) -> None:
        self.grid = grid
        self.timeout = timeout
        self.poll = poll
        self.max_poll = max_poll
        self.stop = stop

    def __call__(self, messages: dict[Any, FlowerMessage]) -> tuple[dict[Any, FlowerMessage], dict[Any, str]]:
        """Send ``{key: message}``; returns ``({key: reply}, {key: why it has none})``. Error replies are replies."""
        keys = list(messages)
        pause(0, self.stop)
        self.grid.push_messages([messages[k] for k in keys])
        pending = {messages[k].metadata.message_id: k for k in keys if messages[k].metadata.message_id}
        missing = {k: "the SuperLink did not accept the message" for k in keys if k not in pending.values()}
        replies: dict[Any, FlowerMessage] = {}
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        wait = self.poll
        while pending and (deadline is None or time.monotonic() < deadline):
            for reply in self.grid.pull_messages(list(pending)):
                key = pending.pop(reply.metadata.reply_to_message_id, None)
                if key is not None:
                    replies[key] = reply
            if pending:
                pause(wait, self.stop)
                wait = min(wait * 1.5, self.max_poll)
        missing.update({k: f"no reply within {self.timeout} s" for k in pending.values()})
        return replies, missing


def error_text(reply: FlowerMessage) -> str:
    return f"node {reply.metadata.src_node_id}: {reply.error.reason or f'error code {reply.error.code}'}"


def discover(grid: Grid, num_clients: int, wait_s: float, stop: threading.Event | None = None) -> Nodes:
    """Ask every node which clients it holds, until all ``num_clients`` are held (or ``wait_s`` passes, or ``stop``
    is set: ``Stopped``)."""
    nodes, asked = Nodes(), set()
    deadline = time.monotonic() + wait_s
    while True:
        new = [n for n in grid.get_node_ids() if n not in asked]
        if new:
            queries = {n: FlowerMessage(RecordDict(), dst_node_id=n, message_type="query") for n in new}
            exchange = Exchange(grid, timeout=max(1.0, deadline - time.monotonic()), stop=stop)
            replies, _ = exchange(queries)  # a node that does not answer is asked again next time
            for node_id, reply in replies.items():
                asked.add(node_id)
                register(nodes, node_id, reply)
        missing = sorted(set(range(num_clients)) - set(nodes.holder))
        if not missing:
            return nodes
        if time.monotonic() > deadline:
            raise NodeError(
                f"after {wait_s:.0f} s no connected SuperNode holds clients {short(missing)} (of {num_clients}); "
                f"{len(asked)} node(s) answered, holding {short(sorted(nodes.holder))}"
            )
        pause(0.5, stop)


def register(nodes: Nodes, node_id: int, reply: FlowerMessage) -> None:
    if reply.has_error():
        raise NodeError(f"a SuperNode cannot serve this run: {error_text(reply)}")
    meta = reply.content[codec.META]
    from_file = bool(meta["from_file"])
    if nodes.holder and from_file != nodes.from_file:
        raise NodeError("some SuperNodes read data-path files and others rebuild partitions; use one kind")
    nodes.from_file = from_file
    nodes.durable[node_id] = bool(meta.get("durable", False))
    for cid in meta["cids"]:
        if cid in nodes.holder and nodes.holder[cid] != node_id:
            raise NodeError(f"client {cid} is held by two SuperNodes ({nodes.holder[cid]} and {node_id})")
        nodes.holder[int(cid)] = node_id
    if from_file:
        nodes.label_counts.update(label_counts_from(reply.content))


def short(ids: list[int], limit: int = 12) -> str:
    return str(ids) if len(ids) <= limit else f"{ids[:limit]}... ({len(ids)} in all)"


def server_federation(cfg: Config, nodes: Nodes) -> FederatedDataset:
    """The federation as the server evaluates it.

    With partitions rebuilt from the config, it is exactly the simulation's federation (same metrics). With nodes
    reading their own files, the server has the config dataset's test set and the label counts the nodes reported,
    and per-client accuracies are the distribution-weighted ones (it never sees the clients' local test data)."""
    from fedhet.data.datasets import load_dataset
    from fedhet.data.features import feature_skew
    from fedhet.data.federated import ClientInputs
    from fedhet.engine.training import build_federation

    if not nodes.from_file:
        return build_federation(cfg)
    ds = load_dataset(cfg.dataset.name, cfg.dataset.data_dir, **cfg.dataset.params())
    ds = ds.class_subset(cfg.dataset.classes)
    if not ds.has_test_set:
        raise NodeError(f"dataset {cfg.dataset.name!r} has no test set for the server to evaluate on")
    device, n = cfg.run.device, cfg.partition.num_clients
    counts = np.stack([nodes.label_counts[c] for c in range(n)])
    # the test set as the simulation scores it: normalised, and one transformed copy per domain of a feature skew
    skew = feature_skew(cfg.features.name, ds, n, **cfg.features.params())
    inputs = ClientInputs(ds, skew, n, cfg.run.seed if cfg.partition.seed is None else cfg.partition.seed, device)
    official = torch.from_numpy(np.ascontiguousarray(inputs.prepare(ds.x_test)))
    labels = torch.from_numpy(np.ascontiguousarray(ds.y_test)).long()
    x_test, y_test, test_domains = inputs.official_test(official, labels, ds.domains_test)
    no_data = ClientData(x=x_test[:0], y=torch.zeros(0, dtype=torch.long, device=device), num_classes=ds.num_classes)
    return FederatedDataset(
        name=ds.name,
        clients=[no_data] * n,
        x_test=x_test,
        y_test=y_test,
        num_classes=ds.num_classes,
        input_shape=tuple(ds.input_shape),
        train_counts=counts,
        test_source="official",
        provenance=ds.provenance(),
        **inputs.domains(test_domains),
    )


def content_state(content: RecordDict) -> tuple[bool, list[str]]:
    """A training reply's note on the client's state: (found a stored one, what it keeps now)."""
    info = content[codec.STATE_INFO]
    return bool(info["found"]), [str(k) for k in info["keys"]]


def failure(rnd: int, phase: str, cid: int, why: str) -> dict[str, Any]:
    """A failures.jsonl record, with the same keys as the simulation's."""
    return {"round": rnd, "phase": phase, "client": cid, "error": why, "where": ["flower"]}


class StateLost(NodeError):
    """Client-held state that the run needs is gone, and the run was not told to accept that."""


class FlowerExecutor:
    """Runs a phase by sending each client's message to the node that holds it (``fedhet.engine.client.Executor``).

    ``run_name`` names the run's folder on nodes with a state folder; ``notices`` is the run folder's
    notices.jsonl; ``accept_state_loss`` lets a run go on when client-held state is lost (see ``state_lost``)."""

    def __init__(
        self,
        grid: Grid,
        nodes: Nodes,
        exchange: Exchange,
        device: torch.device | str = "cpu",
        run_name: str = "run",
        notices: str | Path | None = None,
        accept_state_loss: bool = False,
        secure: SecureAggregation | None = None,
    ) -> None:
        self.grid = grid
        self.secure = secure  # SecAgg+ (fedhet.flower.secagg): training replies carry only the secure average
        self.nodes = nodes
        self.exchange = exchange
        self.device = device
        self.notices = None if notices is None else Path(notices)
        self.accept_state_loss = accept_state_loss
        # The run's history of attempts (node_state.History): a fresh run is one attempt starting at round 0; a
        # resume replaces run and history with the checkpoint's and adds this attempt.
        self.run = f"{safe_name(run_name, 60)}-{uuid.uuid4().hex[:12]}"
        self.attempt = uuid.uuid4().hex[:16]
        self.history: list[dict[str, Any]] = []  # earlier attempts: {"id", "start", "end"}
        self.start = 0  # the round this attempt resumed from
        self.round = 0  # the last round this attempt sent messages for
        self.checkpoints: tuple[int, ...] = ()  # the rounds of the checkpoints the server keeps (see retain)
        self.with_state: set[int] = set()  # clients whose node keeps client-held state for them
        self.state_keys: set[str] = set()  # what that state is (SCAFFOLD: c_i)
        self.told_volatile = False

    # ------------------------------------------------------------------ messages
    def current_history(self, rnd: int) -> History:
        attempts = [Attempt(a["id"], int(a["start"]), int(a["end"])) for a in self.history]
        return History(self.run, (*attempts, Attempt(self.attempt, self.start, rnd)), self.checkpoints)

    def messages(self, kind: str, rnd: int, msgs: dict[int, Message], meta: dict[str, Any]) -> dict[int, FlowerMessage]:
        self.round = max(self.round, rnd)
        history = self.current_history(rnd).to_record()
        encoded: dict[int, Any] = {}  # a message sent unchanged to many clients is encoded once
        out = {}
        for cid, msg in msgs.items():
            tensors = encoded.setdefault(id(msg), codec.tensors_to_record(msg.tensors))
            content = codec.encode_message(msg, {"cid": cid, "round": rnd, **meta}, tensors)
            content[codec.HISTORY] = history
            out[cid] = FlowerMessage(content, dst_node_id=self.nodes.holder[cid], message_type=kind, group_id=str(rnd))
        return out

    def run_phase(
        self, rnd: int, phase_idx: int, phase: str, msgs: dict[int, Message]
    ) -> tuple[dict[int, Reply], list[dict[str, Any]]]:
        meta = {"phase_idx": phase_idx, "phase": phase, **(self.secure.meta() if self.secure else {})}
        sent = self.messages("train", rnd, msgs, meta)
        if self.secure is not None:
            replies, contents, missing = self.secure.run(self.exchange, rnd, sent, self.device)
            infos = {cid: content_state(content) for cid, content in contents.items()}
            answers = {}
        else:
            answers, missing = self.exchange(sent)
            replies, infos = {}, {}
        failures = [failure(rnd, phase, cid, why) for cid, why in missing.items()]
        for cid, answer in answers.items():
            if answer.has_error():
                failures.append(failure(rnd, phase, cid, error_text(answer)))
                continue
            try:
                replies[cid] = codec.decode_reply(answer.content, self.device)
                infos[cid] = content_state(answer.content)
            except Exception as err:  # a malformed reply drops that client, not the run
                replies.pop(cid, None)
                failures.append(failure(rnd, phase, cid, f"unreadable reply: {type(err).__name__}: {err}"))
        for f in failures:
            self.stop_if_damaged(rnd, f["client"], f["error"])
        self.track_state(rnd, infos)
        return replies, sorted(failures, key=lambda f: f["client"])

    def stop_if_damaged(self, rnd: int, cid: int, why: str) -> None:
        """A client's state file that fails its seal on its node stops the run (``StateFileError``, naming the file),
        as in the simulation: dropping the client would leave it out of every round without a word."""
        if DAMAGED_STATE in why:
            damage = why.split(DAMAGED_STATE, 1)[1]
            raise StateFileError(
                f"round {rnd}: client {cid}'s state on node {self.nodes.holder.get(cid, '?')} is damaged: {damage}; "
                "the run stops at its last checkpoint: restore that file, or start the run again (--overwrite)"
            )

    def track_state(self, rnd: int, infos: dict[int, tuple[bool, list[str]]]) -> None:
        """Follow which clients keep state, and stop on state that was there and is gone."""
        lost = sorted(cid for cid, (found, _) in infos.items() if cid in self.with_state and not found)
        if lost:
            where = "nodes without a state folder" if self.nodes.volatile(lost) == lost else "their nodes"
            self.state_lost(
                rnd,
                lost,
                f"the client-held state ({', '.join(sorted(self.state_keys)) or 'state'}) of clients {short(lost)} "
                f"was not on {where} in round {rnd} (a node restarted, or its state folder was removed or "
                "changed?); those clients started that state afresh",
            )
        for cid, (_, keys) in infos.items():
            if keys:
                self.with_state.add(cid)
                self.state_keys.update(keys)
            else:
                self.with_state.discard(cid)
        volatile = self.nodes.volatile(c for c, (_, keys) in infos.items() if keys)
        if volatile and not self.told_volatile:
            self.told_volatile = True
            self.notice(
                rnd,
                "client_state_not_durable",
                volatile,
                "continued",
                f"clients {short(volatile)} keep client-held state ({', '.join(sorted(self.state_keys))}) on nodes "
                "without a state folder (only in Flower's Context.state): resuming this run would lose it; give "
                "those nodes a state folder (--node-config 'state-dir=\"...\"') to make it resumable",
            )

    def state_lost(self, rnd: int, cids: list[int], message: str) -> None:
        """Record lost client-held state; stop the run (``StateLost``) unless it accepts the loss."""
        action = "accepted" if self.accept_state_loss else "refused"
        self.notice(rnd, "client_state_lost", cids, action, message)
        if not self.accept_state_loss:
            raise StateLost(
                f"{message}. Continuing would give results that an uninterrupted run would not; to continue anyway "
                "set accept-state-loss=true in the run config (fedhet flower simulate --accept-state-loss)"
            )
        self.with_state.difference_update(cids)

    def notice(self, rnd: int, kind: str, cids: list[int], action: str, message: str) -> None:
        """A line in the run folder's notices.jsonl and a warning on the console."""
        log.warning("%s (%s)", message, action)
        if self.notices is None:
            return
        record = {
            "round": rnd,
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "kind": kind,
            "action": action,
            "clients": [int(c) for c in cids],
            "state": sorted(self.state_keys),
            "nodes": sorted({int(self.nodes.holder[c]) for c in cids if c in self.nodes.holder}),
            "attempt": self.attempt,
            "message": message,
        }
        MetricsLog(self.notices).append(record)

    def personal_accuracies(
        self, rnd: int, cids: list[int], msg: Message, batch_size: int
    ) -> dict[int, dict[str, tuple[int, int]]]:
        sent = self.messages("evaluate", rnd, dict.fromkeys(cids, msg), {"batch_size": batch_size})
        answers, missing = self.exchange(sent)
        out = {}
        for cid, answer in answers.items():
            if answer.has_error():
                self.stop_if_damaged(rnd, cid, error_text(answer))
                log.warning("personalised evaluation of client %s failed: %s", cid, error_text(answer))
                continue
            values = answer.content[codec.METRICS]
            scores = {
                split: (int(values[f"{prefix}correct"]), int(values[f"{prefix}total"]))
                for split, prefix in (("test", ""), ("val", "val_"))
                if f"{prefix}correct" in values
            }
            if scores:
                out[cid] = scores
        for cid, why in missing.items():
            log.warning("personalised evaluation of client %s: %s", cid, why)
        return dict(sorted(out.items()))

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Plain data for the checkpoint. Called by ``Simulation.save_checkpoint`` after round ``self.round``; nodes
        learn of the checkpoint once it is on disk (``retain``), with the next round's messages."""
        attempts = [*self.history, {"id": self.attempt, "start": self.start, "end": self.round}]
        return {
            "kind": "flower",
            "run": self.run,
            "attempts": [dict(a) for a in attempts],
            "with_state": sorted(self.with_state),
            "state_keys": sorted(self.state_keys),
        }

    def reset(self) -> None:
        """A fresh run: nothing to forget here (client-held state lives on the nodes)."""

    def retain(self, states: list[dict[str, Any]]) -> None:
        """The checkpoints on disk are now those holding ``states``: from the next round on, nodes may drop the
        state versions that only older checkpoints needed."""
        self.checkpoints = tuple(sorted(int(s["attempts"][-1]["end"]) for s in states if s.get("attempts")))

    def close(self) -> None:
        """Nothing to stop: the nodes belong to the federation, not to the run."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: continue the checkpoint's history, and make sure the clients' own state is still there."""
        if state.get("kind") != "flower":
            cids = in_process_state_clients(state)
            if cids:
                self.state_lost(
                    0,
                    cids,
                    f"this checkpoint was written by the in-process simulation: the client-held state of clients "
                    f"{short(cids)} stays in its run folder, the Flower nodes start it afresh",
                )
            return
        if "attempts" not in state:  # written before nodes kept state in folders: nothing to continue from
            log.warning("this checkpoint does not say which clients keep state; the nodes start it afresh")
            return
        self.run = str(state["run"])
        self.history = [dict(a) for a in state["attempts"]]
        self.start = self.round = int(self.history[-1]["end"])
        self.checkpoints = (self.start,)
        self.with_state = {int(c) for c in state["with_state"]}
        self.state_keys = {str(k) for k in state["state_keys"]}
        lost = self.nodes.volatile(self.with_state)
        if lost:
            self.state_lost(
                self.start,
                lost,
                f"resuming at round {self.start}, the client-held state ({', '.join(sorted(self.state_keys))}) of "
                f"clients {short(lost)} is lost: their nodes have no state folder, so it ended with the Flower run "
                "that was interrupted",
            )


def in_process_state_clients(state: dict[str, Any]) -> list[int]:
    """The clients with client-held state in an in-process checkpoint's executor state."""
    store = state.get("clients") or {}
    if store.get("kind") == "memory":
        return sorted(int(c) for c, s in store.get("states", {}).items() if s)
    if store.get("kind") == "disk":
        return sorted(int(p.stem) for p in Path(store["snapshot"]).glob("*.pt"))
    return []

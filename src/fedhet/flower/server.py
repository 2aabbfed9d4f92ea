"""The ServerApp side: the engine's round loop with an executor that talks to SuperNodes through a Flower Grid.

``Simulation`` runs unchanged (client sampling, the algorithm's configure / aggregate and phases, evaluation,
metrics.jsonl, checkpoints); only the executor differs. ``FlowerExecutor`` sends each sampled client's ``Message``
to the node that holds that client and turns the replies back into ``Reply`` objects. A client whose node fails,
raises or does not answer in time is dropped from the round and recorded in failures.jsonl, as in the simulation.

Server-held per-client state (FedBC's lambda_i) lives in the algorithm object, so it is in the ServerApp's
checkpoints. Client-held state lives on the SuperNodes, in Flower's ``Context.state`` of the run.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from flwr.app import Message as FlowerMessage
from flwr.app import RecordDict
from flwr.serverapp import Grid

from fedhet.algorithms.base import ClientData, Message, Reply
from fedhet.config import Config
from fedhet.data.federated import FederatedDataset
from fedhet.errors import FedhetError
from fedhet.flower import codec
from fedhet.flower.client import label_counts_from

log = logging.getLogger("fedhet.flower")


class NodeError(FedhetError):
    """The SuperNodes cannot serve this run (missing partitions, a node that rejects the config, ...)."""


@dataclass
class Nodes:
    """Which Flower node holds each client, and what the nodes told the server about their data."""

    holder: dict[int, int] = field(default_factory=dict)  # client id -> node id
    label_counts: dict[int, np.ndarray] = field(default_factory=dict)  # only for nodes with their own data files
    from_file: bool = False


class Exchange:
    """Push messages through a Grid and pull the replies, polling quickly (replies in deployment take seconds)."""

    def __init__(self, grid: Grid, timeout: float | None = None, poll: float = 0.05, max_poll: float = 0.5) -> None:
        self.grid = grid
        self.timeout = timeout
        self.poll = poll
        self.max_poll = max_poll

    def __call__(self, messages: dict[Any, FlowerMessage]) -> tuple[dict[Any, FlowerMessage], dict[Any, str]]:
        """Send ``{key: message}``; returns ``({key: reply}, {key: why it has none})``. Error replies are replies."""
        keys = list(messages)
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
                time.sleep(wait)
                wait = min(wait * 1.5, self.max_poll)
        missing.update({k: f"no reply within {self.timeout} s" for k in pending.values()})
        return replies, missing


def error_text(reply: FlowerMessage) -> str:
    return f"node {reply.metadata.src_node_id}: {reply.error.reason or f'error code {reply.error.code}'}"


def discover(grid: Grid, num_clients: int, wait_s: float) -> Nodes:
    """Ask every node which clients it holds, until all ``num_clients`` are held (or ``wait_s`` passes)."""
    nodes, asked = Nodes(), set()
    deadline = time.monotonic() + wait_s
    while True:
        new = [n for n in grid.get_node_ids() if n not in asked]
        if new:
            queries = {n: FlowerMessage(RecordDict(), dst_node_id=n, message_type="query") for n in new}
            exchange = Exchange(grid, timeout=max(1.0, deadline - time.monotonic()))
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
        time.sleep(0.5)


def register(nodes: Nodes, node_id: int, reply: FlowerMessage) -> None:
    if reply.has_error():
        raise NodeError(f"a SuperNode cannot serve this run: {error_text(reply)}")
    meta = reply.content[codec.META]
    from_file = bool(meta["from_file"])
    if nodes.holder and from_file != nodes.from_file:
        raise NodeError("some SuperNodes read data-path files and others rebuild partitions; use one kind")
    nodes.from_file = from_file
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
    from fedhet.data.federated import normalise
    from fedhet.engine.simulation import build_federation

    if not nodes.from_file:
        return build_federation(cfg)
    ds = load_dataset(cfg.dataset.name, cfg.dataset.data_dir, **cfg.dataset.params())
    if not ds.has_test_set:
        raise NodeError(f"dataset {cfg.dataset.name!r} has no test set for the server to evaluate on")
    device = cfg.run.device
    counts = np.stack([nodes.label_counts[c] for c in range(cfg.partition.num_clients)])
    x_test = torch.from_numpy(np.ascontiguousarray(normalise(ds.x_test, ds))).to(device)
    no_data = ClientData(x=x_test[:0], y=torch.zeros(0, dtype=torch.long, device=device), num_classes=ds.num_classes)
    return FederatedDataset(
        name=ds.name,
        clients=[no_data] * cfg.partition.num_clients,
        x_test=x_test,
        y_test=torch.from_numpy(np.ascontiguousarray(ds.y_test)).long().to(device),
        num_classes=ds.num_classes,
        input_shape=tuple(ds.input_shape),
        train_counts=counts,
        test_source="official",
    )


def failure(rnd: int, phase: str, cid: int, why: str) -> dict[str, Any]:
    """A failures.jsonl record, with the same keys as the simulation's."""
    return {"round": rnd, "phase": phase, "client": cid, "error": why, "where": ["flower"]}


class FlowerExecutor:
    """Runs a phase by sending each client's message to the node that holds it (``fedhet.engine.client.Executor``)."""

    def __init__(self, grid: Grid, nodes: Nodes, exchange: Exchange, device: torch.device | str = "cpu") -> None:
        self.grid = grid
        self.nodes = nodes
        self.exchange = exchange
        self.device = device

    def messages(self, kind: str, rnd: int, msgs: dict[int, Message], meta: dict[str, Any]) -> dict[int, FlowerMessage]:
        encoded: dict[int, Any] = {}  # a message sent unchanged to many clients is encoded once
        out = {}
        for cid, msg in msgs.items():
            tensors = encoded.setdefault(id(msg), codec.tensors_to_record(msg.tensors))
            content = codec.encode_message(msg, {"cid": cid, "round": rnd, **meta}, tensors)
            out[cid] = FlowerMessage(content, dst_node_id=self.nodes.holder[cid], message_type=kind, group_id=str(rnd))
        return out

    def run_phase(
        self, rnd: int, phase_idx: int, phase: str, msgs: dict[int, Message]
    ) -> tuple[dict[int, Reply], list[dict[str, Any]]]:
        sent = self.messages("train", rnd, msgs, {"phase_idx": phase_idx, "phase": phase})
        answers, missing = self.exchange(sent)
        failures = [failure(rnd, phase, cid, why) for cid, why in missing.items()]
        replies = {}
        for cid, answer in answers.items():
            if answer.has_error():
                failures.append(failure(rnd, phase, cid, error_text(answer)))
                continue
            try:
                replies[cid] = codec.decode_reply(answer.content, self.device)
            except Exception as err:  # a malformed reply drops that client, not the run
                failures.append(failure(rnd, phase, cid, f"unreadable reply: {type(err).__name__}: {err}"))
        return replies, sorted(failures, key=lambda f: f["client"])

    def personal_accuracies(
        self, rnd: int, cids: list[int], msg: Message, batch_size: int
    ) -> dict[int, tuple[int, int]]:
        sent = self.messages("evaluate", rnd, dict.fromkeys(cids, msg), {"batch_size": batch_size})
        answers, missing = self.exchange(sent)
        out = {}
        for cid, answer in answers.items():
            if answer.has_error():
                log.warning("personalised evaluation of client %s failed: %s", cid, error_text(answer))
                continue
            values = answer.content[codec.METRICS]
            if "correct" in values:
                out[cid] = (int(values["correct"]), int(values["total"]))
        for cid, why in missing.items():
            log.warning("personalised evaluation of client %s: %s", cid, why)
        return dict(sorted(out.items()))

    def state_dict(self) -> dict[str, Any]:
        # Client-held state stays on the SuperNodes (Context.state of this Flower run); nothing to save here.
        return {"kind": "flower"}

    def reset(self) -> None:
        """A fresh run: nothing to forget here (client-held state lives on the nodes)."""

    def retain(self, states: list[dict[str, Any]]) -> None:
        """Nothing saved here to free."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "flower":
            log.warning("resuming a checkpoint written by the in-process simulation: its client-held state stays there")

"""The ClientApp: what a SuperNode does with fedhet's messages.

A SuperNode holds one or more clients of the federation, named by their client ids (Flower's ``partition-id``):

* ``--node-config 'partition-id=3'`` (or ``partition-ids="0,1,2"`` / ``"0-9"``): the node rebuilds the federation
  from the run's config (same dataset, partitioner and seed as the simulation) and keeps only its own partitions.
  Flower's simulation sets ``partition-id`` for every virtual node.
* ``--node-config 'partition-id=3 data-path="/data/site3.npz"'``: the node's own data from a local file (real private
  data). The file holds model-ready arrays ``x``, ``y`` (and optionally ``x_test``, ``y_test`` for a local test split)
  plus ``num_classes``; ``fedhet flower export`` writes such files from any fedhet federation
  (``fedhet.flower.data``).

The client update is the engine's ``ClientRunner``, built by the engine exactly as the in-process simulation builds
it, so a client's reply depends only on (config, message, data, state), never on where it runs. Client-held state
(SCAFFOLD's c_i, MOON's previous models) is written back only when the client finishes cleanly, to the node's state
folder (``--node-config 'state-dir="..."'``: it survives Flower runs, so a resumed run continues it) or else to
Flower's ``Context.state`` (lost when the Flower run ends); see ``fedhet.flower.node_state``.
"""

from __future__ import annotations

import json
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, MetricRecord, RecordDict
from flwr.app import Message as FlowerMessage
from flwr.clientapp import ClientApp

from fedhet.config import Config
from fedhet.data.federated import FederatedDataset
from fedhet.data.types import ClientData
from fedhet.engine.checkpoint import StateFileError
from fedhet.engine.client import ClientRunner
from fedhet.errors import ConfigError
from fedhet.flower import codec, secagg
from fedhet.flower.data import load_client_file
from fedhet.flower.node_state import DAMAGED_STATE, History, NodeStateStore, node_store, state_info

CLIENT_ERROR = 2  # flwr.common.constant.ErrorCode.CLIENT_APP_RAISED_EXCEPTION
LABEL_COUNTS = "fedhet.label_counts"


@dataclass
class NodeClients:
    """The clients one node holds, and the runner that trains them."""

    runner: ClientRunner
    clients: dict[int, ClientData]
    from_file: bool

    def data(self, cid: int) -> ClientData:
        if cid not in self.clients:
            raise ConfigError(f"this node holds clients {sorted(self.clients)}, not client {cid}")
        return self.clients[cid]


# One entry per process: in Flower's Ray simulation an actor serves many virtual nodes and keeps the federation and
# runner for the run's config (exactly like the in-process simulation, one runner serves every client).
_federations: dict[str, FederatedDataset] = {}
_runners: dict[tuple[str, int, tuple[int, ...], tuple[float, ...] | None], ClientRunner] = {}


def config_key(cfg: Config) -> str:
    return json.dumps(cfg.to_dict(), sort_keys=True)


def cached_federation(cfg: Config) -> FederatedDataset:
    from fedhet.engine.training import build_federation

    key = config_key(cfg)
    if key not in _federations:
        _federations.clear()
        _federations[key] = build_federation(cfg)
    return _federations[key]


def shape_only_federation(
    cfg: Config, num_classes: int, input_shape: tuple[int, ...], pad_value: tuple[float, ...] | None = None
) -> FederatedDataset:
    """A federation with the right clients, classes, input shape and augmentation fill but no data (to size a model
    and build the runner)."""
    n = cfg.partition.num_clients
    empty = ClientData(x=torch.zeros(0, *input_shape), y=torch.zeros(0, dtype=torch.long), num_classes=num_classes)
    return FederatedDataset(
        name=cfg.dataset.name,
        clients=[empty] * n,
        x_test=empty.x,
        y_test=empty.y,
        num_classes=num_classes,
        input_shape=tuple(input_shape),
        train_counts=np.zeros((n, num_classes), dtype=np.int64),
        test_source="none",
        pad_value=pad_value,
    )


def cached_runner(cfg: Config, fed: FederatedDataset) -> ClientRunner:
    """The ClientRunner that the simulation builds for this config: same model, seeds, algorithm and augmentation."""
    from fedhet.engine.training import build_training

    key = (config_key(cfg), fed.num_classes, tuple(fed.input_shape), fed.pad_value)
    if key not in _runners:
        _runners.clear()
        _runners[key] = build_training(cfg, fed).runner
    return _runners[key]


def partition_ids(node_config: dict[str, Any], num_clients: int) -> list[int]:
    """The client ids a node holds: ``partition-id`` (an int) or ``partition-ids`` ("0,3,5" or "0-9")."""
    if "partition-ids" in node_config:
        ids: list[int] = []
        for part in str(node_config["partition-ids"]).replace(" ", "").split(","):
            lo, _, hi = part.partition("-")
            ids.extend(range(int(lo), int(hi or lo) + 1))
    elif "partition-id" in node_config:
        ids = [int(node_config["partition-id"])]
    else:
        raise ConfigError("node config needs partition-id (or partition-ids), e.g. --node-config 'partition-id=0'")
    if "num-partitions" in node_config and int(node_config["num-partitions"]) != num_clients:
        raise ConfigError(
            f"node config num-partitions={node_config['num-partitions']} but the run's config has "
            f"partition.num_clients={num_clients}"
        )
    bad = [i for i in ids if not 0 <= i < num_clients]
    if bad:
        raise ConfigError(f"partition ids {bad} are outside 0..{num_clients - 1} (partition.num_clients={num_clients})")
    return ids


def node_clients(cfg: Config, node_config: dict[str, Any]) -> NodeClients:
    n = cfg.partition.num_clients
    if "data-path" in node_config:
        cids = partition_ids(node_config, n)
        if len(cids) != 1:
            raise ConfigError("a node with data-path holds exactly one client: give one partition-id")
        data, pad_value = load_client_file(str(node_config["data-path"]), cfg.run.device)
        fed = shape_only_federation(cfg, data.num_classes, tuple(data.x.shape[1:]), pad_value)
        return NodeClients(cached_runner(cfg, fed), {cids[0]: data}, from_file=True)
    fed = cached_federation(cfg)
    runner = cached_runner(cfg, fed)
    return NodeClients(runner, {cid: fed.clients[cid] for cid in partition_ids(node_config, n)}, from_file=False)


# --------------------------------------------------------------------------------------------- message handlers
def describe(node: NodeClients, store: NodeStateStore) -> RecordDict:
    """The node's answer to the server's first query: which clients it holds, whether their state survives the
    Flower run (a state folder) and, for file data, their label counts, which the server needs for the
    per-client-distribution metrics since it never sees the data."""
    cids = sorted(node.clients)
    meta = {"cids": cids, "from_file": node.from_file, "durable": store.durable}
    content = RecordDict({codec.META: ConfigRecord(meta)})
    if node.from_file:
        counts = {str(c): node.clients[c].label_counts().long() for c in cids}
        content[LABEL_COUNTS] = codec.tensors_to_record(counts)
    return content


def train(node: NodeClients, msg: FlowerMessage, store: NodeStateStore, device: str) -> RecordDict:
    fed_msg, meta = codec.decode_message(msg.content, device)
    cid, rnd, phase_idx = int(meta["cid"]), int(meta["round"]), int(meta["phase_idx"])
    history = History.from_content(msg.content)
    state = store.get(cid, history)
    found = bool(state)
    reply, state = node.runner.run(cid, rnd, phase_idx, str(meta["phase"]), fed_msg, node.data(cid), state)
    store.put(cid, history, rnd, phase_idx, state)  # only reached when the client finished cleanly
    content = codec.encode_reply(reply)
    content[codec.STATE_INFO] = state_info(found, state)
    if secagg.asked(msg):  # the summand for secaggplus_mod, which then removes every array from the reply
        secagg.attach_summand(content, reply, meta)
    return content


def personal_accuracy(node: NodeClients, msg: FlowerMessage, store: NodeStateStore, device: str) -> RecordDict:
    fed_msg, meta = codec.decode_message(msg.content, device)
    cid = int(meta["cid"])
    state = store.get(cid, History.from_content(msg.content))
    acc = node.runner.personal_accuracy(
        cid, int(meta["round"]), fed_msg, node.data(cid), state, int(meta["batch_size"])
    )
    values = {}  # test: correct, total; validation: val_correct, val_total
    for split, (correct, total) in (acc or {}).items():
        prefix = "" if split == "test" else f"{split}_"
        values |= {f"{prefix}correct": correct, f"{prefix}total": total}
    return RecordDict({codec.METRICS: MetricRecord(values)})


def respond(msg: FlowerMessage, work: Callable[[], RecordDict]) -> FlowerMessage:
    """Reply with ``work()``'s records, or with an error naming the exception (the server drops that client)."""
    try:
        return FlowerMessage(work(), reply_to=msg)
    except StateFileError as err:  # the run's problem, not the client's: the server stops the run naming the file
        return FlowerMessage(Error(code=CLIENT_ERROR, reason=f"{DAMAGED_STATE}{err}"), reply_to=msg)
    except Exception as err:  # a failing client is dropped from the round, never the node
        where = " | ".join(traceback.format_exc(limit=4).splitlines()[-4:])
        return FlowerMessage(Error(code=CLIENT_ERROR, reason=f"{type(err).__name__}: {err} [{where}]"), reply_to=msg)


def make_client_app(
    load_config: Callable[[Context], Config], state_root: Callable[[Config], str | Path | None] | None = None
) -> ClientApp:
    """A ClientApp for the run whose fedhet config ``load_config(context)`` returns.

    A node keeps its clients' state in its ``state-dir`` node config folder; a node without one keeps it in a
    subfolder of ``state_root(cfg)`` when that is given and not None (Flower's simulation: all nodes on one
    machine), else in ``Context.state``."""
    app = ClientApp(mods=[secagg.client_mod])  # SecAgg+ when the server runs it (fedhet.flower.secagg)

    def handle(msg: FlowerMessage, context: Context, handler) -> FlowerMessage:
        def work() -> RecordDict:
            cfg = load_config(context)
            node = node_clients(cfg, dict(context.node_config))
            store = node_store(context, state_root(cfg) if state_root else None, cfg.run.device)
            return handler(node, msg, store, cfg.run.device)

        return respond(msg, work)

    @app.query()
    def _query(msg: FlowerMessage, context: Context) -> FlowerMessage:
        return handle(msg, context, lambda node, _msg, store, _device: describe(node, store))

    @app.train()
    def _train(msg: FlowerMessage, context: Context) -> FlowerMessage:
        return handle(msg, context, train)

    @app.evaluate()
    def _evaluate(msg: FlowerMessage, context: Context) -> FlowerMessage:
        return handle(msg, context, personal_accuracy)

    return app


def label_counts_from(content: RecordDict) -> dict[int, np.ndarray]:
    record: ArrayRecord = content[LABEL_COUNTS]
    return {int(k): v.cpu().numpy() for k, v in codec.record_to_tensors(record).items()}

"""fedhet messages as Flower records, and back.

A fedhet ``Message`` / ``Reply`` is named tensors + named scalars (+ number of examples and metrics for a reply),
so it maps one to one onto a Flower ``RecordDict``:

* tensors -> ``ArrayRecord`` under ``fedhet.tensors`` (NumPy ``.npy`` bytes: float32 and int64 round-trip bit for bit)
* scalars -> ``ConfigRecord`` under ``fedhet.scalars`` (int, float, str and bool keep their types)
* reply metrics -> ``MetricRecord`` under ``fedhet.metrics``, with the number of examples as ``num-examples``
  (Flower's own key for aggregation weights, so Flower tooling reads our replies too)
* which client, round and phase a message is for -> ``ConfigRecord`` under ``fedhet.meta``

A node without a state folder keeps a client's persistent state (a dict of tensors) in the SuperNode's
``Context.state`` as one ArrayRecord per client id (``fedhet.flower.node_state`` has the state folders). Nothing here
knows about any algorithm.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from fedhet.algorithms.base import Message, Reply

TENSORS = "fedhet.tensors"
SCALARS = "fedhet.scalars"
METRICS = "fedhet.metrics"
META = "fedhet.meta"
STATE_PREFIX = "fedhet.state."
HISTORY = "fedhet.history"  # server -> node: the run's attempts, for nodes that keep client state in a folder
STATE_INFO = "fedhet.state_info"  # node -> server, in training replies: did the client find its state, what it keeps
NUM_EXAMPLES = "num-examples"

State = dict[str, torch.Tensor]


def tensors_to_record(tensors: dict[str, torch.Tensor]) -> ArrayRecord:
    record = ArrayRecord()
    for name, t in tensors.items():
        record[name] = Array(t.detach().cpu().contiguous().numpy())
    return record


def record_to_tensors(record: ArrayRecord, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    # np.load hands back read-only views of the message bytes; copy so the tensors own writable memory.
    return {name: torch.from_numpy(np.array(arr.numpy())).to(device) for name, arr in record.items()}


def plain_scalar(value: Any) -> Any:
    """NumPy scalars as Python ones (Flower records accept only int, float, str, bool and bytes)."""
    return value.item() if isinstance(value, np.generic) else value


def encode_message(msg: Message, meta: dict[str, Any], tensors: ArrayRecord | None = None) -> RecordDict:
    """``tensors`` lets the caller reuse one encoding of a message sent unchanged to many clients."""
    return RecordDict(
        {
            TENSORS: tensors if tensors is not None else tensors_to_record(msg.tensors),
            SCALARS: ConfigRecord({k: plain_scalar(v) for k, v in msg.scalars.items()}),
            META: ConfigRecord(meta),
        }
    )


def decode_message(content: RecordDict, device: torch.device | str = "cpu") -> tuple[Message, dict[str, Any]]:
    msg = Message(tensors=record_to_tensors(content[TENSORS], device), scalars=dict(content[SCALARS]))
    return msg, dict(content[META])


def encode_reply(reply: Reply) -> RecordDict:
    metrics = {k: float(v) for k, v in reply.metrics.items()}
    metrics[NUM_EXAMPLES] = int(reply.num_examples)
    return RecordDict(
        {
            TENSORS: tensors_to_record(reply.tensors),
            SCALARS: ConfigRecord({k: plain_scalar(v) for k, v in reply.scalars.items()}),
            METRICS: MetricRecord(metrics),
        }
    )


def decode_reply(content: RecordDict, device: torch.device | str = "cpu") -> Reply:
    metrics = dict(content[METRICS])
    num_examples = int(metrics.pop(NUM_EXAMPLES))
    return Reply(
        tensors=record_to_tensors(content[TENSORS], device),
        scalars=dict(content[SCALARS]),
        num_examples=num_examples,
        metrics={k: float(v) for k, v in metrics.items()},
    )


def load_state(store: RecordDict, cid: int, device: torch.device | str = "cpu") -> State:
    """Client ``cid``'s persistent state from a node's ``Context.state`` (empty before its first round)."""
    record = store.get(f"{STATE_PREFIX}{cid}")
    return {} if record is None else record_to_tensors(record, device)


def save_state(store: RecordDict, cid: int, state: State) -> None:
    key = f"{STATE_PREFIX}{cid}"
    if state:
        store[key] = tensors_to_record(state)
    elif key in store:
        del store[key]  # the algorithm cleared its state

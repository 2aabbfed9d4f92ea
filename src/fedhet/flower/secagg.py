"""Secure aggregation over Flower: SecAgg+ (Bell et al. 2020) through Flower's own implementation.

The server runs the four stages of Flower's ``SecAggPlusWorkflow`` (setup, share keys, collect masked vectors,
unmask) over the run's Grid, one protocol per training phase, with fedhet's training message as the payload of the
"collect masked vectors" stage. The ClientApp wraps Flower's ``secaggplus_mod``: the mod trains the client through
fedhet's handler, quantises the summand (the model the client sends, with its weight ``num_examples / max_weight``)
and masks it, so the server only ever receives masked vectors and learns the weighted average of the models, never
one client's model. That average then stands in for every replied model, as Flower's workflow hands it to a
Strategy (``secaggplus_workflow.py``, unmask stage), so the algorithm's own ``aggregate`` runs unchanged.

This is sound only where the aggregate is a plain sample-weighted average of the replied models and nothing else
of a client's reply is read (``refusal``). The protocol's participants are Flower nodes, so each SuperNode holds one
client. What SecAgg+ does not hide: each client's ``num_examples`` and training metrics, which Flower's workflow
also leaves in the clear.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import ConfigRecord, Context, Error, RecordDict
from flwr.app import Message as FlowerMessage
from flwr.client.mod import secaggplus_mod
from flwr.common import Code, FitIns, FitRes, Parameters, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.compat.common import recorddict_compat as compat
from flwr.server.history import History
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey
from flwr.server.workflow.secure_aggregation.secaggplus_workflow import SecAggPlusWorkflow, WorkflowState

from fedhet.algorithms.base import Algorithm, Reply
from fedhet.config import Config

SECAGG = "secaggplus"
SUMMED = ("params", "buffers")  # the reply tensors SecAgg+ sums, in this order
CLIENT_ERROR = 2  # flwr.common.constant.ErrorCode.CLIENT_APP_RAISED_EXCEPTION


@dataclass(frozen=True)
class SecAggSettings:
    """SecAgg+'s parameters (Flower's ``SecAggPlusWorkflow``): ``num_shares`` above 1 is a count of neighbours
    (more than 2), at most 1 a fraction of the round's nodes; ``threshold`` above 1 is a count of shares, at most 1 a
    fraction of ``num_shares``. Each weighted model entry is clipped to ``clipping_range`` and quantised to
    ``quantization_range`` levels (a client whose entries exceed it fails the round rather than being clipped)."""

    num_shares: float = 1.0
    threshold: float = 0.5
    clipping_range: float = 8.0
    quantization_range: int = 2**22
    modulus_range: int = 2**32

    def count_or_fraction(self, value: float) -> int | float:
        return int(value) if value > 1 else float(value)

    def workflow(self, max_weight: float, timeout: float | None) -> SecAggPlusWorkflow:
        return SecAggPlusWorkflow(
            self.count_or_fraction(self.num_shares),
            self.count_or_fraction(self.threshold),
            max_weight=max_weight,
            clipping_range=self.clipping_range,
            quantization_range=self.quantization_range,
            modulus_range=self.modulus_range,
            timeout=timeout,
        )

    def error_bound(self, num_nodes: int, weight_sum: float, max_abs: float) -> float:
        """A bound on |SecAgg+'s average - the exact sample-weighted average| per entry: each node's stochastic
        rounding errs by under one level (2 C / Q), its weight by at most 1 / (2 Q); the sum is divided by the
        quantised weight sum (``weight_sum``, i.e. sum n_k / max_weight)."""
        q = self.quantization_range
        return num_nodes * (2 * self.clipping_range / q + 2 * max_abs / q) / max(weight_sum - num_nodes / q, 1e-12)


def refusal(cfg: Config, settings: SecAggSettings) -> str | None:
    """Why this run cannot use SecAgg+ (None: it can). The server must learn nothing but a weighted sum."""
    from fedhet.algorithms import ALGORITHMS

    cls: type[Algorithm] = ALGORITHMS.get(cfg.algorithm.name).obj
    owner = next(c for c in cls.__mro__ if "aggregate" in c.__dict__)
    if owner is not Algorithm or tuple(cls.phases) != ("train",):
        name = cfg.algorithm.name
        return f"{name}'s aggregation is not a plain weighted sum of the client models (SecAgg+ sums nothing else)"
    if cfg.server.aggregation != "weights":
        return f"server.aggregation={cfg.server.aggregation!r} needs each client's update; SecAgg+ hides them"
    if getattr(cfg.server, "lora_aggregation", "fedit") == "flexlora":
        return "server.lora_aggregation='flexlora' multiplies each client's adapters, which SecAgg+ hides (only sums)"
    if getattr(cfg.model, "lora_ranks", None) is not None:
        return "model.lora_ranks averages each adapter slot over the clients that hold it, which SecAgg+'s sum hides"
    privacy = getattr(cfg, "privacy", None)
    if privacy is not None and privacy.mode == "central":
        return "central DP clips each client's update at the server, which SecAgg+ hides (use privacy.mode='local')"
    if cfg.run.eval_local_models:
        return "run.eval_local_models scores each client's model at the server, which SecAgg+ hides"
    m = cfg.clients_per_round()
    if m < 2:
        return f"SecAgg+ needs at least 2 clients a round (this run samples {m})"
    if m * settings.quantization_range >= settings.modulus_range:
        return f"{m} clients a round overflow SecAgg+'s modulus (clients x quantization range must stay below 2**32)"
    return None


def algorithm_refusal(algo: Algorithm) -> str | None:
    """What only the built algorithm shows: GNE wired in by the algorithm itself (FedRANE), and weights that are not
    the clients' sample shares (probed with two replies of 1 and 3 examples)."""
    if algo.gne is not None:
        return f"{algo.name} aggregates with GNE, which needs each client's model; SecAgg+ hides them"
    probe = {0: Reply(num_examples=1), 1: Reply(num_examples=3)}
    try:
        weights = [float(w) for w in algo.aggregation_weights(probe)]
    except Exception:  # weights that read more than the sample counts
        weights = []
    if len(weights) != 2 or not np.allclose(weights, [0.25, 0.75]):
        return f"{algo.name} weights clients otherwise than by their sample counts (SecAgg+ weights by num_examples)"
    return None


# ----------------------------------------------------------------------------------------------- client side
def asked(msg: FlowerMessage) -> bool:
    return msg.metadata.message_type == "train" and RECORD_KEY_CONFIGS in msg.content.config_records


class _TrainingFailed(Exception):
    pass


def client_mod(msg: FlowerMessage, ctxt: Context, call_next) -> FlowerMessage:
    """Flower's ``secaggplus_mod`` for the server's SecAgg+ messages only; everything else goes straight through.
    A client that fails (fedhet's error reply) or a protocol error answers with an error reply, never a crash."""
    if not asked(msg):
        return call_next(msg, ctxt)
    failed: list[FlowerMessage] = []

    def train(m: FlowerMessage, c: Context) -> FlowerMessage:
        out = call_next(m, c)
        if out.has_error():
            failed.append(out)
            raise _TrainingFailed
        return out

    try:
        return secaggplus_mod(msg, ctxt, train)
    except _TrainingFailed:
        return failed[0]
    except Exception as err:  # the protocol's own checks (too few neighbours, a wrong stage)
        return FlowerMessage(Error(code=CLIENT_ERROR, reason=f"SecAgg+: {type(err).__name__}: {err}"), reply_to=msg)


def attach_summand(content: RecordDict, reply: Reply, meta: dict[str, Any]) -> None:
    """Add the records ``secaggplus_mod`` reads (Flower's FitRes layout): the model to sum and its weight."""
    extra = sorted(set(reply.tensors) - set(SUMMED))
    if extra:
        raise ValueError(f"SecAgg+ sums {SUMMED} only; this reply also carries {extra}")
    arrays = [reply.tensors[k].detach().cpu().numpy() for k in SUMMED if k in reply.tensors]
    max_weight, q = float(meta["secagg_max_weight"]), int(meta["secagg_quantization_range"])
    if reply.num_examples > max_weight:
        raise ValueError(f"{reply.num_examples} examples exceed SecAgg+'s max_weight {max_weight:g}")
    weight = round(reply.num_examples / max_weight * q) / q
    largest = max((float(np.abs(a).max()) for a in arrays if a.size), default=0.0) * weight
    clip = float(meta["secagg_clipping_range"])
    if largest > clip:
        raise ValueError(
            f"a weighted model entry of {largest:.3g} exceeds SecAgg+'s clipping range {clip:g}; raise "
            "secagg-clipping-range (clipping it would change the aggregate silently)"
        )
    fitres = FitRes(Status(code=Code.OK, message=""), ndarrays_to_parameters(arrays), int(reply.num_examples), {})
    for key, record in compat.fitres_to_recorddict(fitres, keep_input=True).items():
        content[key] = record


# ----------------------------------------------------------------------------------------------- server side
class _Proxy:
    def __init__(self, node_id: int) -> None:
        self.node_id = node_id


class _Strategy:
    """The two Strategy calls SecAggPlusWorkflow makes: which nodes train, and what to do with the average."""

    def __init__(self, node_ids: list[int]) -> None:
        self.node_ids = node_ids
        self.average: list[np.ndarray] | None = None

    def configure_fit(self, server_round, parameters, client_manager):
        return [(_Proxy(n), FitIns(Parameters([], ""), {})) for n in self.node_ids]

    def aggregate_fit(self, server_round, results, failures):
        if results:  # the workflow gives every result the same parameters: the average
            self.average = parameters_to_ndarrays(results[0][1].parameters)
        return None, {}  # the round goes on in fedhet's algorithm, not in the workflow's context


class _Nodes:
    def __init__(self, count: int) -> None:
        self.count = count

    def num_available(self) -> int:
        return self.count


class _Round:
    """What SecAggPlusWorkflow's stages read from a LegacyContext: the round, a strategy, a client manager."""

    def __init__(self, rnd: int, node_ids: list[int]) -> None:
        self.state = RecordDict({MAIN_CONFIGS_RECORD: ConfigRecord({WorkflowKey.CURRENT_ROUND: rnd})})
        self.state.array_records[MAIN_PARAMS_RECORD] = compat.parameters_to_arrayrecord(Parameters([], ""), True)
        self.strategy = _Strategy(node_ids)
        self.client_manager = _Nodes(len(node_ids))
        self.history = History()


class _Recorder:
    """The Grid as the workflow uses it (send_and_receive), through fedhet's Exchange; keeps the last replies and
    why each node that dropped out did."""

    def __init__(self, exchange) -> None:
        self.exchange = exchange
        self.replies: list[FlowerMessage] = []
        self.failed: dict[int, str] = {}

    def send_and_receive(self, messages, *, timeout=None) -> list[FlowerMessage]:
        replies, missing = self.exchange({m.metadata.dst_node_id: m for m in messages})
        self.failed.update(missing)
        self.replies = list(replies.values())
        for reply in self.replies:
            if reply.has_error():
                self.failed[reply.metadata.src_node_id] = reply.error.reason or f"error code {reply.error.code}"
        return self.replies


class SecureAggregation:
    """Runs a training phase as one SecAgg+ protocol (``FlowerExecutor.run_phase`` with secure aggregation)."""

    def __init__(self, settings: SecAggSettings, max_weight: float, timeout: float | None = None) -> None:
        self.settings = settings
        self.max_weight = float(max_weight)
        self.workflow = settings.workflow(self.max_weight, timeout)

    def meta(self) -> dict[str, Any]:
        s = self.settings
        return {
            "secagg_max_weight": self.max_weight,
            "secagg_clipping_range": s.clipping_range,
            "secagg_quantization_range": s.quantization_range,
        }

    def run(
        self, exchange, rnd: int, sent: dict[int, FlowerMessage], device
    ) -> tuple[dict[int, Reply], dict[int, RecordDict], dict[int, str]]:
        """``sent``: each client's training message. Returns ``({cid: reply}, {cid: its reply's records},
        {cid: why it has none})``; every reply carries the secure average in place of the client's own model."""
        from fedhet.flower import codec

        cid_of = {m.metadata.dst_node_id: cid for cid, m in sent.items()}
        grid, context, state = _Recorder(exchange), _Round(rnd, list(cid_of)), WorkflowState()
        stages = ("setup", "share keys", "collect masked vectors", "unmask")
        steps = (
            self.workflow.setup_stage,
            self.workflow.share_keys_stage,
            self.workflow.collect_masked_vectors_stage,
            self.workflow.unmask_stage,
        )
        trained: list[FlowerMessage] = []
        for stage, step in zip(stages, steps, strict=True):
            ok = step(grid, context, state)
            if stage == "setup":
                state.nid_to_fitins = {n: sent[c].content for n, c in cid_of.items()}
            if stage == "collect masked vectors":
                trained = [r for r in grid.replies if not r.has_error()]
            if not ok:
                return {}, {}, self.why_none(cid_of, grid, f"SecAgg+ stopped at its {stage} stage (too few nodes left)")
        average = context.strategy.average
        if average is None:
            return {}, {}, self.why_none(cid_of, grid, "SecAgg+ returned no aggregate")
        names = SUMMED[: len(average)]  # params, and buffers where the model has them
        tensors = {
            k: torch.from_numpy(np.asarray(a, dtype=np.float32)).to(device) for k, a in zip(names, average, strict=True)
        }
        replies, contents = {}, {}
        for answer in trained:
            cid = cid_of[answer.metadata.src_node_id]
            replies[cid] = codec.decode_reply(answer.content, device)
            replies[cid].tensors = dict(tensors)
            contents[cid] = answer.content
        return replies, contents, self.why_none(cid_of, grid, "dropped from SecAgg+", replies)

    @staticmethod
    def why_none(cid_of: dict[int, int], grid: _Recorder, why: str, done: dict | None = None) -> dict[int, str]:
        out = {cid_of[n]: f"node {n}: {text}" for n, text in grid.failed.items()}
        return {c: out.get(c, why) for c in cid_of.values() if c not in (done or {})}

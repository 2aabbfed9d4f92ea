"""The client side of a round, and executors that run it for many clients.

``ClientRunner`` is what one client machine does: given the server's message, its own data and its persistent
state, run the algorithm's client update and return the reply and the new state. It is used unchanged in the
in-process simulation (``LocalExecutor``) and on a Flower SuperNode.

An executor runs one phase for a set of clients and returns their replies plus the failures. ``LocalExecutor`` runs
them one after another in this process with an in-memory (or on-disk) state store; fedhet.flower provides one that
sends the messages over Flower instead. The round loop in ``Simulation`` is the same for both.
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from fedhet.algorithms.base import Algorithm, ClientContext, Message, Reply
from fedhet.algorithms.loop import CompiledGradient
from fedhet.config import TrainSection
from fedhet.data.augment import Augment
from fedhet.data.types import ClientData
from fedhet.engine.attack import Attack
from fedhet.engine.checkpoint import CheckpointError, StateFileError
from fedhet.engine.state import MemoryStateStore, State
from fedhet.toolkit.confusion import PAPER_TAU, probability_matrix, soft_confusion, template_kl
from fedhet.toolkit.evaluate import evaluate
from fedhet.toolkit.flat import FlatModel
from fedhet.toolkit.local import derive_seed, seed_global

# reply tensors of run.eval_local_models; the simulation takes them out before the algorithm aggregates
LOCAL_PARAMS, LOCAL_BUFFERS = "local_params", "local_buffers"
# a personalised model's (correct, total) on the client's local test split ("test") and validation data ("val")
PersonalScores = dict[str, tuple[int, int]]


def overrides(algo: Algorithm, hook: str) -> bool:
    """Whether ``algo`` replaces the contract's ``hook`` (in its class or on the instance)."""
    return getattr(type(algo), hook) is not getattr(Algorithm, hook) or hook in vars(algo)


def why_uncompiled(algo: Algorithm) -> str | None:
    """Why ``run.compile`` leaves ``algo``'s sequential local steps uncompiled, or None where it compiles them: the
    loop compiles the gradient of the contract's ``loss``, which a ``local_loss`` hook of the algorithm's own
    replaces, and local DP-SGD computes per-sample gradients of its own."""
    if overrides(algo, "local_loss"):
        return f"{type(algo).__name__} has its own local_loss hook, which reads the client's context"
    if getattr(algo.setup, "privacy", None) is not None and algo.setup.privacy.mode == "local":
        return "local DP-SGD computes per-sample gradients"
    return None


class ClientRunner:
    def __init__(
        self,
        algo: Algorithm,
        flat: FlatModel,
        train: TrainSection,
        augment: Augment | None,
        run_seed: int,
        local_diagnostics: bool = False,
        eval_batch_size: int = 1024,
        attack: Attack | None = None,
        lora_ranks: list[int] | None = None,
        compile_mode: str = "off",
    ) -> None:
        self.algo = algo
        self.flat = flat
        self.model = flat.model
        self.train = train
        self.augment = augment
        self.run_seed = run_seed
        # run.eval_local_models: each reply of a round's last phase also carries the local model and its KL(P||Q)
        self.local_diagnostics = local_diagnostics
        self.eval_batch_size = eval_batch_size
        self.attack = attack  # [attack]: what this run's malicious clients do to their batches and replies
        # model.lora_ranks: client c trains (and is scored with) the first lora_ranks[c] adapter slots (one per client)
        self.lora_ranks = lora_ranks
        # run.compile: the sequential loop's step compiled (compiled lazily, at the first step that uses it)
        self.compiled = None
        if compile_mode != "off" and why_uncompiled(algo) is None:
            self.compiled = CompiledGradient(algo, self.model, compile_mode, flat.params.device)
        self.rank_mask = None
        if lora_ranks is not None:
            from fedhet.models.adapt import RankMask

            self.rank_mask = RankMask(self.model)

    def context(
        self, cid: int, rnd: int, phase_idx: int, phase: str, msg: Message, data: ClientData, state: State
    ) -> ClientContext:
        seed = derive_seed(self.run_seed, rnd, cid, phase_idx)
        seed_global(seed, self.flat.params.device)  # dropout and any other global-RNG use inside the model
        return ClientContext(
            cid=cid,
            round=rnd,
            phase=phase,
            message=msg,
            data=data,
            state=state,
            model=self.model,
            flat=self.flat,
            train=self.train,
            generator=torch.Generator().manual_seed(seed),
            augment=self.augment,
            poison=None if self.attack is None else self.attack.poison(cid),
            compiled=self.compiled,
        )

    def run(
        self, cid: int, rnd: int, phase_idx: int, phase: str, msg: Message, data: ClientData, state: State
    ) -> tuple[Reply, State]:
        ctx = self.context(cid, rnd, phase_idx, phase, msg, data, state)
        with self.client_rank(cid):
            reply = self.algo.client_update(ctx)
            if self.attack is not None and phase == self.algo.local_model_phase:
                self.attack.corrupt(cid, rnd, phase_idx, msg, reply)
            if self.local_diagnostics and phase == self.algo.local_model_phase:
                self.diagnose(reply, data)
        check_finite(reply, ctx.state)
        return reply, ctx.state

    @contextmanager
    def client_rank(self, cid: int):
        """The model at client ``cid``'s LoRA rank (``model.lora_ranks``) inside the block, whole again after it (the
        server evaluates the whole adapters on the same model object in the simulation)."""
        if self.rank_mask is None:
            yield
            return
        self.rank_mask.rank = self.lora_ranks[cid]
        try:
            yield
        finally:
            self.rank_mask.rank = None

    def diagnose(self, reply: Reply, data: ClientData) -> None:
        """Attach the model local training left (FedACD's Table 3 evaluates it on the test set, server side) and
        its KL(P^m || Q) on the client's own training data (Table 9: any algorithm's local models). A clean eval-mode
        pass: it draws no random number, so the run's results are the same with or without it."""
        reply.tensors[LOCAL_PARAMS] = self.flat.get_params()
        if self.rank_mask is not None and self.rank_mask.rank is not None:
            # the server scores it with the whole adapters: the slots past the client's rank are zero there
            from fedhet.toolkit.lora import model_pairs, slot_mask

            masked = slot_mask(model_pairs(self.flat), self.flat.num_params, self.rank_mask.rank)
            reply.tensors[LOCAL_PARAMS][masked.to(self.flat.params.device)] = 0.0
        if self.flat.buffers.numel():
            reply.tensors[LOCAL_BUFFERS] = self.flat.get_buffers()
        if len(data.y):
            sums, counts = soft_confusion(self.model, data.x, data.y, data.num_classes, self.eval_batch_size)
            kl = template_kl(probability_matrix(sums, counts), PAPER_TAU)
            reply.metrics["local_kl"] = kl

    def personal_accuracy(
        self, cid: int, rnd: int, msg: Message, data: ClientData, state: State, batch_size: int
    ) -> PersonalScores | None:
        """(correct, total) of the client's personalised model on its local test split (``"test"``) and on its
        validation data (``"val"``), for each it has; None if it has neither. The model is personalised once for
        both."""
        splits = {
            name: (x, y)
            for name, x, y in (("test", data.x_test, data.y_test), ("val", data.x_val, data.y_val))
            if y is not None and len(y)
        }
        if not splits:
            return None
        ctx = self.context(cid, rnd, 0xE7A1, "personalize", msg, data, state)
        with self.client_rank(cid):
            personal = self.algo.personalize(ctx)
            if personal is None:
                return None
            self.flat.set_params(personal)
            buffers = self.algo.personal_buffers(ctx)  # the global ones or the client's own, never another client's
            if buffers is not None:
                self.flat.set_buffers(buffers)
            out = {}
            for name, (x, y) in splits.items():
                stats = evaluate(self.model, x, y, data.num_classes, batch_size)
                out[name] = (int(round(stats.correct.sum())), stats.n)
        return out


def check_finite(reply: Reply, state: State) -> None:
    """A client whose reply or new state is not finite is dropped, and its stored state is left as it was."""
    tensors = floating_tensors(reply, state)
    raise_nonfinite(reply, all_finite([t for _, t in tensors]), tensors)


def floating_tensors(reply: Reply, state: State) -> list[tuple[str, torch.Tensor]]:
    """(what, tensor) for every floating tensor of a client's new state and its reply: what must be finite."""
    tensors = [(f"client state {n!r}", t) for n, t in state.items() if t.is_floating_point()]
    return tensors + [(f"reply tensor {n!r}", t) for n, t in reply.tensors.items() if t.is_floating_point()]


def all_finite(tensors: list[torch.Tensor]) -> list[bool]:
    """Whether each tensor holds only finite values, for all of them in a few multi-tensor kernels and one read
    (a caller with many clients asks once: on a GPU one wait, not one per tensor). t * 0 is 0 where t is finite
    and NaN where it is infinite or NaN, so the L1 norm of t * 0 is 0 exactly when t is all finite (a norm or sum
    of t itself could overflow)."""
    finite = [True] * len(tensors)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):  # a state kept on the host beside replies on a GPU: one read per device
        by_device.setdefault(t.device, []).append(i)
    for positions in by_device.values():
        norms = torch._foreach_norm(torch._foreach_mul([tensors[i] for i in positions], 0.0), 1)
        for i, norm in zip(positions, torch.stack([n.float() for n in norms]).tolist(), strict=True):
            finite[i] = norm == 0
    return finite


def raise_nonfinite(reply: Reply, finite: list[bool], tensors: list[tuple[str, torch.Tensor]]) -> None:
    """FloatingPointError naming the first of ``tensors`` that ``finite`` says is not, or the first non-finite
    float scalar or metric of the reply."""
    for (what, _), ok in zip(tensors, finite, strict=True):
        if not ok:
            raise FloatingPointError(f"{what} has non-finite values")
    for name, v in {**reply.scalars, **reply.metrics}.items():
        if isinstance(v, float) and not math.isfinite(v):
            raise FloatingPointError(f"reply value {name!r} is {v}")


@dataclass
class RoundResult:
    """One phase's replies (by client) and failure records (failures.jsonl)."""

    replies: dict[int, Reply]
    failures: list[dict[str, Any]]


def failure_record(rnd: int, phase: str, cid: int, err: BaseException) -> dict[str, Any]:
    return {
        "round": rnd,
        "phase": phase,
        "client": cid,
        "error": f"{type(err).__name__}: {err}",
        "where": traceback.format_exc(limit=3).splitlines()[-3:],
    }


class Executor(Protocol):
    def run_phase(
        self, rnd: int, phase_idx: int, phase: str, msgs: dict[int, Message]
    ) -> tuple[dict[int, Reply], list[dict[str, Any]]]: ...

    def personal_accuracies(
        self, rnd: int, cids: list[int], msg: Message, batch_size: int
    ) -> dict[int, PersonalScores]: ...

    def state_dict(self) -> dict[str, Any]:
        """The client-held state as of now, for a checkpoint (plain data and tensors only)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Back to a checkpoint's client-held state; raises ``CheckpointError`` (changing nothing) if it is gone."""
        ...

    # Optional: ``check_state(state)`` raises what ``load_state_dict(state)`` would, changing nothing (the resume
    # asks it of prev.pt before it advises falling back to it); an executor without it is not asked.

    def reset(self) -> None:
        """Forget all client-held state: the run starts from round 0."""
        ...

    def retain(self, states: list[dict[str, Any]]) -> None:
        """Free saved client state that none of ``states`` (those the kept checkpoints hold) refers to."""
        ...

    def close(self) -> None:
        """The run is over (finished, failed or interrupted)."""
        ...


class LocalExecutor:
    """Runs clients one after another in this process; their persistent state lives in ``store``."""

    def __init__(
        self,
        runner: ClientRunner,
        clients: list[ClientData],
        store: MemoryStateStore | None = None,
        order: Callable[[list[int]], list[int]] | None = None,
    ) -> None:
        self.runner = runner
        self.clients = clients
        self.store = store if store is not None else MemoryStateStore()
        self.order = order or (lambda cids: cids)  # results never depend on it (tests reverse it)

    def run_phase(
        self, rnd: int, phase_idx: int, phase: str, msgs: dict[int, Message]
    ) -> tuple[dict[int, Reply], list[dict[str, Any]]]:
        replies: dict[int, Reply] = {}
        failures = []
        for cid in self.order(list(msgs)):
            try:
                reply, state = self.runner.run(
                    cid, rnd, phase_idx, phase, msgs[cid], self.clients[cid], self.store.get(cid)
                )
            except StateFileError:  # a damaged state file is the run's problem, not the client's: it stops the run
                raise
            except Exception as err:  # a failing client is dropped from the round, never the run
                failures.append(failure_record(rnd, phase, cid, err))
                continue
            self.store.put(cid, state)
            replies[cid] = reply
        return replies, failures

    def personal_accuracies(
        self, rnd: int, cids: list[int], msg: Message, batch_size: int
    ) -> dict[int, PersonalScores]:
        out = {}
        for cid in cids:
            acc = self.runner.personal_accuracy(cid, rnd, msg, self.clients[cid], self.store.get(cid), batch_size)
            if acc is not None:
                out[cid] = acc
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"clients": self.store.state_dict()}

    def check_state(self, state: dict[str, Any]) -> None:
        """Raise the ``CheckpointError`` that ``load_state_dict(state)`` would, changing nothing."""
        if "clients" not in state:
            raise CheckpointError(
                f"it was written by a {state.get('kind', 'different')} run, whose client-held state is not in this "
                "run folder; resume it the way it ran (fedhet flower simulate --resume)"
            )
        self.store.check(state["clients"])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "clients" not in state:
            self.check_state(state)  # raises: its client-held state is not in this folder
        self.store.load_state_dict(state["clients"])  # verifies the states before it changes anything

    def reset(self) -> None:
        self.store.clear()

    def retain(self, states: list[dict[str, Any]]) -> None:
        self.store.retain([s["clients"] for s in states])

    def close(self) -> None:
        pass

"""Train the clients of a phase together: stacked parameters, one vmapped forward/backward per local step.

``BatchedExecutor`` is an ``Executor`` (same state store, same failure semantics as ``LocalExecutor``) that runs
the local loop of ``algorithms.loop.train_locally`` for K clients at once:

* The K parameter vectors are the rows of one (K, P) tensor in the engine's flat layout; client k's row is its
  ``ctx.flat.params`` (and a (K, P) gradient tensor its ``ctx.flat.grad``), so every flat-vector hook of the
  algorithm runs unchanged on that client's row, and the reply's ``params`` is the row itself.
* The loss gradient of every client is one ``torch.func.vmap`` of ``grad_and_value`` of ``functional_call`` of the
  shared model: the same function as the sequential loop's ``F.cross_entropy(model(x), y)``, evaluated with the
  per-client weights batched (linear layers become batched matmuls, convolutions grouped convolutions). When fewer
  than ``vmap_from`` (3) clients are still training, their gradients are computed one by one through the shared
  model, exactly as in the sequential loop, since vmap's fixed cost per call exceeds a small model's step.
* Batch order and augmentation come from each client's own generator, derived by ``ClientRunner.context`` from
  (seed, round, client, phase) and consumed in the same order as in the sequential loop, so every client sees
  exactly the batches it would see alone. A batch shorter than ``train.batch_size`` (the last one of a pass) is
  padded with masked rows that contribute exactly zero to the loss and its gradient.
* Clients with fewer steps (less data) simply stop: rows are ordered by step count, so the clients still training
  at any step are a prefix of the rows and a finished client's row is never touched again.
* The optimiser is ``train.optimizer``'s update on the active rows (``FlatSGD``: momentum, Nesterov, weight decay;
  ``FlatAdam``: Adam or AdamW), its state fresh each round or each client's kept one (``train.optimizer_state``),
  written back to the client's state as the sequential loop writes it; ``train.grad_clip`` clips each client's own
  gradient norm, after the algorithm's gradient terms.

Exactness: every per-client operation is the sequential one on the client's row, so a client's result differs
from the sequential one only by the float rounding of the batched forward/backward (vmapped matmuls and
convolutions sum in another order): measured, about 1e-7 of the largest parameter after 3 rounds, often bit-identical
for small fully connected models (tests/test_batched.py asserts 1e-5). Through ReLU and max-pooling such a difference
can later flip which input a gradient flows to, exactly as a one-ulp change of the start does in a sequential run,
so long runs of conv nets agree statistically, not digit for digit. A batched run is deterministic (for the same
clients of a round and the same ``max_group``) and resumes bit for bit.

Clients are trained in groups of at most ``run.max_group``, formed in order of step count, which bounds memory
(K x P parameters, gradients and the optimiser's state, and K times the activations of one step).
``run.max_group = 0`` (auto) means 32 on a CPU and, on a GPU, as many clients as ``MEMORY_SHARE`` of the free device
memory holds at the model's per-client footprint (``client_footprint``: the rows, the batch, and one client's
forward/backward measured once); the size is fixed at the run's first batched phase.

On a GPU nothing in a local step waits for the host: the data is on the device from the start (``federate``), each
pass's permutation is drawn on the client's CPU generator and moved in one piece, clipping decides on the device and
the losses are read once after the last step. ``train.precision = "bf16"`` runs the forward/backward under bfloat16
autocast, as the sequential loop does its forward.

What it supports, checked before every phase (otherwise the phase runs sequentially, same results):

* algorithms whose class declares ``batchable = True`` (see ``Algorithm.batchable``): the default loss or their own
  functional ``loss`` (algorithms/functional.py: run under vmap with each client's ``loss_inputs``; full batches
  vmapped per set of same-shaped inputs, short ones row by row, so no loss sees padding) and hooks that touch only
  the flat vectors, the client's state and scratch, never ``ctx.model``; the others give ``unbatchable_reason``;
* models without floating buffers that training updates (BatchNorm running statistics; a module declaring
  ``fixed_buffers = True`` is allowed, its buffers shared by the group), active dropout (its random stream cannot match
  the sequential one under vmap), recurrent layers, or a module that says why not (``unbatchable_reason``: BERT's
  attention mask over padding, built by ``transformers`` with data-dependent control flow).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad_and_value, vmap
from torch.nn.utils.rnn import pad_sequence

from fedhet.algorithms.base import Algorithm, ClientContext, Message, Reply
from fedhet.algorithms.contract import step_budget
from fedhet.algorithms.functional import Apply, record_aux, split_loss
from fedhet.data.device import to_device
from fedhet.data.types import ClientData
from fedhet.engine.checkpoint import StateFileError
from fedhet.engine.client import (
    ClientRunner,
    LocalExecutor,
    PersonalScores,
    all_finite,
    failure_record,
    floating_tensors,
    overrides,
    raise_nonfinite,
)
from fedhet.engine.memory import available_memory
from fedhet.engine.state import MemoryStateStore
from fedhet.toolkit.compiled import Compiled
from fedhet.toolkit.flat import FlatModel, FlatVectors, named_views, parameter_layout
from fedhet.toolkit.local import (
    AdamSettings,
    Coefficient,
    adam_settings,
    batch_indices,
    keep_state,
    kept_state,
    num_local_steps,
    optimizer_state_prefix,
    precision_context,
)

if TYPE_CHECKING:
    from fedhet.config import Config, TrainSection

# The hooks a batchable algorithm may override; the loss and the loop itself must be the base ones.
_REPLACED = ("client_update", "local_loss")


def algorithm_unbatchable(algo: Algorithm, phase: str | None = None) -> str | None:
    """Why ``algo``'s client update (in ``phase``; None: in some phase) cannot be batched, or None when it can.

    The declaration is not inherited: a subclass (FedLC, MOON, ... of FedAvg) changes the loss and must declare
    ``batchable = True`` itself. A ``client_update`` that runs the shared loop only in some phases names them in
    ``loop_phases`` (SphereFed: "train"); the other phases run sequentially."""
    cls = type(algo)
    if not cls.__dict__.get("batchable", False):
        reason = getattr(cls, "unbatchable_reason", None)  # inherited: subclasses share the mechanism
        return f"algorithm {cls.name!r} " + (reason or "does not declare batchable")
    loop_phases = cls.__dict__.get("loop_phases", ())
    for hook in _REPLACED:
        if not overrides(algo, hook):
            continue
        if hook == "client_update" and loop_phases and (phase is None or phase in loop_phases):
            continue
        where = f" (batched phases: {', '.join(loop_phases)})" if hook == "client_update" and loop_phases else ""
        return f"algorithm {cls.name!r} overrides {hook}" + where
    return None


def model_unbatchable(flat: FlatModel) -> str | None:
    """Why the model cannot be trained under vmap to the sequential loop's results, or None when it can.

    Floating buffers are allowed only in modules that declare ``fixed_buffers = True`` (FedNH's and SphereFed's
    fixed classifiers): training never changes them, so the clients of a group share the received ones."""
    for name, module in flat.model.named_modules():
        held = [b for b in module.buffers(recurse=False) if b.is_floating_point()]
        if held and not getattr(module, "fixed_buffers", False):
            return f"the model has buffers that training updates ({name or 'the model'}: e.g. BatchNorm statistics)"
    for name, module in flat.model.named_modules():
        reason = getattr(module, "unbatchable_reason", None)  # a module that knows vmap cannot trace it
        if reason:
            return f"the model {reason} ({name})"
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            return f"the model has active dropout ({name}): its random stream cannot match the sequential one"
        if isinstance(module, nn.RNNBase):
            return f"the model has a recurrent layer ({name})"
    return None


def runner_unbatchable(runner: ClientRunner, phase: str | None = None) -> str | None:
    if runner.local_diagnostics:
        return "run.eval_local_models evaluates each client's local model"
    if runner.lora_ranks is not None:
        return "model.lora_ranks gives each client its own adapter rank, a mask the shared model cannot vary per row"
    if runner.attack is not None:
        return "[attack] changes the malicious clients' batches or replies in the sequential client runner"
    privacy = getattr(runner.algo.setup, "privacy", None)
    if privacy is not None and privacy.mode == "local":
        return "local DP-SGD clips per-sample gradients in the sequential loop"
    return algorithm_unbatchable(runner.algo, phase) or model_unbatchable(runner.flat)


class RowFlat(FlatVectors):
    """One client's row of the stacked parameters, with ``FlatModel``'s interface for the algorithm's hooks."""

    def __init__(self, flat: FlatModel, params: torch.Tensor, grad: torch.Tensor) -> None:
        self.model = flat.model
        self._flat = flat
        self.params = params
        self.grad = grad
        self.buffers = flat.buffers  # fixed buffers only (model_unbatchable), shared by the group

    def set_buffers(self, vec: torch.Tensor) -> None:
        if not torch.equal(vec, self.buffers):
            raise ValueError("the clients of a batched group share the model's fixed buffers")

    def slices(self) -> dict[str, slice]:
        return self._flat.slices()


class _SharedFailure(Exception):
    """The batched forward/backward itself failed (not one client's hook): the group runs sequentially instead."""


class _Client:
    """One client of a group: its context, its step count, its batch stream and whether it is still in the round."""

    def __init__(self, ctx: ClientContext, total: int) -> None:
        self.ctx = ctx
        self.total = total
        self.batches: Iterator[torch.Tensor] | None = None
        self.alive = True
        self.inputs: dict[str, torch.Tensor] = {}  # the algorithm's loss_inputs, read once after before_local
        self.signature: tuple = ()  # clients whose inputs have the same names and shapes share one vmapped call

    def read_inputs(self, algo: Algorithm) -> None:
        self.inputs = algo.loss_inputs(self.ctx)
        self.signature = tuple((n, v.shape, v.dtype) for n, v in sorted(self.inputs.items()))


class BatchedExecutor:
    """Runs the clients of a phase as batched computations of at most ``max_group`` clients each.

    The state store, ``personal_accuracies`` and the checkpointed state are those of the sequential
    ``LocalExecutor`` it holds (``self.sequential``), which also runs any phase the batched path does not support.
    """

    def __init__(
        self,
        runner: ClientRunner,
        clients: list[ClientData],
        store: MemoryStateStore | None = None,
        max_group: int = 0,
        vmap_from: int = 3,
        compile_mode: str = "off",
    ) -> None:
        self.sequential = LocalExecutor(runner, clients, store)
        self.runner = runner
        self.clients = clients
        self.store = self.sequential.store
        self.max_group = max_group  # 0: chosen from memory at the first batched phase (group_size)
        self.vmap_from = vmap_from
        self._layout = parameter_layout(runner.model)
        self._grad_fn = vmap(grad_and_value(self._client_loss))
        self._own_fn = vmap(grad_and_value(self._own_client_loss, has_aux=True), in_dims=(0, 0, 0, 0, None))
        device = runner.flat.params.device
        self._compiled_step = Compiled(self._flat_gradients, compile_mode, device, "the batched step")
        self._compiled_own = Compiled(self._own_flat_gradients, compile_mode, device, "the batched step")
        self._apply = Apply(runner.model)  # the algorithm's own loss as a module over the shared model
        self._own_loss = overrides(runner.algo, "loss")
        self._stacked: dict[tuple[int, ...], tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = {}
        self.last_phase_batched = False  # for tests and benchmarks: did the last phase take the batched path
        self.phase_batched: dict[str, bool] = {}  # the same, per phase name

    # ------------------------------------------------------------------ Executor protocol
    def unsupported(self, phase: str | None = None) -> str | None:
        return runner_unbatchable(self.runner, phase)

    def run_phase(
        self, rnd: int, phase_idx: int, phase: str, msgs: dict[int, Message]
    ) -> tuple[dict[int, Reply], list[dict[str, Any]]]:
        self.last_phase_batched = self.phase_batched[phase] = self.unsupported(phase) is None
        if not self.last_phase_batched:
            return self.sequential.run_phase(rnd, phase_idx, phase, msgs)
        t = self.runner.train
        steps = {  # the system model's step budget, where a message carries one, caps a client's count
            cid: step_budget(msg, num_local_steps(len(self.clients[cid]), t.batch_size, t.local_epochs, t.local_steps))
            for cid, msg in msgs.items()
        }
        # Rows by decreasing step count, so the clients still training at any step are a prefix of the rows.
        ordered = sorted(msgs, key=lambda cid: (-steps[cid], cid))
        replies: dict[int, Reply] = {}
        failures: list[dict[str, Any]] = []
        if not self.max_group:
            self.max_group = self.auto_group()
        for start in range(0, len(ordered), self.max_group):
            group = set(ordered[start : start + self.max_group])
            group_msgs = {cid: msg for cid, msg in msgs.items() if cid in group}
            try:
                if not self._load_buffers(group_msgs):  # per-client buffers: the group cannot share the model's
                    r, f = self.sequential.run_phase(rnd, phase_idx, phase, group_msgs)
                else:
                    r, f = self._run_group(rnd, phase_idx, phase, group_msgs, steps)
            except _SharedFailure as err:
                warnings.warn(
                    f"round {rnd} ({phase}): the batched computation failed ({err.__cause__!r}); "
                    "these clients run one after another instead",
                    RuntimeWarning,
                    stacklevel=2,
                )
                r, f = self.sequential.run_phase(rnd, phase_idx, phase, group_msgs)
            replies.update(r)
            failures.extend(f)
        position = {cid: i for i, cid in enumerate(msgs)}
        failures.sort(key=lambda rec: position[rec["client"]])  # the sequential executor's order
        return replies, failures

    def _load_buffers(self, msgs: dict[int, Message]) -> bool:
        """Load the received fixed buffers into the shared model; False when the messages' buffers differ."""
        flat = self.runner.flat
        received = [msg.tensors["buffers"] for msg in msgs.values() if "buffers" in msg.tensors]
        if not flat.buffers.numel() or not received:
            return True
        if len(received) < len(msgs) or any(b is not received[0] and not torch.equal(b, received[0]) for b in received):
            return False
        flat.set_buffers(received[0])
        return True

    def auto_group(self) -> int:
        """``run.max_group = 0``: ``CPU_GROUP`` off a GPU; on one, what its free memory holds (``group_size``)."""
        flat = self.runner.flat
        device = flat.params.device
        room = available_memory(device) if device.type in MEMORY_DEVICES else None
        if room is None:
            return CPU_GROUP
        data = next((c for c in self.clients if len(c)), self.clients[0])
        return group_size(room[0], client_footprint(self.runner, data, self.runner.train.batch_size))

    def personal_accuracies(
        self, rnd: int, cids: list[int], msg: Message, batch_size: int
    ) -> dict[int, PersonalScores]:
        return self.sequential.personal_accuracies(rnd, cids, msg, batch_size)

    def state_dict(self) -> dict[str, Any]:
        return self.sequential.state_dict()

    def check_state(self, state: dict[str, Any]) -> None:
        self.sequential.check_state(state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sequential.load_state_dict(state)

    def reset(self) -> None:
        self.sequential.reset()

    def retain(self, states: list[dict[str, Any]]) -> None:
        self.sequential.retain(states)

    def close(self) -> None:
        self.sequential.close()

    # ------------------------------------------------------------------ the batched loop
    def _client_loss(
        self, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, count: torch.Tensor
    ) -> torch.Tensor:
        """One client's mean cross-entropy over the unmasked rows of its batch (vmapped over clients).

        With mask 1 and count B this is ``F.cross_entropy(model(x), y)``, forward and backward: the backward gives
        each sample exactly 1/B as the mean's does, and -log_softmax picked at the label is what nll_loss computes
        (written with gather, which vmaps without nll_loss's decomposition). Masked rows contribute exactly zero."""
        logits = functional_call(self.runner.model, params, (x,))
        nll = -logits.log_softmax(-1).gather(-1, y.unsqueeze(-1)).squeeze(-1)
        return (nll * mask).sum() / count

    def _gradients(
        self, rows: torch.Tensor, grad_rows: torch.Tensor, batch: _Batch, m: int, members: list[_Client]
    ) -> torch.Tensor:
        """The loss gradient of each of the m active rows into ``grad_rows``; returns their (m,) losses.

        Fewer than ``vmap_from`` rows go one by one through the shared model, exactly as in the sequential loop
        (vmap's fixed cost per call exceeds a small model's step); more go through one vmapped call."""
        if self._own_loss:
            return self._loss_gradients(rows, grad_rows, batch, m, members)
        x, y = batch.x[:m], batch.y[:m]
        if m < self.vmap_from:
            flat, model, losses = self.runner.flat, self.runner.model, []
            for k in range(m):
                b = batch.lengths[k]
                flat.set_params(rows[k])
                flat.zero_grad()
                if b:
                    loss = F.cross_entropy(model(x[k, :b]), y[k, :b])
                    loss.backward()
                    losses.append(loss.detach())
                else:  # a dropped client's row: no gradient
                    losses.append(rows.new_zeros(()))
                grad_rows[k].copy_(flat.grad)
            return torch.stack(losses)
        if self._compiled_step.on:
            flat_grads, losses = self._compiled_step(rows, x, y, batch.mask[:m], batch.count[:m])
            grad_rows.copy_(flat_grads)
            return losses.detach()
        grads, losses = self._grad_fn(self._param_views(rows), x, y, batch.mask[:m], batch.count[:m])
        torch.cat([grads[name].reshape(m, -1) for name, _, _ in self._layout], dim=1, out=grad_rows)
        return losses.detach()

    def _flat_gradients(
        self, rows: torch.Tensor, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, count: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' loss gradients as one (m, P) tensor and their losses: the step ``run.compile`` compiles."""
        grads, losses = self._grad_fn(self._param_views(rows), x, y, mask, count)
        return torch.cat([grads[name].reshape(len(rows), -1) for name, _, _ in self._layout], dim=1), losses

    def _own_flat_gradients(
        self,
        rows: torch.Tensor,
        x: torch.Tensor,
        y: torch.Tensor,
        batched: dict[str, torch.Tensor],
        shared: dict[str, torch.Tensor],
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, dict[str, torch.Tensor]]]:
        """``_flat_gradients`` for an algorithm's own loss: (m, P) gradients, (losses, extra outputs)."""
        grads, out = self._own_fn(self._param_views(rows), x, y, batched, shared)
        return torch.cat([grads[name].reshape(len(rows), -1) for name, _, _ in self._layout], dim=1), out

    def _loss_gradients(
        self, rows: torch.Tensor, grad_rows: torch.Tensor, batch: _Batch, m: int, members: list[_Client]
    ) -> torch.Tensor:
        """``_gradients`` for an algorithm with its own ``loss`` (algorithms/functional.py), which may use batch
        statistics and so never sees padding: the clients with a full batch and inputs of the same shapes go through
        one vmapped call per such set; a short batch (the last of a pass) or a set smaller than ``vmap_from`` goes
        one by one through the shared model, as in the sequential loop."""
        losses = rows.new_zeros(m)
        sets: dict[tuple, list[int]] = {}
        alone: list[int] = []
        for k in range(m):
            b = batch.lengths[k]
            if not b:  # a dropped client's row: no gradient
                grad_rows[k].zero_()
            elif b == batch.x.shape[1]:
                sets.setdefault(members[k].signature, []).append(k)
            else:
                alone.append(k)
        for ks in sets.values():
            if len(ks) < self.vmap_from:
                alone.extend(ks)
                continue
            idx = to_device(torch.tensor(ks), rows.device)  # no host wait: a pinned, queued copy
            batched, shared = self._loss_inputs(ks, members)
            selected = rows.index_select(0, idx)
            flat, (values, aux) = self._compiled_own(selected, batch.x[idx], batch.y[idx], batched, shared)
            for i, k in enumerate(ks):
                record_aux(members[k].ctx.scratch, {name: v[i] for name, v in aux.items()})
            grad_rows.index_copy_(0, idx, flat)
            losses[idx] = values.detach().to(losses.dtype)
        flat, algo = self.runner.flat, self.runner.algo
        for k in alone:
            b = batch.lengths[k]
            flat.set_params(rows[k])
            flat.zero_grad()
            loss, aux = split_loss(algo.loss(self.runner.model, batch.x[k, :b], batch.y[k, :b], members[k].inputs))
            record_aux(members[k].ctx.scratch, aux)
            loss.backward()
            losses[k] = loss.detach()
            grad_rows[k].copy_(flat.grad)
        return losses

    def _loss_inputs(
        self, ks: list[int], members: list[_Client]
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(stacked per-client inputs, inputs that are one tensor for all of ``ks``: e.g. the received global
        model), built once per set of rows and round."""
        key = tuple(members[k].ctx.cid for k in ks)
        if key not in self._stacked:
            first = members[ks[0]].inputs
            shared = {n: v for n, v in first.items() if all(members[k].inputs[n] is v for k in ks)}
            batched = {n: torch.stack([members[k].inputs[n] for k in ks]) for n in first if n not in shared}
            self._stacked[key] = (batched, shared)
        return self._stacked[key]

    def _own_client_loss(
        self,
        params: dict[str, torch.Tensor],
        x: torch.Tensor,
        y: torch.Tensor,
        batched: dict[str, torch.Tensor],
        shared: dict[str, torch.Tensor],
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One client's ``algo.loss`` at its row's parameters, and its extra outputs (vmapped over clients)."""
        tensors = {f"model.{name}": t for name, t in params.items()}
        return split_loss(functional_call(self._apply, tensors, (self.runner.algo.loss, x, y, {**batched, **shared})))

    def _param_views(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        return named_views(rows, self._layout)

    def _run_group(
        self, rnd: int, phase_idx: int, phase: str, msgs: dict[int, Message], steps: dict[int, int]
    ) -> tuple[dict[int, Reply], list[dict[str, Any]]]:
        runner, algo, t = self.runner, self.runner.algo, self.runner.train
        flat = runner.flat
        failures: list[dict[str, Any]] = []
        runner.model.train()
        self._stacked = {}  # this group's stacked loss inputs
        step_inputs = getattr(type(algo), "step_inputs", False)  # inherited: reading per step is never wrong
        reads_model = overrides(algo, "before_local") or (not step_inputs and overrides(algo, "loss_inputs"))
        # Contexts in message order (each reseeds the global RNG, which then ends as the sequential executor's does).
        contexts: dict[int, ClientContext] = {}
        for cid, msg in msgs.items():
            try:
                contexts[cid] = runner.context(cid, rnd, phase_idx, phase, msg, self.clients[cid], self.store.get(cid))
            except StateFileError:  # a damaged state file stops the run, as in the sequential executor
                raise
            except Exception as err:  # e.g. its stored state is unreadable: dropped, as by the sequential executor
                failures.append(failure_record(rnd, phase, cid, err))
        if not contexts:
            return {}, failures
        order = sorted(contexts, key=lambda cid: (-steps[cid], cid))
        row = {cid: k for k, cid in enumerate(order)}
        params = flat.params.new_zeros(len(order), flat.num_params)
        grads = torch.zeros_like(params)
        members: list[_Client] = []

        def drop(k: int, err: BaseException) -> None:  # call inside the except block (the record takes the trace)
            members[k].alive = False
            batch.clear(k)
            failures.append(failure_record(rnd, phase, members[k].ctx.cid, err))

        for k, cid in enumerate(order):
            ctx = contexts[cid]
            ctx.flat = RowFlat(flat, params[k], grads[k])
            members.append(_Client(ctx, steps[cid]))
        batch = _Batch(members[0].ctx.data, len(order), t.batch_size, params)
        group_data = _GroupData.build(members, params.device)
        index_device = None if group_data is not None else members[0].ctx.data.x.device  # fused: the host's
        start = _common_start(members, params)
        if start is not None:  # every row starts from the same received model: one broadcast copy
            params.copy_(start.to(params.device).expand_as(params))
        for k, client in enumerate(members):
            ctx = client.ctx
            try:
                if start is None:
                    ctx.flat.set_params(ctx.message.tensors["params"])
                ctx.lr = float(ctx.message.scalars.get("lr", t.lr))
                if reads_model:  # a hook reading ctx.model sees the client's parameters
                    flat.set_params(params[k])
                algo.before_local(ctx)
                if not step_inputs:  # read once; per step otherwise (below)
                    client.read_inputs(algo)
                client.batches = batch_indices(len(ctx.data), t.batch_size, client.total, ctx.generator, index_device)
            except Exception as err:
                drop(k, err)
        kept = optimizer_state_prefix(phase) if t.optimizer_state == "client" else None
        opt = _RowOptimizer(t, params, grads, members, kept)

        step_losses: list[torch.Tensor] = []  # (m,) per step, read once at the end (no sync per step on a GPU)
        has_after_backward, has_after_step = overrides(algo, "after_backward"), overrides(algo, "after_step")
        active = [sum(1 for c in members if c.total > step) for step in range(members[0].total)]
        for step, m in enumerate(active):  # m: the clients still training are rows 0..m-1 (sorted by step count)
            if group_data is not None:
                idxs: list[torch.Tensor | None] = [None] * m
                for k in range(m):
                    if members[k].alive:
                        try:
                            idxs[k] = next(members[k].batches)
                        except Exception as err:
                            drop(k, err)
                batch.gather(group_data, idxs, members)
            else:  # client by client: augmentation draws from each client's generator between its batches
                for k in range(m):
                    if members[k].alive:
                        try:
                            batch.load(k, members[k].ctx, next(members[k].batches))
                        except Exception as err:
                            drop(k, err)
            rows, grad_rows = params[:m], grads[:m]
            if step_inputs:
                self._stacked = {}
                for k in range(m):
                    if members[k].alive:
                        flat.set_params(rows[k])  # loss_inputs may evaluate the client's model (FedACD's P)
                        try:
                            members[k].read_inputs(algo)
                        except Exception as err:
                            drop(k, err)
            try:
                with precision_context(t.precision, params.device):
                    losses = self._gradients(rows, grad_rows, batch, m, members)
            except Exception as err:
                raise _SharedFailure(str(err)) from err
            if has_after_backward:
                for k in range(m):
                    if members[k].alive:
                        try:
                            algo.after_backward(members[k].ctx)
                        except Exception as err:
                            drop(k, err)
            if t.grad_clip is not None:  # clip_grad_norm on each row
                norms = torch.linalg.vector_norm(grad_rows, dim=1, keepdim=True)
                grad_rows.mul_(torch.where(norms > t.grad_clip, t.grad_clip / (norms + 1e-6), torch.ones_like(norms)))
            opt.step(step, m)
            step_losses.append(losses.float())
            for k in range(m):
                client = members[k]
                if client.alive:
                    client.ctx.steps += 1
                    if has_after_step:
                        try:
                            algo.after_step(client.ctx)
                        except Exception as err:
                            drop(k, err)

        totals = [0.0] * len(order)  # the sequential loop's Python float sum of the same float32 losses
        values, pos = torch.cat(step_losses).tolist(), 0
        for m in active:
            for k in range(m):
                totals[k] += values[pos + k]
            pos += m
        finished = []  # (cid, reply) of the clients whose after_local returned
        evaluates = overrides(algo, "after_local")
        for cid in contexts:
            client = members[row[cid]]
            if not client.alive:
                continue
            ctx = client.ctx
            ctx.loss_sum = totals[row[cid]]
            if kept is not None:
                keep_state(ctx.state, kept, opt.row_state(row[cid]))
            if evaluates:  # its after_local may evaluate the trained model through ctx.model
                flat.set_params(params[row[cid]])
            try:
                finished.append((cid, algo.after_local(ctx)))
            except Exception as err:
                failures.append(failure_record(rnd, phase, cid, err))
        return self._checked(rnd, phase, finished, {cid: members[row[cid]].ctx.state for cid, _ in finished}, failures)

    def _checked(
        self,
        rnd: int,
        phase: str,
        finished: list[tuple[int, Reply]],
        states: dict[int, dict[str, torch.Tensor]],
        failures: list[dict[str, Any]],
    ) -> tuple[dict[int, Reply], list[dict[str, Any]]]:
        """The finished clients' replies, each client's state stored; a client whose reply or state is not finite
        is dropped as ``check_finite`` drops it, all of the group's flags read at once (one wait on a GPU, not one
        per client)."""
        tensors = [floating_tensors(reply, states[cid]) for cid, reply in finished]
        flags = all_finite([t for client in tensors for _, t in client])
        replies: dict[int, Reply] = {}
        pos = 0
        for (cid, reply), client in zip(finished, tensors, strict=True):
            finite, pos = flags[pos : pos + len(client)], pos + len(client)
            try:
                raise_nonfinite(reply, finite, client)
            except FloatingPointError as err:
                failures.append(failure_record(rnd, phase, cid, err))
                continue
            self.store.put(cid, states[cid])
            replies[cid] = reply
        return replies, failures


def _common_start(members: list[_Client], params: torch.Tensor) -> torch.Tensor | None:
    """The received parameters when every member's message carries the same tensor (the usual broadcast of the
    global model) of the rows' shape, else None (each row set on its own, as the sequential loop does)."""
    first = members[0].ctx.message.tensors.get("params")
    if first is None or first.shape != params.shape[1:]:
        return None
    return first if all(c.ctx.message.tensors.get("params") is first for c in members) else None


class _RowOptimizer:
    """``train.optimizer`` on the rows of a group's (K, P) parameters: on each row the update ``FlatSGD`` or
    ``FlatAdam`` makes on that client's vector, each step on the rows still training (``[:m]``). The state starts
    fresh, or from each client's kept one (``kept``: its key prefix in ``ctx.state``), as the sequential loop's."""

    def __init__(
        self, t: TrainSection, params: torch.Tensor, grads: torch.Tensor, members: list[_Client], kept: str | None
    ) -> None:
        self.t, self.params, self.grads = t, params, grads
        self.members = members
        self.lrs = [c.ctx.lr for c in members]
        alive = [k for k, c in enumerate(members) if c.alive]  # a dropped client's row is discarded: its values
        # (lr, state) do not matter
        self.uniform_lr = len({self.lrs[k] for k in alive}) <= 1
        self.lr: float | torch.Tensor = self.lrs[alive[0]] if alive and self.uniform_lr else 0.0
        if not self.uniform_lr:  # messages with different learning rates
            self.lr = params.new_tensor(self.lrs)[:, None]
        saved = [kept_state(c.ctx.state, kept) if kept is not None and c.alive else {} for c in members]
        self.buf: torch.Tensor | None = None  # SGD's momentum, made at the first step (which every client takes)
        self.kept_buf = {k: s["momentum"] for k, s in enumerate(saved) if "momentum" in s}
        self.adam = adam_settings(t) if t.optimizer != "sgd" else None
        self.counts = [int(s["step"]) if "step" in s else 0 for s in saved]
        self.saved = saved
        self.exp_avg: torch.Tensor | None = None
        self.exp_avg_sq: torch.Tensor | None = None
        self.table: list[torch.Tensor] | None = None  # per (step, row) Adam coefficients where rows differ
        self.uniform_count = len({self.counts[k] for k in alive}) <= 1
        self.first = self.counts[alive[0]] if alive else 0

    def step(self, step: int, m: int) -> None:
        """The step numbered ``step`` (from 0) of the rows ``[:m]``, with their gradients in ``grads[:m]``."""
        if self.adam is None:
            self.sgd_step(m)
        else:
            self.adam_step(self.adam, step, m)
        for k in range(m):
            self.counts[k] += 1

    def sgd_step(self, m: int) -> None:
        """FlatSGD.direction and step, on the active rows."""
        t, rows, grad_rows = self.t, self.params[:m], self.grads[:m]
        d = grad_rows.add(rows, alpha=t.weight_decay) if t.weight_decay else grad_rows
        if t.momentum:
            if self.buf is None:
                self.buf = d.clone()
                for k, buf in self.kept_buf.items():  # a kept buffer continues: buf <- momentum buf + d
                    self.buf[k] = buf.to(d.device).mul(t.momentum).add_(d[k])
            else:
                self.buf[:m].mul_(t.momentum).add_(d)
            d = d.add(self.buf[:m], alpha=t.momentum) if t.nesterov else self.buf[:m]
        if isinstance(self.lr, float):
            rows.sub_(d, alpha=self.lr)
        else:
            rows.sub_(d * self.lr[:m])

    def adam_step(self, hp: AdamSettings, step: int, m: int) -> None:
        """FlatAdam.step on the active rows: one coefficient for all while they share lr and step count (the
        sequential arithmetic exactly), else a column of them, from a table moved to the device once."""
        if self.exp_avg is None or self.exp_avg_sq is None:
            self.exp_avg, self.exp_avg_sq = torch.zeros_like(self.params), torch.zeros_like(self.params)
            for k, s in enumerate(self.saved):
                if "step" in s:
                    self.exp_avg[k] = s["exp_avg"].to(self.params.device)
                    self.exp_avg_sq[k] = s["exp_avg_sq"].to(self.params.device)
        coefficients: tuple[Coefficient, Coefficient, Coefficient]
        if self.uniform_lr and self.uniform_count:
            coefficients = hp.coefficients(float(self.lr), self.first + step + 1)
        else:
            table = self.coefficient_table(hp)
            coefficients = (table[0][step, :m, None], table[1][step, :m, None], table[2][step, :m, None])
        hp.update(self.params[:m], self.grads[:m], self.exp_avg[:m], self.exp_avg_sq[:m], coefficients)

    def coefficient_table(self, hp: AdamSettings) -> list[torch.Tensor]:
        """(steps, K) tensors of each row's step size, sqrt(1 - beta2^t) and decay factor, computed once."""
        if self.table is None:
            steps = self.members[0].total
            start = list(self.counts)  # before the first step
            values = [
                [hp.coefficients(lr, c + s + 1) for lr, c in zip(self.lrs, start, strict=True)] for s in range(steps)
            ]
            host = torch.tensor(values, dtype=self.params.dtype)  # (steps, K, 3)
            self.table = list(host.to(self.params.device).unbind(-1))
        return self.table

    def row_state(self, k: int) -> dict[str, torch.Tensor]:
        """Row k's optimiser state after the round, as ``FlatSGD`` / ``FlatAdam.state_dict`` give it."""
        if self.adam is None:
            return {} if self.buf is None else {"momentum": self.buf[k].clone()}
        if self.exp_avg is None or self.exp_avg_sq is None:
            return {}
        step = torch.tensor(self.counts[k])
        return {"exp_avg": self.exp_avg[k].clone(), "exp_avg_sq": self.exp_avg_sq[k].clone(), "step": step}


class _Batch:
    """Row k holds client k's current mini-batch, padded to the batch size with masked samples."""

    def __init__(self, data: ClientData, rows: int, batch_size: int, like: torch.Tensor) -> None:
        device = like.device
        self.x = torch.zeros(rows, batch_size, *data.x.shape[1:], dtype=data.x.dtype, device=device)
        self.y = torch.zeros(rows, batch_size, dtype=data.y.dtype, device=device)
        self.mask = torch.ones(rows, batch_size, dtype=like.dtype, device=device)
        self.count = torch.full((rows,), float(batch_size), dtype=like.dtype, device=device)
        self.lengths = [batch_size] * rows

    def load(self, k: int, ctx: ClientContext, idx: torch.Tensor) -> None:
        """The client's batch ``idx``, augmented with its own generator as the sequential loop does, into row k."""
        b, data = len(idx), ctx.data
        x_row = self.x[k, :b]
        if ctx.augment is None and data.x.device == x_row.device:
            torch.index_select(data.x, 0, idx.to(data.x.device), out=x_row)
        else:
            x = data.x[idx]
            x_row.copy_(x if ctx.augment is None else ctx.augment(x, ctx.generator))
        self.y[k, :b] = data.y[idx]
        self.set_length(k, b)
        ctx.batch = idx

    def gather(self, data: _GroupData, idxs: list[torch.Tensor | None], members: list[_Client]) -> None:
        """Rows 0..m-1 at once: client k's batch ``idxs[k]`` (its sample indices on the host; None: no batch, a
        dropped client) from the group's samples, in one gather for the inputs and one for the labels, the indices
        sent to the device in one copy. Each client's ``ctx.batch`` is its row of the indices on the device."""
        m, size = len(idxs), self.x.shape[1]
        lengths = [0 if idx is None else len(idx) for idx in idxs]
        host = torch.zeros(m, size + 1, dtype=torch.long)  # fresh each step: an earlier ctx.batch stays as it was
        none = torch.zeros(0, dtype=torch.long)
        padded = pad_sequence([none if idx is None else idx for idx in idxs], batch_first=True)  # one call, not m
        host[:, : padded.shape[1]] = padded
        host[:, size] = torch.tensor(lengths)
        moved = to_device(host, self.x.device)  # one queued copy from pinned memory on a GPU; the host's on a CPU
        local, counts = moved[:, :size], moved[:, size]
        rows = (local + data.starts[:m, None]).reshape(-1)  # a padded slot reads the client's first sample, masked
        torch.index_select(data.x, 0, rows, out=self.x[:m].view(m * size, *self.x.shape[2:]))
        torch.index_select(data.y, 0, rows, out=self.y[:m].view(-1))
        if lengths != self.lengths[:m]:
            self.mask[:m].copy_(torch.arange(size, device=self.x.device) < counts[:, None])
            self.count[:m].copy_(counts.clamp(min=1))
            self.lengths[:m] = lengths
        for k in range(m):
            if lengths[k]:
                members[k].ctx.batch = local[k, : lengths[k]]

    def clear(self, k: int) -> None:
        """A dropped client's row trains on nothing from now on (its results are discarded)."""
        self.set_length(k, 0)

    def set_length(self, k: int, b: int) -> None:
        if b != self.lengths[k]:
            self.mask[k, :b] = 1.0
            self.mask[k, b:] = 0.0
            self.count[k].fill_(float(max(b, 1)))  # a kernel: assigning a Python float copies from the host
            self.lengths[k] = b


class _GroupData:
    """A group's training samples in one tensor, each client's a block starting at ``starts[k]`` (on the device), so
    a step gathers every client's batch at once (``_Batch.gather``): a few kernels a step instead of a few per client,
    which on a GPU are launches that bound a small model's step. Built once per group and phase; the copy takes the
    group's data once more on the device. Only where no client augments its batches (augmentation draws from each
    client's generator between its batches) and the data is on the parameters' device."""

    def __init__(self, members: list[_Client], device: torch.device) -> None:
        datas = [c.ctx.data for c in members]
        self.x = torch.cat([d.x for d in datas])
        self.y = torch.cat([d.y for d in datas])
        starts, pos = [], 0
        for d in datas:
            starts.append(pos if len(d) else 0)  # a client without samples is dropped before its first batch
            pos += len(d)
        self.starts = to_device(torch.tensor(starts), device)

    @classmethod
    def build(cls, members: list[_Client], device: torch.device) -> _GroupData | None:
        usable = all(c.ctx.augment is None and c.ctx.data.x.device == device for c in members)
        return cls(members, device) if usable and any(len(c.ctx.data) for c in members) else None


# ---------------------------------------------------------------------- group size
CPU_GROUP = 32  # clients per group off a GPU (run.max_group = 0)
MEMORY_DEVICES = ("cuda",)  # device types whose free memory sizes the group (a CPU's is shared with everything else)
# the share of the free device memory a group may take: the rest is the allocator's slack, grouped convolutions'
# workspaces, evaluation and the server's vectors
MEMORY_SHARE = 0.5
# per client and parameter, in the model's dtype: the row, its gradient, vmap's gradients before they are
# concatenated, the momentum buffer, the step direction and one temporary (weight decay, clipping)
ROW_COPIES = 6
# Adam's second moment and its denominator beside the first moment (which takes the momentum buffer's place)
ADAM_ROW_COPIES = ROW_COPIES + 2


def group_size(free: int, per_client: int) -> int:
    """Clients batched together when ``free`` bytes are free and one client needs ``per_client``: at least 1."""
    return max(1, int(free * MEMORY_SHARE) // max(per_client, 1))


def client_footprint(runner: ClientRunner, data: ClientData, batch_size: int) -> int:
    """Bytes one more client of a group takes: its parameter rows, its padded batch, its samples' copy in the
    group's data (``_GroupData``; ``data``'s size stands for every client's) and the activations of one
    forward/backward, measured once on the shared model (on CUDA; estimated as 4 times the logits elsewhere)."""
    flat = runner.flat
    copies = ROW_COPIES if runner.train.optimizer == "sgd" else ADAM_ROW_COPIES
    rows = copies * flat.num_params * flat.params.element_size()
    x, y = data.x[:batch_size], data.y[:batch_size]
    sample = x[0].numel() * x.element_size() + 8
    return rows + (batch_size + len(data)) * sample + activation_bytes(runner, x, y)


def activation_bytes(runner: ClientRunner, x: torch.Tensor, y: torch.Tensor) -> int:
    """Peak memory of one forward/backward of the shared model on ``x`` beyond what was allocated before it; it
    writes the gradient into ``flat.grad`` (which every step overwrites) and draws no random number."""
    device, model = x.device, runner.model
    if device.type != "cuda":
        with torch.no_grad():
            return 4 * model(x).numel() * x.element_size()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    with precision_context(runner.train.precision, device):
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    runner.flat.zero_grad()
    return max(0, torch.cuda.max_memory_allocated(device) - before)


# ---------------------------------------------------------------------- choosing the executor
# Where "auto" batches, from benchmarks/batched.py on one CPU thread (docs/performance.md, "Batched clients"): at
# least ~1.3x faster than sequential only for fully connected models with parameters x batch size up to about 1e6
# and 20 or more clients per round; slower for every convolutional model and for the 200k-parameter MLP, because on
# CPU vmap saves per-operation overhead but not arithmetic.
AUTO_MIN_CLIENTS = 20
AUTO_MAX_WORK = 1_000_000  # parameters x batch size
# On CUDA, from benchmarks/gpu.py on an H200 (docs/performance.md, "On a GPU", sweep (e)): batched / sequential
# speed at 2, 4, 8, 16, 32 clients a round was 0.84, 1.14, 2.17, 3.32, 3.97x for the 2NN (batch 10), 0.85, 1.28,
# 1.77, 3.00, 3.63x for convnet (batch 64) and 1.07, 0.98, 1.69, 1.88, 2.03x for ResNet-18-GN (batch 50): from 8
# clients every model gained at least 1.69x, below 8 none reliably (at most 1.28x, and slower for some). A small
# client's GPU step is bound by kernel launches, which batching divides by the group size.
AUTO_GPU_MIN_CLIENTS = 8


def fully_connected(model: nn.Module) -> bool:
    """True when every layer with parameters is an ``nn.Linear``."""
    return all(
        isinstance(m, nn.Linear) for m in model.modules() if not list(m.children()) and list(m.parameters(False))
    )


def batching_pays_off(flat: FlatModel, batch_size: int, clients: int, device: torch.device) -> bool:
    """Whether the batched executor was measured to be at least ~1.3x faster than the sequential one here: on a CPU
    (``AUTO_MIN_CLIENTS``, ``AUTO_MAX_WORK``) or on CUDA (``AUTO_GPU_MIN_CLIENTS``, any batchable model). Elsewhere
    (MPS: not measured) "auto" stays sequential."""
    if device.type == "cuda":
        return clients >= AUTO_GPU_MIN_CLIENTS
    return (
        device.type == "cpu"
        and clients >= AUTO_MIN_CLIENTS
        and fully_connected(flat.model)
        and flat.num_params * batch_size <= AUTO_MAX_WORK
    )


def choose_executor(cfg: Config, runner: ClientRunner) -> tuple[str, str]:
    """("batched" | "sequential", why) for ``run.executor`` and what this run trains."""
    wanted = cfg.run.executor
    if wanted == "sequential":
        return "sequential", "run.executor = sequential"
    reason = runner_unbatchable(runner)
    if reason is not None:
        return "sequential", f"the batched executor does not support this run: {reason}"
    if wanted == "batched":
        return "batched", "run.executor = batched"
    if batching_pays_off(runner.flat, cfg.train.batch_size, cfg.clients_per_round(), runner.flat.params.device):
        return "batched", "auto: measured to pay off for this model, batch size and clients per round"
    return "sequential", "auto: the batched executor is not measured to pay off here"

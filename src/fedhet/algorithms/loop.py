"""The one shared local-training loop. Algorithms change it through hooks (see ``fedhet.algorithms.base``); the
contract's types are imported for annotations only, and the contract calls this loop, so the two live in one layer."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.func import functional_call, grad_and_value

from fedhet.algorithms.contract import step_budget
from fedhet.algorithms.functional import Apply, record_aux, split_loss
from fedhet.algorithms.privacy import dp_sgd_gradient
from fedhet.toolkit.compiled import Compiled
from fedhet.toolkit.flat import named_views, parameter_layout
from fedhet.toolkit.local import (
    batch_indices,
    clip_grad_norm,
    local_optimizer,
    num_local_steps,
    optimizer_state_prefix,
    precision_context,
)

if TYPE_CHECKING:
    from fedhet.algorithms.contract import ClientContext, Reply


def train_locally(algo: Any, ctx: ClientContext) -> Reply:
    """Load the received model, run the client's local steps with the algorithm's hooks, and build the reply.

    ``algo`` is an ``Algorithm`` (``fedhet.algorithms.base``, which calls this loop): its hooks ``before_local``,
    ``local_loss``, ``after_backward``, ``after_step`` and ``after_local``."""
    msg = ctx.message
    ctx.flat.set_params(msg.tensors["params"])
    if "buffers" in msg.tensors:
        ctx.flat.set_buffers(msg.tensors["buffers"])
    ctx.lr = float(msg.scalars.get("lr", ctx.train.lr))
    ctx.model.train()
    algo.before_local(ctx)
    t = ctx.train
    opt = local_optimizer(ctx.flat, ctx.lr, t)
    kept = t.optimizer_state == "client"  # the client's optimiser state from the last round it trained in
    if kept:
        opt.load(ctx.state, optimizer_state_prefix(ctx.phase))
    ctx.scratch["optimizer"] = opt
    dp = getattr(algo.setup, "privacy", None)
    private = flat_loss(algo, ctx) if dp is not None and dp.mode == "local" else None
    total = step_budget(msg, num_local_steps(len(ctx.data), t.batch_size, t.local_epochs, t.local_steps))
    losses = []  # read once after the last step: a GPU step never waits for the host
    device = ctx.flat.params.device
    for idx in batch_indices(len(ctx.data), t.batch_size, total, ctx.generator, ctx.data.x.device):
        ctx.batch = idx
        x, y = ctx.data.x[idx], ctx.data.y[idx]
        if ctx.augment is not None:
            x = ctx.augment(x, ctx.generator)
        if ctx.poison is not None:  # a malicious client's data attack ([attack], engine/attack.py)
            x, y = ctx.poison(x, y)
        ctx.flat.zero_grad()
        if private is None and ctx.compiled is not None:
            with precision_context(t.precision, device):
                grad, loss, aux = ctx.compiled(ctx.flat.params.detach(), x, y, algo.loss_inputs(ctx))
            record_aux(ctx.scratch, aux)
            ctx.flat.grad.copy_(grad)
        elif private is None:
            with precision_context(t.precision, device):
                loss = algo.local_loss(ctx, x, y)
            loss.backward()
        else:
            grad, loss = dp_sgd_gradient(private, ctx.flat.params.detach(), x, y, dp, t.batch_size, ctx.generator)
            ctx.flat.grad.copy_(grad)
        algo.after_backward(ctx)
        if t.grad_clip is not None:
            clip_grad_norm(ctx.flat.grad, t.grad_clip)
        opt.step()
        ctx.steps += 1
        losses.append(loss.detach().float())
        algo.after_step(ctx)
    for value in torch.stack(losses).tolist() if losses else []:  # the same float sum as one float() per step
        ctx.loss_sum += value
    if kept:
        opt.save(ctx.state, optimizer_state_prefix(ctx.phase))
    return algo.after_local(ctx)


class CompiledGradient:
    """``run.compile`` in this loop: ``(flat params, x, y, inputs) -> (gradient, loss, extra outputs)`` of the
    algorithm's ``loss`` at the model's flat parameters (``functional_call`` of the model, ``grad_and_value``),
    compiled as one graph of forward and backward (``Compiled``). The loop uses it in place of ``local_loss`` and
    ``backward()`` for an algorithm whose ``local_loss`` is the contract's own (``ctx.compiled``, set by the
    client runner): the same loss, so the same gradient up to the compiler's float rounding. Buffers (batch-norm
    statistics) are the model's own, updated in place as in the uncompiled step."""

    def __init__(self, algo: Any, model: torch.nn.Module, mode: str, device: torch.device) -> None:
        self.algo = algo
        self.apply = Apply(model)
        self.layout = parameter_layout(model, prefix="model.")
        self.step = Compiled(self.gradient, mode, device, "the local step")

    def gradient(
        self, params: torch.Tensor, x: torch.Tensor, y: torch.Tensor, inputs: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        def value(p: torch.Tensor, buffers: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            tensors = {**named_views(p, self.layout), **buffers}
            return split_loss(functional_call(self.apply, tensors, (self.algo.loss, x, y, inputs)))

        # the buffers are inputs of the differentiated function: torch.func refuses in-place updates of tensors it
        # did not receive (batch-norm statistics), and passed in, they are updated in place in the model itself
        buffers = dict(self.apply.named_buffers())
        grad, (loss, aux) = grad_and_value(value, has_aux=True)(params, buffers)
        return grad, loss, aux

    def __call__(
        self, params: torch.Tensor, x: torch.Tensor, y: torch.Tensor, inputs: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        return self.step(params, x, y, inputs)


class _Loss(torch.nn.Module):
    """The algorithm's ``local_loss`` as a module over ``ctx.model``, so ``functional_call`` can run it on other
    parameters (one sample's row under vmap) while the hook reads ``ctx.model`` as usual."""

    def __init__(self, algo: Any, ctx: ClientContext) -> None:
        super().__init__()
        self.model, self.algo, self.ctx = ctx.model, algo, ctx

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.algo.local_loss(self.ctx, x, y)


def flat_loss(algo: Any, ctx: ClientContext) -> Any:
    """``loss(flat_params, x, y)``: the algorithm's local loss at a flat parameter vector (local DP-SGD)."""
    module = _Loss(algo, ctx)
    layout = parameter_layout(ctx.model, prefix="model.")

    def loss(params: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return functional_call(module, named_views(params, layout), (x, y))

    return loss

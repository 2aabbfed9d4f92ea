"""The client loss as a function of the model and tensors, so one definition serves both executors.

An algorithm writes its loss once, as ``Algorithm.loss(model, x, y, inputs)``: ``model`` is the model being trained
(its parameters are the client's current ones), ``inputs`` the tensors from ``Algorithm.loss_inputs(ctx)`` that
stay fixed during the client's local training (FedLC's calibration, the received global model for a teacher,
MOON's previous local models). The sequential loop calls it through ``local_loss(ctx, x, y)`` on ``ctx.model``;
the batched executor calls the same function under ``vmap`` inside ``functional_call``, with each client's row of
the stacked parameters as the model's parameters and each client's inputs as batched tensors (a tensor that is
the same object for every client, such as the received global model, is passed once, unbatched).

A loss that runs another copy of the architecture at other parameters (a frozen teacher) uses ``Frozen``: an
eval-mode copy called through ``functional_call``, so the teacher's parameters are an input like any other.
"""

from __future__ import annotations

from collections.abc import Callable
from math import prod
from typing import Any

import torch
from torch import nn
from torch.func import functional_call


class Apply(nn.Module):
    """``fn(model, *args)`` as a module over ``model``, so ``functional_call`` can run it at other parameters."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(self.model, *args)


def unflatten(model: nn.Module, params: torch.Tensor, buffers: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` views of flat parameter (and floating buffer) vectors in ``FlatModel``'s layout."""
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for name, p in model.named_parameters():
        if p.requires_grad:
            n = prod(p.shape)
            out[name] = params[..., offset : offset + n].reshape(*params.shape[:-1], *p.shape)
            offset += n
    if buffers is not None and buffers.shape[-1]:
        offset = 0
        for name, b in model.named_buffers():
            if b.is_floating_point():
                n = prod(b.shape)
                out[name] = buffers[..., offset : offset + n].reshape(*buffers.shape[:-1], *b.shape)
                offset += n
    return out


class Frozen:
    """An eval-mode copy of the architecture, run without gradient at given flat parameters and buffers.

    Building it forks the global RNG, so whether (and when) a teacher is built never shifts the run's random
    stream (e.g. after a resume)."""

    def __init__(self, build_model: Callable[[], nn.Module]) -> None:
        with torch.random.fork_rng(devices=[]):
            self.module = Apply(build_model().eval())

    def __call__(self, params: torch.Tensor, buffers: torch.Tensor | None, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(model, *args)`` with the copy at ``params`` / ``buffers`` (``buffers`` None or empty: its own)."""
        tensors = {f"model.{k}": v for k, v in unflatten(self.module.model, params, buffers).items()}
        with torch.no_grad():
            return functional_call(self.module, tensors, (fn, *args))


def split_loss(out: torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor]]) -> tuple[Any, dict[str, Any]]:
    """``loss`` returns the loss, or (loss, {name: 0-d tensor}) with values a hook reads later (FedRoD's two
    losses): both executors collect those per step with ``record_aux`` and the hook sums them with ``aux_sums``."""
    return out if isinstance(out, tuple) else (out, {})


def record_aux(scratch: dict[str, Any], aux: dict[str, torch.Tensor]) -> None:
    """Append one step's extra outputs to the client's lists (kept as tensors: no host sync per step)."""
    for name, value in aux.items():
        scratch.setdefault("loss_aux", {}).setdefault(name, []).append(value.detach())


def aux_sums(scratch: dict[str, Any]) -> dict[str, float]:
    """Each extra output summed over the steps, in step order as Python floats (as ``+= float(v)`` per step)."""
    out: dict[str, float] = {}
    for name, values in scratch.get("loss_aux", {}).items():
        total = 0.0
        for v in torch.stack(values).tolist():
            total += v
        out[name] = total
    return out

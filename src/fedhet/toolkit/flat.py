"""Flat parameter storage: a model's parameters (and their gradients) become views into one contiguous vector.

Federated algorithms are vector arithmetic on model weights (averages, deltas, proximal terms, control variates).
With every parameter a view into one flat tensor, reading or loading a model is a single copy and an update such as
``w -= lr * (g + mu * (w - w_global))`` is one fused operation, instead of a Python loop over parameter tensors.
Autograd accumulates into the gradient views in place, so ``flat_grad`` always holds the full gradient.

Buffers (BatchNorm running statistics) are kept in a second flat vector so they can be averaged too, while
proximal terms and optimisers touch only the parameters.
"""

from __future__ import annotations

import torch
from torch import nn


def _flatten_into(tensors: list[torch.Tensor]) -> torch.Tensor:
    if not tensors:
        return torch.zeros(0)
    return torch.cat([t.detach().reshape(-1) for t in tensors]).clone()


class FlatVectors:
    """Reading and writing a model held as flat ``params`` / ``grad`` / ``buffers`` vectors: what algorithms use."""

    params: torch.Tensor
    grad: torch.Tensor
    buffers: torch.Tensor

    @property
    def num_params(self) -> int:
        return self.params.numel()

    def get_params(self) -> torch.Tensor:
        return self.params.clone()

    def set_params(self, vec: torch.Tensor) -> None:
        self.params.copy_(vec)

    def get_buffers(self) -> torch.Tensor:
        return self.buffers.clone()

    def zero_grad(self) -> None:
        self.grad.zero_()


class FlatModel(FlatVectors):
    """Wraps ``model`` so that ``self.params`` / ``self.grad`` / ``self.buffers`` are flat views of its state."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._buffers = [b for b in model.buffers() if b.is_floating_point()]
        self.params = _flatten_into(self._params)
        self.grad = torch.zeros_like(self.params)
        self.buffers = _flatten_into(self._buffers)
        offset = 0
        for p in self._params:
            n = p.numel()
            p.data = self.params[offset : offset + n].view_as(p)
            p.grad = self.grad[offset : offset + n].view_as(p)
            offset += n
        offset = 0
        for b in self._buffers:
            n = b.numel()
            b.data = self.buffers[offset : offset + n].view_as(b)
            offset += n

    def set_buffers(self, vec: torch.Tensor) -> None:
        if vec.numel():
            self.buffers.copy_(vec)

    def slices(self) -> dict[str, slice]:
        """Where each named parameter lives in the flat vector (for algorithms that treat layers differently)."""
        out: dict[str, slice] = {}
        offset = 0
        for name, p in self.model.named_parameters():
            if p.requires_grad:
                out[name] = slice(offset, offset + p.numel())
                offset += p.numel()
        return out

    def buffer_slices(self) -> dict[str, slice]:
        """Where each named floating buffer lives in the flat buffer vector (integer buffers such as BatchNorm's
        ``num_batches_tracked`` are not in it)."""
        out: dict[str, slice] = {}
        offset = 0
        for name, b in self.model.named_buffers():
            if b.is_floating_point():
                out[name] = slice(offset, offset + b.numel())
                offset += b.numel()
        return out


def weighted_sum(vectors: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """sum_i w_i v_i without stacking (memory stays at one vector)."""
    out = torch.zeros_like(vectors[0])
    for v, w in zip(vectors, weights, strict=True):
        out.add_(v, alpha=w)
    return out


def parameter_layout(model: nn.Module, prefix: str = "") -> list[tuple[str, torch.Size, int]]:
    """(name, shape, size) of each trainable parameter, in the flat vector's order."""
    return [(prefix + name, p.shape, p.numel()) for name, p in model.named_parameters() if p.requires_grad]


def named_views(vec: torch.Tensor, layout: list[tuple[str, torch.Size, int]]) -> dict[str, torch.Tensor]:
    """name -> each parameter's view of ``vec``'s last dimension (leading dimensions, e.g. clients' rows, kept), the
    dict ``torch.func.functional_call`` takes."""
    out, offset, lead = {}, 0, vec.shape[:-1]
    for name, shape, n in layout:
        out[name] = vec[..., offset : offset + n].view(*lead, *shape)
        offset += n
    return out

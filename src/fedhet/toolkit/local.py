"""What the shared local loop (``fedhet.algorithms.loop``) trains with: per-(seed, round, client) seeds, the flat SGD
optimiser, local step counts and mini-batches, gradient clipping. Algorithms use them directly too."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from fedhet.toolkit.flat import FlatModel


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integer parts, so each (run seed, round, client, phase) has its own independent stream."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1, np.uint64)[0] >> 1)


class FlatSGD:
    """SGD with momentum, Nesterov and weight decay on a flat parameter vector (torch.optim.SGD's semantics).

    The momentum buffer starts empty every local round, as in the official code of every method we follow.
    """

    def __init__(
        self,
        flat: FlatModel,
        lr: float,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
    ) -> None:
        self.flat = flat
        self.lr = lr
        self.momentum = momentum
        self.weight_decay = weight_decay
        self.nesterov = nesterov
        self.buf: torch.Tensor | None = None

    def direction(self) -> torch.Tensor:
        """The step direction d such that the update is w <- w - lr * d."""
        g = self.flat.grad
        if self.weight_decay:
            g = g.add(self.flat.params, alpha=self.weight_decay)
        if not self.momentum:
            return g
        if self.buf is None:
            self.buf = g.clone()
        else:
            self.buf.mul_(self.momentum).add_(g)
        return g.add(self.buf, alpha=self.momentum) if self.nesterov else self.buf

    def step(self) -> None:
        self.flat.params.sub_(self.direction(), alpha=self.lr)


def num_local_steps(n: int, batch_size: int, epochs: float, steps: int | None) -> int:
    """Local steps of a client with ``n`` samples: a fixed count, or ``epochs`` passes of ceil(n / B) batches."""
    if steps is not None:
        return steps
    return max(1, math.ceil(epochs * math.ceil(n / batch_size)))


def batch_indices(
    n: int, batch_size: int, total_steps: int, generator: torch.Generator, device: torch.device | None = None
) -> Iterator[torch.Tensor]:
    """Mini-batches of sample indices: a fresh permutation per pass, the last batch of a pass may be short.

    The permutation is drawn on the (CPU) generator, so every device sees the same batches, and moved to ``device``
    (where the data lives) once per pass: on a GPU one transfer per epoch instead of one per step."""
    if n == 0 and total_steps > 0:  # no pass would ever yield a batch: refuse rather than loop forever
        raise ValueError("this client holds no training samples, so it cannot train")
    taken = 0
    while taken < total_steps:
        perm = torch.randperm(n, generator=generator)
        if device is not None and device != perm.device:
            perm = perm.to(device)
        for start in range(0, n, batch_size):
            if taken == total_steps:
                return
            yield perm[start : start + batch_size]
            taken += 1


def clip_grad_norm(grad: torch.Tensor, max_norm: float) -> None:
    """Scale ``grad`` to norm ``max_norm`` if it is longer. The test stays on the device (multiplying by exactly 1
    otherwise), so a GPU step does not wait for the norm to reach the host."""
    norm = grad.norm()
    grad.mul_(torch.where(norm > max_norm, max_norm / (norm + 1e-6), 1.0))


def precision_context(precision: str, device: torch.device) -> Any:
    """Autocast for ``train.precision`` around a forward pass and its loss: bf16 under ``torch.autocast`` on the
    model's device type, fp32 no context at all (the default, bit for bit what it was without the option). Without
    autocast's cache of cast weights: a context around several clients' forward passes (the batched executor's
    one-by-one path) sets new weights in place between them, and a cached cast would keep the first client's."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, cache_enabled=False)

"""What the shared local loop (``fedhet.algorithms.loop``) trains with: per-(seed, round, client) seeds, the flat
optimisers (``train.optimizer``: SGD, Adam, AdamW), local step counts and mini-batches, gradient clipping. Algorithms
use them directly too."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fedhet.data.device import to_device

if TYPE_CHECKING:
    from fedhet.config import TrainSection
    from fedhet.toolkit.flat import FlatModel


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integer parts, so each (run seed, round, client, phase) has its own independent stream."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1, np.uint64)[0] >> 1)


def seed_global(seed: int, device: torch.device) -> None:
    """Seed torch's global generators for a client's run on ``device`` (dropout and any other global-RNG use inside
    the model): the CPU's and, on a GPU, the GPU's; as ``torch.manual_seed`` does for them, without its cost per
    call. ``torch.manual_seed`` also queues the seeding of every accelerator type not yet initialised and records
    a formatted stack trace for each (about 0.2 ms a call, a quarter of a small model's batched round at 100
    clients); those generators draw nothing in a run on another device."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed_all(seed)
    elif device.type != "cpu":
        torch.manual_seed(seed)


class FlatOptimizer:
    """What the local optimisers share: ``step()`` on ``flat`` (anything with ``params`` and ``grad`` tensors of one
    shape: a model's flat vectors or a slice of them) at ``lr``, and the state a kept optimiser carries into the
    next round (``save`` / ``load`` into a client's state dict; ``train.optimizer_state = "client"``, FML's private
    model). Fresh, the state is empty: every local round starts it anew."""

    def __init__(self, flat: FlatModel | Any, lr: float) -> None:
        self.flat = flat
        self.lr = lr

    def step(self) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError

    def save(self, state: dict[str, torch.Tensor], prefix: str) -> None:
        """Write the optimiser's state into a client's state dict under ``prefix``."""
        keep_state(state, prefix, self.state_dict())

    def load(self, state: dict[str, torch.Tensor], prefix: str) -> None:
        """Continue from the state ``save`` wrote under ``prefix`` (fresh where there is none)."""
        self.load_state_dict(kept_state(state, prefix))

    def _own(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.flat.params.device, copy=True)


class FlatSGD(FlatOptimizer):
    """SGD with momentum, Nesterov and weight decay on a flat parameter vector (torch.optim.SGD's semantics).

    The momentum buffer starts empty every local round, as in the official code of every method we follow, unless a
    kept one is loaded."""

    def __init__(
        self,
        flat: FlatModel | Any,
        lr: float,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
    ) -> None:
        super().__init__(flat, lr)
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

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The momentum buffer, once there is one."""
        return {} if self.buf is None else {"momentum": self.buf}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.buf = self._own(state["momentum"]) if "momentum" in state else None


Coefficient = float | torch.Tensor  # one value, or an (m, 1) column with one value per row (client)


@dataclass(frozen=True)
class AdamSettings:
    """Adam's hyper-parameters besides the learning rate; ``decoupled``: AdamW's weight decay."""

    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled: bool = False

    def coefficients(self, lr: float, step: int) -> tuple[float, float, float]:
        """(step size lr / (1 - beta1^t), sqrt(1 - beta2^t), AdamW's decay factor 1 - lr wd) of step t, in Python
        floats exactly as torch.optim.Adam computes them."""
        beta1, beta2 = self.betas
        return lr / (1 - beta1**step), (1 - beta2**step) ** 0.5, 1 - lr * self.weight_decay

    def update(
        self,
        params: torch.Tensor,
        grad: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        coefficients: tuple[Coefficient, Coefficient, Coefficient],
    ) -> None:
        """One Adam(W) step in place with torch.optim.Adam's single-tensor arithmetic, on a vector or on the rows of
        an (m, P) tensor (the batched executor's clients); ``coefficients`` as ``coefficients`` gives them, floats
        or, where rows differ, (m, 1) columns of them."""
        step_size, bias2_sqrt, decay = coefficients
        beta1, beta2 = self.betas
        if self.weight_decay:
            if self.decoupled:
                params.mul_(decay)
            else:
                grad = grad.add(params, alpha=self.weight_decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (exp_avg_sq.sqrt() / bias2_sqrt).add_(self.eps)
        if isinstance(step_size, float):
            params.addcdiv_(exp_avg, denom, value=-step_size)
        else:  # the scalar form's float32 roundings: (-step_size * exp_avg) / denom
            params.addcdiv_(exp_avg * -step_size, denom)


class FlatAdam(FlatOptimizer):
    """Adam on a flat parameter vector, or AdamW with ``decoupled = True``: torch.optim.Adam's / AdamW's update
    (their single-tensor code path, so a step equals theirs bit for bit on a CPU), without amsgrad.

    Weight decay is L2 added to the gradient for Adam and decoupled (w <- w (1 - lr wd) before the step) for AdamW.
    The moments start at zero and the step count at 0 every local round unless a kept state is loaded."""

    def __init__(
        self,
        flat: FlatModel | Any,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        decoupled: bool = False,
    ) -> None:
        super().__init__(flat, lr)
        self.settings = AdamSettings(betas, eps, weight_decay, decoupled)
        self.exp_avg: torch.Tensor | None = None
        self.exp_avg_sq: torch.Tensor | None = None
        self.count = 0  # steps taken (torch's state["step"])

    def step(self) -> None:
        params = self.flat.params
        if self.exp_avg is None or self.exp_avg_sq is None:
            self.exp_avg, self.exp_avg_sq = torch.zeros_like(params), torch.zeros_like(params)
        self.count += 1
        coefficients = self.settings.coefficients(self.lr, self.count)
        self.settings.update(params, self.flat.grad, self.exp_avg, self.exp_avg_sq, coefficients)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Both moments and the step count, once a step was taken."""
        if self.exp_avg is None or self.exp_avg_sq is None:
            return {}
        return {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq, "step": torch.tensor(self.count)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if "step" not in state:
            self.exp_avg = self.exp_avg_sq = None
            self.count = 0
            return
        self.exp_avg, self.exp_avg_sq = self._own(state["exp_avg"]), self._own(state["exp_avg_sq"])
        self.count = int(state["step"])


def adam_settings(train: TrainSection) -> AdamSettings:
    """``train``'s Adam (optimizer "adam") or AdamW ("adamw") hyper-parameters."""
    betas = (train.beta1, train.beta2)
    return AdamSettings(betas, train.eps, train.weight_decay, decoupled=train.optimizer == "adamw")


def local_optimizer(flat: FlatModel | Any, lr: float, train: TrainSection) -> FlatOptimizer:
    """The optimiser ``train.optimizer`` names (sgd, adam, adamw), with its settings from ``train``, on ``flat``."""
    if train.optimizer == "sgd":
        return FlatSGD(flat, lr, train.momentum, train.weight_decay, train.nesterov)
    hp = adam_settings(train)
    return FlatAdam(flat, lr, hp.betas, hp.eps, hp.weight_decay, hp.decoupled)


def keep_state(state: dict[str, torch.Tensor], prefix: str, optimizer_state: dict[str, torch.Tensor]) -> None:
    """Put an optimiser's state (``state_dict``'s names) into a client's state dict under ``prefix``."""
    state.update({prefix + name: t for name, t in optimizer_state.items()})


def kept_state(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The optimiser state ``keep_state`` put under ``prefix``, by its own names (empty where there is none)."""
    return {k[len(prefix) :]: t for k, t in state.items() if k.startswith(prefix)}


def optimizer_state_prefix(phase: str) -> str:
    """The client-state keys under which the shared loop keeps its optimiser's state, one set per phase."""
    return f"optimizer.{phase}."


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
    (where the data lives) once per pass, without waiting for the device (``fedhet.data.device.to_device``)."""
    if n == 0 and total_steps > 0:  # no pass would ever yield a batch: refuse rather than loop forever
        raise ValueError("this client holds no training samples, so it cannot train")
    taken = 0
    while taken < total_steps:
        perm = to_device(torch.randperm(n, generator=generator), device)
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

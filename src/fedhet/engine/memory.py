"""Whether a run's model can fit in its device's memory, decided before a byte of it is allocated.

The model is built on torch's ``meta`` device (shapes, no storage), its parameters counted, and the bytes a run
holds at the least compared with the memory the device has free: a model that cannot fit (``-s
model.hidden=[100000000]``: 25 GB of weights) is one ``ConfigError`` naming its parameter count and the memory there
is, instead of an allocator traceback minutes into data loading or a machine driven into swap.

The bound is deliberately low, so that no run that could fit is refused: only the copies every run keeps are counted
(the weights, their gradients and the server's global copy), not momentum, control variates, client states or
activations. A model that passes may still be too large; one that fails cannot train.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from fedhet.errors import ConfigError
from fedhet.machine import host_memory
from fedhet.paths import size_text

if TYPE_CHECKING:
    from fedhet.config import Config
    from fedhet.data.federated import FederatedDataset

# copies of the weights every run holds at once: the model's (flat) parameters, their gradients, the server's copy
COPIES = 3


def count_model(build: Callable[[], torch.nn.Module]) -> tuple[int, int] | None:
    """(parameters, bytes of parameters and buffers) of the model ``build()`` makes, built on the meta device so
    nothing is allocated and no random number drawn; None when it cannot be built there (a plug-in model that
    computes on its weights while it is built)."""
    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            model = build()
    except Exception:  # not buildable without storage: the check is skipped, building it for real decides
        return None
    params = list(model.parameters())
    tensors = params + [b for b in model.buffers() if b is not None]
    return sum(p.numel() for p in params), sum(t.numel() * t.element_size() for t in tensors)


def trainable_bytes(build: Callable[[], torch.nn.Module]) -> int | None:
    """Bytes of the parameters of ``build()``'s model that train (frozen ones have no gradient or server copy)."""
    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            model = build()
    except Exception:
        return None
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def available_memory(device: torch.device) -> tuple[int, str] | None:
    """(bytes free, where that figure comes from) on ``device``; None where it cannot be told (MPS, no /proc)."""
    if device.type == "cuda":
        try:
            free, _total = torch.cuda.mem_get_info(device)
        except (RuntimeError, AssertionError):
            return None
        return int(free), "free (torch.cuda.mem_get_info)"
    if device.type != "cpu":
        return None
    return host_memory()


def check_fits(name: str, counted: tuple[int, int] | None, device: torch.device, trainable: int | None = None) -> None:
    """A ``ConfigError`` when ``COPIES`` copies of a model (``counted`` by ``count_model``) exceed what ``device``
    has free; of frozen parameters (``trainable``: the bytes of those that train, default all) only the weights."""
    room = available_memory(device)
    if counted is None or room is None:
        return
    params, size = counted
    free, where = room
    need = size + (COPIES - 1) * (size if trainable is None else trainable)
    if need <= free:
        return
    raise ConfigError(
        f"model {name!r} has {params:,} parameters ({size_text(size)}); training holds at least {COPIES} copies of "
        f"those that train (weights, gradients, the server's copy: {size_text(need)}), but {device} has "
        f"{size_text(free)} {where}: choose a smaller model (model.* settings) or a device with more memory"
    )


def check_model_fits(
    cfg: Config,
    fed: FederatedDataset,
    device: torch.device,
    algo_cls: Any,
    algo_cfg: Any,
    adapt: Callable[[Config, torch.nn.Module], torch.nn.Module] | None = None,
) -> None:
    """``check_fits`` for the model a run of ``cfg`` on ``fed`` trains, with what its algorithm (``algo_cls`` with
    its parameters ``algo_cfg``) adds to it and what ``adapt`` freezes or adds (``training.adapt_model``)."""
    from fedhet.models import build_model

    def plain() -> torch.nn.Module:
        return build_model(cfg.model.name, fed.input_shape, fed.num_classes, **cfg.model.params())

    def full() -> torch.nn.Module:
        model = algo_cls.prepare_model(algo_cfg, plain())
        model = algo_cls.prepare_federated_model(algo_cfg, model, fed.num_clients)
        return model if adapt is None else adapt(cfg, model)

    counted = count_model(full)
    trainable = trainable_bytes(full) if counted is not None else None
    check_fits(cfg.model.name, counted or count_model(plain), device, trainable)

"""Training augmentation on in-memory image batches (no torchvision on CPU here): random crop with padding,
horizontal flip and small rotations, all drawn from the client's generator so runs stay reproducible.

Batches are already normalised, so the border that crop and rotation bring in is filled with ``fill``, the
normalised value of a black pixel (-mean/std per channel): what torchvision's RandomCrop(padding=4) and
RandomRotation give when they run on the raw image before Normalize, as in the papers' pipelines. Without ``fill``
the border is 0, i.e. black only for data that is not normalised."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.nn.functional as F

from fedhet.data.device import to_device

Augment = Callable[[torch.Tensor, torch.Generator], torch.Tensor]


def filled(op: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, fill: torch.Tensor | None) -> torch.Tensor:
    """``op`` (which brings in zeros at the border) on ``x`` with the border at ``fill`` instead."""
    if fill is None:
        return op(x)
    f = to_device(fill, x.device).to(x.dtype).view(1, -1, 1, 1)
    return op(x - f) + f


def random_crop(
    x: torch.Tensor, g: torch.Generator, padding: int = 4, fill: torch.Tensor | None = None
) -> torch.Tensor:
    b, _, h, w = x.shape
    padded = filled(lambda t: F.pad(t, (padding, padding, padding, padding)), x, fill)
    # the offsets drawn on the client's CPU generator, then indexed where the batch lives
    oy = to_device(torch.randint(0, 2 * padding + 1, (b,), generator=g), x.device)
    ox = to_device(torch.randint(0, 2 * padding + 1, (b,), generator=g), x.device)
    rows = (oy[:, None] + torch.arange(h, device=x.device))[:, :, None]  # (B, H, 1)
    cols = (ox[:, None] + torch.arange(w, device=x.device))[:, None, :]  # (B, 1, W)
    batch = torch.arange(b, device=x.device)[:, None, None]
    return padded.permute(0, 2, 3, 1)[batch, rows, cols].permute(0, 3, 1, 2).contiguous()


def random_flip(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    flip = to_device(torch.rand(x.shape[0], generator=g) < 0.5, x.device)
    return torch.where(flip[:, None, None, None], x.flip(3), x)


def random_rotate(
    x: torch.Tensor, g: torch.Generator, degrees: float = 10.0, fill: torch.Tensor | None = None
) -> torch.Tensor:
    angle = (to_device(torch.rand(x.shape[0], generator=g), x.device) * 2 - 1) * math.radians(degrees)
    cos, sin = angle.cos(), angle.sin()
    zero = torch.zeros_like(cos)
    theta = torch.stack([torch.stack([cos, -sin, zero], 1), torch.stack([sin, cos, zero], 1)], 1)
    grid = F.affine_grid(theta.to(x.dtype), list(x.shape), align_corners=False)
    return filled(lambda t: F.grid_sample(t, grid, align_corners=False, padding_mode="zeros"), x, fill)


def build_augment(name: str, fill: Sequence[float] | None = None) -> Augment | None:
    """The named augmentation; ``fill`` is the per-channel value of a black pixel in the model's input space."""
    if name == "none":
        return None
    fill_t = None if fill is None else torch.tensor(fill, dtype=torch.float32)
    crop, rotate = partial(random_crop, fill=fill_t), partial(random_rotate, fill=fill_t)
    steps = {
        "crop": [crop],
        "crop_flip": [crop, random_flip],
        "crop_flip_rotate": [rotate, crop, random_flip],  # FedRCL's order (notes/fedrcl.md 4)
    }[name]

    def augment(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        if x.dim() != 4:
            return x
        for step in steps:
            x = step(x, g)
        return x

    return augment

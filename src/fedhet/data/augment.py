"""Training augmentation on in-memory image batches (no torchvision on CPU here): random crop with zero padding,
horizontal flip and small rotations, all drawn from the client's generator so runs stay reproducible."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

Augment = Callable[[torch.Tensor, torch.Generator], torch.Tensor]


def random_crop(x: torch.Tensor, g: torch.Generator, padding: int = 4) -> torch.Tensor:
    b, _, h, w = x.shape
    padded = F.pad(x, (padding, padding, padding, padding))
    oy = torch.randint(0, 2 * padding + 1, (b,), generator=g)
    ox = torch.randint(0, 2 * padding + 1, (b,), generator=g)
    rows = (oy[:, None] + torch.arange(h))[:, :, None]  # (B, H, 1)
    cols = (ox[:, None] + torch.arange(w))[:, None, :]  # (B, 1, W)
    batch = torch.arange(b)[:, None, None]
    return padded.permute(0, 2, 3, 1)[batch, rows, cols].permute(0, 3, 1, 2).contiguous()


def random_flip(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    flip = torch.rand(x.shape[0], generator=g) < 0.5
    return torch.where(flip[:, None, None, None], x.flip(3), x)


def random_rotate(x: torch.Tensor, g: torch.Generator, degrees: float = 10.0) -> torch.Tensor:
    angle = (torch.rand(x.shape[0], generator=g) * 2 - 1) * math.radians(degrees)
    cos, sin = angle.cos(), angle.sin()
    zero = torch.zeros_like(cos)
    theta = torch.stack([torch.stack([cos, -sin, zero], 1), torch.stack([sin, cos, zero], 1)], 1)
    grid = F.affine_grid(theta.to(x.dtype), list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, align_corners=False, padding_mode="zeros")


def build_augment(name: str) -> Augment | None:
    if name == "none":
        return None
    steps = {
        "crop": [random_crop],
        "crop_flip": [random_crop, random_flip],
        "crop_flip_rotate": [random_rotate, random_crop, random_flip],  # FedRCL's order (notes/fedrcl.md 4)
    }[name]

    def augment(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        if x.dim() != 4:
            return x
        for step in steps:
            x = step(x, g)
        return x

    return augment

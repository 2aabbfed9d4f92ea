"""Host-to-device copies that do not make the host wait.

Random draws of the local loop (batch permutations, augmentation parameters, Mixup partners) come from each client's
CPU generator, so every device sees the same draws. A plain ``tensor.to("cuda")`` from ordinary (pageable) host
memory returns only after the copy, one host synchronisation per call, per step where a draw is made per step;
from pinned memory with ``non_blocking=True`` the copy is queued on the stream and the host goes on (torch's pinned
memory pool keeps the block until the copy has run)."""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device | str | None) -> torch.Tensor:
    """``t`` on ``device`` (``t`` itself where it is there already or ``device`` is None); a CPU tensor goes to a
    CUDA device through pinned memory, without a host synchronisation."""
    if device is None:
        return t
    device = torch.device(device)
    if t.device == device or (device.type == t.device.type and device.index is None):
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)

"""A two-parameter quadratic for hand-computed algorithm tests.

Loss 1/2 sum_j A_j (w_j - B_j)^2 on every batch: gradient A (w - B), Hessian diag(A), so each algorithm's update
can be written out by hand."""

from __future__ import annotations

import torch
from torch import nn

A = torch.tensor([1.0, 3.0])
B = torch.tensor([0.5, -1.0])


class TwoParams(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(2))


def quadratic_loss(model: TwoParams) -> torch.Tensor:
    return 0.5 * (A * (model.w - B).pow(2)).sum()

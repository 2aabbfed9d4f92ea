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


def client_context(msg, model, train, *, data=None, state=None, cid: int = 0, seed: int | None = None):
    """A round-1 ClientContext around ``model`` for hand-computed client-side checks (dummy data by default)."""
    from fedhet.algorithms.base import ClientContext, ClientData
    from fedhet.toolkit.flat import FlatModel

    data = data or ClientData(torch.zeros(4, 1), torch.zeros(4, dtype=torch.long), 3)
    return ClientContext(
        cid=cid,
        round=1,
        phase="train",
        message=msg,
        data=data,
        state={} if state is None else state,
        model=model,
        flat=FlatModel(model),
        train=train,
        generator=torch.Generator().manual_seed(cid if seed is None else seed),
    )

"""Soft confusion matrices and their distance to an equal-error template (FedACD, notes/fedacd.md 2.3 and 2.8).

``P[i, j]`` is the mean softmax probability of class j over a model's samples of true class i: a confusion matrix
of probabilities, not of argmax counts, so ``1 - P[i, i]`` is a soft per-class error. FedACD's clients build it to
adjust their loss and to score their model for aggregation; the engine builds it for any algorithm's local models
(Table 9's diagnostic). Everything here is float64: the template's off-diagonal entries are about 1e-7.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from fedhet.toolkit.evaluate import eval_batch_size

PAPER_TAU = 1.0 - 1e-5  # FedACD's template diagonal (Eq. 10); Table 9 reports every method's KL against it


@torch.no_grad()
def soft_confusion(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, num_classes: int, batch_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sums, counts) of a clean pass in eval mode: ``sums[i, j]`` adds p_j(x) over the samples of class i and
    ``counts[i]`` counts them. The model's train/eval mode is restored; no random number is drawn."""
    batch_size = eval_batch_size(model, batch_size)
    was_training = model.training
    model.eval()
    sums = torch.zeros(num_classes, num_classes, dtype=torch.float64, device=x.device)  # read once, at the end
    for start in range(0, len(y), batch_size):
        probs = torch.softmax(model(x[start : start + batch_size]).double(), dim=1)
        sums.index_add_(0, y[start : start + batch_size].to(x.device), probs)
    model.train(was_training)
    counts = torch.bincount(y.cpu(), minlength=num_classes).to(torch.float64)
    return sums.cpu(), counts


def probability_matrix(sums: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Row means; the rows of classes without samples are NaN (undefined, never silently zero)."""
    rows = sums / counts.clamp_min(1e-300).unsqueeze(1)
    return torch.where((counts > 0).unsqueeze(1), rows, torch.full_like(rows, math.nan))


def template(num_classes: int, tau: float) -> torch.Tensor:
    """FedACD's template Q: ``tau`` on the diagonal, ``(1 - tau) / (C - 1)`` elsewhere (every row sums to one)."""
    q = torch.full((num_classes, num_classes), (1.0 - tau) / (num_classes - 1), dtype=torch.float64)
    q.fill_diagonal_(tau)
    return q


def template_kl(p: torch.Tensor, tau: float, reduction: str = "mean_rows") -> float:
    """KL(P || Q) over the defined (non-NaN) rows of ``p``: their mean (``mean_rows``) or their sum (``sum``, Eq. 10
    read literally). Entries of P that are 0 contribute 0 (the limit of p log p). NaN when no row is defined."""
    present = ~torch.isnan(p).any(dim=1)
    rows = p[present].double()
    if not len(rows):
        return math.nan
    q = template(p.shape[0], tau)[present]
    terms = torch.where(rows > 0, rows * (rows.clamp_min(1e-300).log() - q.log()), torch.zeros_like(rows))
    per_row = terms.sum(dim=1)
    return float(per_row.mean() if reduction == "mean_rows" else per_row.sum())

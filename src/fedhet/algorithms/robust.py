"""Robust aggregation (docs/privacy-robustness.md): ``server.aggregation`` choices that resist wrong or hostile
clients, and norm bounding (``server.norm_bound``), for every algorithm whose server takes a weighted average of the
client models (the contract GNE uses, ``Algorithm.accepts_gne``).

All rules act on the client deltas u_i = theta_i - theta (reply minus the global model the round started from) and
return a delta; the target handed to the server optimiser is theta + that delta, so they compose with any server
optimiser. Buffers (BatchNorm statistics) keep the algorithm's own weighted average: they are no update a rule could
judge, and a Byzantine client's buffers are as harmful as its parameters, so a run that must resist attacks on them
should use a model without buffers.

* ``median`` (Yin et al. 2018): the coordinate-wise median of the deltas, unweighted (for an even count the mean of
  the two middle values, numpy's convention, so a symmetric case has the symmetric answer).
* ``trimmed_mean`` (Yin et al. 2018): per coordinate, drop the floor(beta n) largest and smallest values and average
  the rest, unweighted; beta = ``server.trim_fraction`` < 1/2.
* ``krum`` (Blanchard et al. 2017): each delta's score is the sum of its squared distances to its n - f - 2 nearest
  other deltas (f = ``server.byzantine``); the delta with the smallest score is the update. ``multikrum``: the m
  deltas with the smallest scores (``server.multikrum_m``, default n - f), averaged with the algorithm's weights
  renormalised over them (with m = n this is the algorithm's own average). The config refuses f with n <= 2 f + 2
  for the configured clients per round; a round in which fewer clients replied uses max(n - f - 2, 1) neighbours.
* ``geomed`` (RFA, Pillutla et al. 2022, Algorithm 2): the weighted geometric median by the smoothed Weiszfeld
  iteration v <- sum_i beta_i u_i / sum_i beta_i, beta_i = alpha_i / max(nu, ||v - u_i||), from the weighted mean,
  with the algorithm's weights as alpha, nu = ``server.geomed_eps``, at most ``server.geomed_iters`` iterations,
  stopping when the objective sum_i alpha_i ||v - u_i|| improves by less than 1e-6 of itself (ours).
* ``server.norm_bound`` (Sun et al. 2019, "Can you really backdoor federated learning?"): every delta is scaled to
  norm at most M before whichever rule (also ``weights`` and ``gne``) combines them.

Distances and medians are computed in float64 on the stacked deltas; nothing here draws a random number.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from fedhet.algorithms.privacy import clip_rows

RULES = ("median", "trimmed_mean", "krum", "multikrum", "geomed")
GEOMED_FTOL = 1e-6  # ours: relative improvement of the weighted distance sum below which Weiszfeld stops


def coordinate_median(deltas: torch.Tensor) -> torch.Tensor:
    """Per coordinate, the middle value; for an even count the mean of the two middles (numpy's convention, where
    torch.median takes the lower one). Sorted rather than torch.quantile, which refuses inputs over 16M values."""
    ordered = deltas.sort(dim=0).values.double()
    n = len(ordered)
    return (ordered[(n - 1) // 2] + ordered[n // 2]) / 2


def trimmed_mean(deltas: torch.Tensor, fraction: float) -> torch.Tensor:
    n = len(deltas)
    k = math.floor(fraction * n)
    if 2 * k >= n:
        k = (n - 1) // 2
    ordered = deltas.sort(dim=0).values.double()
    return ordered[k : n - k].mean(0)


def krum_scores(deltas: torch.Tensor, byzantine: int) -> torch.Tensor:
    """Blanchard et al.'s score of each delta: the sum of squared distances to its n - f - 2 nearest others."""
    d = deltas.double()
    dist = torch.cdist(d, d).pow(2)
    n = len(d)
    neighbours = max(n - byzantine - 2, 1)
    dist.fill_diagonal_(math.inf)
    if n == 1:
        return torch.zeros(1, dtype=torch.float64, device=deltas.device)
    return dist.sort(dim=1).values[:, :neighbours].sum(1)


def krum_select(deltas: torch.Tensor, byzantine: int, m: int) -> list[int]:
    """Indices of the m deltas with the smallest Krum scores (ties to the lower index)."""
    scores = krum_scores(deltas, byzantine).tolist()  # one device sync
    order = sorted(range(len(scores)), key=lambda i: (scores[i], i))
    return sorted(order[: max(1, min(m, len(order)))])


def geometric_median(deltas: torch.Tensor, weights: torch.Tensor, eps: float, iters: int) -> tuple[torch.Tensor, int]:
    """RFA's smoothed Weiszfeld estimate of argmin_v sum_i alpha_i ||v - u_i||, and the iterations it took."""
    d = deltas.double()
    alpha = weights.double() / weights.sum()
    v = alpha @ d
    last = float((alpha * (d - v).norm(dim=1)).sum())
    for it in range(1, iters + 1):
        beta = alpha / (d - v).norm(dim=1).clamp_min(eps)
        v = (beta / beta.sum()) @ d
        value = float((alpha * (d - v).norm(dim=1)).sum())
        if last - value <= GEOMED_FTOL * value:
            return v, it
        last = value
    return v, iters


class RobustAggregator:
    """The server half of ``server.aggregation`` in ``RULES`` and of ``server.norm_bound``; no state of its own
    (the last round's diagnostics only), so a resumed run aggregates exactly as an uninterrupted one."""

    def __init__(
        self,
        rule: str,
        norm_bound: float | None = None,
        trim_fraction: float = 0.1,
        byzantine: int = 1,
        multikrum_m: int | None = None,
        geomed_eps: float = 1e-6,
        geomed_iters: int = 100,
    ) -> None:
        self.rule, self.norm_bound = rule, norm_bound
        self.trim_fraction, self.byzantine, self.multikrum_m = trim_fraction, byzantine, multikrum_m
        self.geomed_eps, self.geomed_iters = geomed_eps, geomed_iters
        self.last: dict[str, float] = {}

    def target(
        self,
        x: torch.Tensor,
        params: list[torch.Tensor],
        weights: list[float],
        average: Callable[[list[torch.Tensor], list[float]], torch.Tensor],
    ) -> torch.Tensor:
        """theta + the rule's delta; ``average(params, weights)`` is the algorithm's own aggregation (weights or
        GNE), used when only the norm bound is set."""
        deltas = torch.stack([p - x for p in params])
        self.last = {}
        if self.norm_bound is not None:
            deltas, norms = clip_rows(deltas, self.norm_bound)  # as central DP clips (privacy.py)
            self.last["robust/bounded_fraction"] = float((norms > self.norm_bound).double().mean())
        if self.rule not in RULES:
            return average([x + u for u in deltas], weights)
        return x + self.combine(deltas, torch.tensor(weights, dtype=torch.float64, device=x.device)).to(x.dtype)

    def combine(self, deltas: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.rule == "median":
            return coordinate_median(deltas)
        if self.rule == "trimmed_mean":
            return trimmed_mean(deltas, self.trim_fraction)
        if self.rule == "geomed":
            v, iters = geometric_median(deltas, weights, self.geomed_eps, self.geomed_iters)
            self.last["robust/geomed_iterations"] = float(iters)
            return v
        m = 1 if self.rule == "krum" else (self.multikrum_m or len(deltas) - self.byzantine)
        chosen = krum_select(deltas, self.byzantine, m)
        self.last["robust/selected"] = float(len(chosen))
        w = weights[chosen] / weights[chosen].sum()
        return w @ deltas[chosen].double()

    def metrics(self) -> dict[str, float]:
        return dict(self.last)

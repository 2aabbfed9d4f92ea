"""FedBuff's server (Nguyen et al., AISTATS 2022, Algorithm 1), apart from the loop that drives it
(``engine/asynchronous.py``): the staleness weight, the buffered step, and which runs it can take.

A client trains from the model version it downloaded, version tau, and its update is Delta = (its model) - (that
version). It arrives when the server is at version t; the server buffers the updates and, once it holds K of them,
moves to the target x + sum_i w_i s(t_i - tau_i) Delta_i, where w are the algorithm's aggregation weights over the
buffer (1/K with FedAvg's ``weighting = "uniform"``: the paper's (1/K) sum_i s_i Delta_i), through the server
optimiser, so ``sgd``'s ``server.lr`` is the paper's eta_g.

The model's floating buffers (BatchNorm statistics) are not gradients, and the paper's step (over trainable weights)
says nothing of them. They move, without the server optimiser, toward the statistics each buffered client reported,
by the same coefficients c_i = w_i s(t_i - tau_i): b + sum_i c_i (b_i - b) = (1 - sum c) b + sum_i c_i b_i, a convex
combination (sum c <= 1) of the current statistics and the reported ones, so a running variance never goes negative.
With ``staleness = "constant"`` this is the synchronous rule (the weighted average of the reported statistics).
A stale *difference* b_i - b(tau_i), measured from the version the client downloaded, would not be: it can take a
variance that has shrunk since below zero."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fedhet.algorithms import ALGORITHMS, Algorithm
from fedhet.errors import ConfigError

if TYPE_CHECKING:
    from fedhet.config import Config


def staleness_weight(staleness: int, kind: str, exponent: float) -> float:
    """s(t - tau): 1 for "constant", (1 + t - tau)^-a for "polynomial" (the paper: a = 0.5)."""
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0 (got {staleness})")
    return 1.0 if kind == "constant" else (1.0 + staleness) ** -exponent


def buffered_target(x: torch.Tensor, updates: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """x + sum_i weights_i updates_i, summed in the buffer's arrival order (one fixed order: bit-identical runs)."""
    target = x.clone()
    for update, weight in zip(updates, weights, strict=True):
        target.add_(update, alpha=weight)
    return target


def buffered_statistics(current: torch.Tensor, reported: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """(1 - sum_i c_i) current + sum_i c_i reported_i, with c the weights clipped at 0 and scaled down to sum to at
    most 1: a convex combination, whatever weights an algorithm gives, so non-negative statistics stay so."""
    coeffs = [max(0.0, w) for w in weights]
    total = sum(coeffs)
    if total > 1.0:
        coeffs, total = [c / total for c in coeffs], 1.0
    out = current * max(0.0, 1.0 - total)
    for stats, coeff in zip(reported, coeffs, strict=True):
        out.add_(stats, alpha=coeff)
    return out


def owner(cls: type[Algorithm], attr: str) -> type:
    return next(c for c in cls.__mro__ if attr in c.__dict__)


def fedbuff_refusal(cls: type[Algorithm]) -> str | None:
    """Why FedBuff cannot run ``cls``, in one line, or None. FedBuff keeps the method's client side and replaces its
    server: the method must exchange the global model once per round and have a server that only averages the
    replied models (the base class's ``configure``, ``aggregate`` and server state)."""
    if cls.pools_clients:
        return "it trains one client holding every client's data"
    if cls.shares_data:
        return "its server trains on data the clients share, which FedBuff's server step does not do"
    if len(cls.phases) != 1:
        return f"its round has {len(cls.phases)} exchanges ({', '.join(cls.phases)}) and FedBuff's clients make one"
    for attr, what in (
        ("configure", "its server sends the clients more than the global model"),
        ("global_message", "its server sends the clients more than the global model"),
        ("aggregate", "its server does more than average the replied models"),
        ("state_dict", "its server keeps state besides the global model"),
    ):
        if owner(cls, attr) is not Algorithm:
            return what
    return None


def check_fedbuff(cfg: Config) -> None:
    """Refuse, in one line, a FedBuff run whose settings have no meaning without rounds or are unsound."""
    server = cfg.server
    if server.mode != "fedbuff":
        return
    cls = ALGORITHMS.get(cfg.algorithm.name).obj
    why = fedbuff_refusal(cls)
    if why:
        able = ", ".join(e.name for e in ALGORITHMS.entries() if fedbuff_refusal(e.obj) is None)
        raise ConfigError(
            f"server.mode='fedbuff' keeps {cls.name}'s clients and replaces its server, but {why}; "
            f"algorithms that run under it: {able}"
        )
    _, params = ALGORITHMS.parse(cfg.algorithm.name, cfg.algorithm.params())
    if getattr(params, "aggregation", None) == "gne":
        raise ConfigError(
            f"{cls.name} averages with GNE's Nash-bargaining weights (algorithm.aggregation='gne'), which "
            "server.mode='fedbuff' replaces by its staleness-weighted mean; set algorithm.aggregation='samples'"
        )
    n, concurrency = cfg.partition.num_clients, fedbuff_concurrency(cfg)
    if concurrency > n:
        raise ConfigError(
            f"server.concurrency={concurrency} exceeds partition.num_clients={n}: a client trains one update at a time"
        )
    if server.aggregation != "weights" or server.norm_bound is not None:
        what = "server.norm_bound" if server.aggregation == "weights" else f"server.aggregation={server.aggregation!r}"
        raise ConfigError(
            f"{what} replaces the average of a synchronous round; server.mode='fedbuff' steps with the "
            "staleness-weighted mean of its buffer (use server.aggregation='weights', no norm_bound)"
        )
    if cfg.privacy.mode == "central":
        raise ConfigError(
            "privacy.mode='central' is accounted for a fixed number of clients sampled per round, and "
            "server.mode='fedbuff' has no rounds; use privacy.mode='local' or 'none'"
        )
    system = cfg.system
    if not system.active:
        raise ConfigError(
            "server.mode='fedbuff' runs on the simulated clock, which needs the clients' speeds: set system.profiles "
            "to one of constant, uniform, lognormal, tiers, trace"
        )
    per_round = [
        ("system.deadline", system.deadline is not None, "unset it"),
        ("system.over_selection", system.over_selection > 0, "set it to 0; server.concurrency sets how many train"),
        (f"system.availability={system.availability!r}", system.availability != "always", "use 'always'"),
    ]
    for what, given, fix in per_round:
        if given:
            raise ConfigError(
                f"{what} acts on a synchronous round, and server.mode='fedbuff' has none (it refills each slot as its "
                f"update arrives); {fix}"
            )
    if cfg.train.sampling != "uniform":
        raise ConfigError(
            f"train.sampling={cfg.train.sampling!r} chooses a round's clients; server.mode='fedbuff' refills each "
            "slot with an idle client drawn uniformly (use train.sampling='uniform')"
        )


def fedbuff_concurrency(cfg: Config) -> int:
    """The clients training at once: ``server.concurrency``, else the clients a synchronous round would sample."""
    return cfg.server.concurrency if cfg.server.concurrency is not None else cfg.clients_per_round()

"""Differential privacy (docs/privacy-robustness.md): client-level DP-FedAvg at the server and sample-level DP-SGD
in the local loop.

Central (``privacy.mode = "central"``, McMahan et al. 2018, "Learning Differentially Private Recurrent Language
Models"): each participating client's update u_i = y_i - x is clipped to norm C, the clipped updates are summed,
Gaussian noise N(0, (z C)^2 I) is added, and the sum is divided by the fixed denominator m (the configured clients
per round, whatever number replied), so one client moves the released mean by at most C/m. The server optimiser then
steps towards x + that mean as usual. With ``adaptive_clip`` the clip follows Andrew et al. 2021 ("Differentially
Private Learning with Adaptive Clipping", NeurIPS): each round the noised fraction of unclipped updates
b = (sum_i 1[|u_i| <= C] + N(0, sigma_b^2)) / m moves C <- C exp(-eta_C (b - gamma)), and the update noise shrinks
to z_u = (z^-2 - (2 sigma_b)^-2)^-1/2 so that the two releases together still cost what noise multiplier z costs.

Local (``privacy.mode = "local"``, Abadi et al. 2016): every local step clips each sample's gradient to C, sums
them, adds N(0, (z C)^2 I) and divides by the batch size (``dp_sgd_gradient``, called by the shared loop).

Accounting: Google's dp-accounting RDP accountant. The engine's sampler draws a fixed number m of the N clients
uniformly without replacement each round, so rounds are ``SampledWithoutReplacementDpEvent`` (Wang, Balle and
Kasiviswanathan 2019), whose neighbouring relation is replace-one: replacing one client's data moves the clipped sum
by up to 2C, so the Gaussian's noise over sensitivity is z / 2. Local DP-SGD's steps are accounted the same way with
the client's batch size b of its n samples (the loop's shuffled passes are accounted as independent draws, as Opacus
and TF Privacy do). RDP composes additively, so one step's RDP is computed once per (N, m, z) and scaled by the
count: epsilon is recomputed from counts alone, which is what keeps a resumed run's numbers exact.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fedhet.errors import ConfigError
from fedhet.toolkit.local import derive_seed

if TYPE_CHECKING:
    from fedhet.config import PrivacySection

NOISE_STREAM = 0xD9  # the seed part of the server's noise: release k draws from (seed, NOISE_STREAM, k)
Z_MAX = 1e4  # the largest noise multiplier target_epsilon searches


def dp_accounting() -> Any:
    try:
        import dp_accounting as lib
    except ImportError:
        raise ConfigError(
            "privacy.mode needs Google's dp-accounting for its epsilon: pip install 'fedhet[privacy]'"
        ) from None
    return lib


@lru_cache(maxsize=4096)
def step_rdp(noise_multiplier: float, population: int, sample: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(orders, RDP) of one release: ``sample`` of ``population`` drawn without replacement, noise z C on a sum of
    C-clipped contributions (sensitivity 2C under replace-one)."""
    lib = dp_accounting()
    acc = lib.rdp.RdpAccountant(neighboring_relation=lib.NeighboringRelation.REPLACE_ONE)
    event = lib.GaussianDpEvent(noise_multiplier / 2)
    acc.compose(lib.SampledWithoutReplacementDpEvent(population, min(sample, population), event))
    return tuple(acc.orders), tuple(acc.rdp)


def epsilon(noise_multiplier: float, population: int, sample: int, count: int, delta: float) -> float:
    """Epsilon at ``delta`` after ``count`` releases (rounds, or local steps) of ``step_rdp``'s kind."""
    if count <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    orders, rdp = step_rdp(float(noise_multiplier), int(population), int(sample))
    eps, _ = dp_accounting().rdp.compute_epsilon(orders, count * np.asarray(rdp), delta)
    return float(eps)


def noise_for_epsilon(target: float, population: int, sample: int, count: int, delta: float) -> float:
    """The smallest noise multiplier (to 1 %, rounded up) whose epsilon after ``count`` releases is at most
    ``target``; a ``ConfigError`` when even ``Z_MAX`` cannot reach it (the accountant's epsilon has a floor even
    with unbounded noise, set by delta and the sampling rate far more than by the count)."""
    lo, hi = 0.0, 1.0
    while epsilon(hi, population, sample, count, delta) > target:
        if hi >= Z_MAX:
            raise ConfigError(unreachable(target, population, sample, count, delta))
        lo, hi = hi, min(hi * 4, Z_MAX)
    while hi - lo > 1e-2 * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if epsilon(mid, population, sample, count, delta) > target else (lo, mid)
    return hi


def unreachable(target: float, population: int, sample: int, count: int, delta: float) -> str:
    """Why ``target`` cannot be reached, with only the changes that lower epsilon here: fewer rounds only where
    one round would reach it, fewer clients per round only where more than one is sampled."""
    most_noise = epsilon(Z_MAX, population, sample, count, delta)
    ways = ["raise privacy.target_epsilon or privacy.delta"]
    if count > 1 and epsilon(Z_MAX, population, sample, 1, delta) <= target:
        ways.append("run fewer rounds")
    ways.append("sample fewer clients per round or from more clients" if sample > 1 else "sample from more clients")
    rounds = f"{count} round{'s' if count != 1 else ''}"
    return (
        f"privacy.target_epsilon={target:g} cannot be reached: {rounds} of {sample} of {population} clients at delta "
        f"{delta:g} give epsilon {most_noise:.3g} even with noise multiplier {Z_MAX:g} ({'; '.join(ways)})"
    )


def clip_rows(updates: torch.Tensor, clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row scaled to norm at most ``clip``, and the rows' norms before clipping."""
    norms = updates.norm(dim=1)
    scale = (clip / norms.clamp_min(1e-12)).clamp(max=1.0)
    return updates * scale[:, None], norms


class CentralDP:
    """DP-FedAvg's server half: clipped, noised mean of the client updates, and its accountant's counts."""

    def __init__(self, cfg: PrivacySection, num_clients: int, per_round: int, rounds: int, seed: int) -> None:
        self.cfg, self.population, self.per_round, self.seed = cfg, num_clients, per_round, seed
        dp_accounting()  # the missing extra is refused before round 1
        z = cfg.noise_multiplier
        if z is None:
            z = noise_for_epsilon(cfg.target_epsilon, num_clients, per_round, rounds, cfg.delta)
        self.noise_multiplier = float(z)
        self.clip = float(cfg.clip)
        self.count_std = cfg.clipped_count_stddev or per_round / 20
        self.releases = 0  # privatised aggregations so far: epsilon is a function of this count
        self.mean_steps = 1  # local steps of a mean-sized client (set by the engine): a public scale for SCAFFOLD
        self.last: dict[str, float] = {}
        _ = self.update_noise  # a clipped-count noise too small for z is refused before round 1

    @property
    def update_noise(self) -> float:
        """The noise multiplier on the updates: z, or with adaptive clipping Andrew et al.'s z_u, which leaves the
        clipped-count release its share of the budget."""
        z = self.noise_multiplier
        if not self.cfg.adaptive_clip or z == 0:
            return z
        rest = z**-2 - (2 * self.count_std) ** -2
        if rest <= 0:
            raise ConfigError(
                f"privacy.adaptive_clip: the clipped-count noise (stddev {self.count_std:g}) must exceed z/2 = "
                f"{z / 2:g}; raise privacy.clipped_count_stddev"
            )
        return rest**-0.5

    def mean(self, updates: list[torch.Tensor], like: torch.Tensor | None = None) -> torch.Tensor:
        """sum_i clip(u_i, C) + N(0, (z_u C)^2), over m. The k-th release's noise comes from (seed, k), on the CPU,
        so it is the same wherever it is drawn and a resumed run (``releases`` is checkpointed) draws the same.

        With no updates (every sampled client failed) the release is the noise alone, shaped ``like``: the mechanism
        must release something every round, since an unchanged model would tell that every sampled client failed."""
        stacked = torch.stack(updates) if updates else like.new_zeros(0, like.numel())
        clipped, norms = clip_rows(stacked, self.clip)
        gen = torch.Generator().manual_seed(derive_seed(self.seed, NOISE_STREAM, self.releases + 1))
        noise = torch.randn(stacked.shape[1], generator=gen, dtype=torch.float64)
        total = clipped.sum(0) + (noise * (self.update_noise * self.clip)).to(stacked)
        unclipped = float((norms <= self.clip).sum())
        self.last = {"privacy/clip": self.clip}
        if updates:
            self.last["privacy/unclipped_fraction"] = unclipped / len(updates)
        if self.cfg.adaptive_clip:
            count = unclipped + float(torch.randn(1, generator=gen, dtype=torch.float64)) * self.count_std
            self.clip *= math.exp(-self.cfg.clip_lr * (count / self.per_round - self.cfg.target_quantile))
        self.releases += 1
        return total / self.per_round

    def metrics(self) -> dict[str, float]:
        eps = epsilon(self.noise_multiplier, self.population, self.per_round, self.releases, self.cfg.delta)
        return {"privacy/epsilon": eps, "privacy/noise_multiplier": self.noise_multiplier, **self.last}

    def accounting(self) -> dict[str, Any]:
        """summary.json's ``privacy``: the noise multiplier the run used (what target_epsilon resolved to, which
        config.json leaves null), what the accountant counts with (N clients, m a round, delta), and epsilon now."""
        return {
            "mode": "central",
            "noise_multiplier": self.noise_multiplier,
            "target_epsilon": self.cfg.target_epsilon,
            "delta": self.cfg.delta,
            "clients": self.population,
            "clients_per_round": self.per_round,
            "epsilon": self.metrics()["privacy/epsilon"],
        }

    def state_dict(self) -> dict[str, Any]:
        return {"releases": self.releases, "clip": self.clip, "noise_multiplier": self.noise_multiplier}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # z from the checkpoint: a resumed run with more rounds keeps its noise (and reports the larger epsilon)
        self.releases, self.clip, self.noise_multiplier = state["releases"], state["clip"], state["noise_multiplier"]


class LocalDP:
    """DP-SGD's server-side ledger: each client's local steps so far, from which its epsilon is computed."""

    def __init__(self, cfg: PrivacySection, batch_size: int) -> None:
        dp_accounting()
        self.cfg, self.batch_size = cfg, batch_size
        self.steps: dict[int, tuple[int, int]] = {}  # client -> (its samples n, its DP-SGD steps so far)

    def observe(self, replies: dict[int, Any]) -> None:
        for cid, reply in replies.items():
            _, steps = self.steps.get(cid, (0, 0))
            self.steps[cid] = (reply.num_examples, steps + int(reply.metrics.get("steps", 0)))

    def metrics(self) -> dict[str, float]:
        z, b, delta = self.cfg.noise_multiplier, self.batch_size, self.cfg.delta
        eps = [epsilon(z, n, b, k, delta) for n, k in self.steps.values()]
        if not eps:
            return {}
        return {"privacy/epsilon_max": max(eps), "privacy/epsilon_mean": sum(eps) / len(eps)}

    def accounting(self) -> dict[str, Any]:
        """summary.json's ``privacy``: the noise multiplier, delta and batch size each client's epsilon is counted
        with, and the largest and mean epsilon now."""
        counted = {
            "noise_multiplier": self.cfg.noise_multiplier,
            "delta": self.cfg.delta,
            "batch_size": self.batch_size,
        }
        eps = self.metrics()
        return {"mode": "local", **counted, **{k.removeprefix("privacy/"): v for k, v in eps.items()}}

    def state_dict(self) -> dict[str, Any]:
        return {"steps": {int(c): list(v) for c, v in self.steps.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = {int(c): (int(v[0]), int(v[1])) for c, v in state["steps"].items()}


def dp_sgd_gradient(
    loss_of: Any, params: torch.Tensor, x: torch.Tensor, y: torch.Tensor, cfg: Any, batch_size: int, generator: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """(privatised gradient, mean loss): per-sample gradients of ``loss_of(params, x_i[None], y_i[None])`` by
    ``torch.func.vmap(grad)``, each clipped to ``cfg.clip``, summed, noised with N(0, (z C)^2) and divided by the
    configured batch size (a fixed denominator, so a short last batch is not amplified)."""
    from torch.func import grad_and_value, vmap

    def one(p: torch.Tensor, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return loss_of(p, xi.unsqueeze(0), yi.unsqueeze(0))

    grads, losses = vmap(grad_and_value(one), in_dims=(None, 0, 0), randomness="different")(params, x, y)
    clipped, _ = clip_rows(grads, cfg.clip)
    noise = torch.randn(params.shape, generator=generator, dtype=params.dtype, device=generator.device)
    total = clipped.sum(0) + noise.to(params.device) * (cfg.noise_multiplier * cfg.clip)
    return total / batch_size, losses.mean()

"""Attacks for evaluation (``[attack]`` in the config; docs/privacy-robustness.md).

A seeded share of the clients is malicious for the whole run: ``round(fraction * N)`` (at least one) drawn without
replacement from ``(run seed, ATTACK_STREAM)``, so the simulation, its worker processes and every Flower node name the
same clients without talking to each other. The run folder's ``attack.json`` and ``summary.json`` list them.

Everything happens on the client side, in ``ClientRunner`` (engine/client.py), so it runs unchanged on a Flower node:

* data attacks change a malicious client's training batches in the shared loop (``ClientContext.poison``, applied
  after augmentation): ``label_flip`` maps every label y to C - 1 - y; ``backdoor`` stamps a white square of
  ``pattern_size`` pixels (white in normalised units, per channel) into the bottom-right corner of the first
  ceil(poison_fraction * b) samples of each batch (batches are shuffled, so that is a random share) and labels them
  ``target`` (Bagdasaryan et al. 2020's pixel-pattern backdoor, mixed into clean data);
* update attacks replace a malicious client's reply, as a delta u = reply - received model in ``params``:
  ``sign_flip`` sends -flip_scale u, ``scale`` sends scale u, ``gaussian`` sends N(0, std^2 I) (its noise from
  ``(run seed, ATTACK_STREAM, round, client, phase)``), in the phase that trains the local models; a method that
  replies with its update itself (SCAFFOLD, FedNova, q-FedAvg: ``UPDATE_TENSORS``) has that update attacked. Other
  reply tensors (SCAFFOLD's control-variate delta, buffers) are left honest.

No attack draws from the client's own generator, so honest clients and a malicious client's batch order are those of
the clean run, and a resumed run attacks exactly as an uninterrupted one. ``attack/asr`` (backdoor): the share of the
global test samples whose true class is not the target that the global model classifies as the target once
stamped, logged at every evaluation beside the clean accuracy.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from fedhet.algorithms.contract import Message, Reply
from fedhet.config import AttackSection, Config
from fedhet.data.federated import FederatedDataset
from fedhet.errors import ConfigError
from fedhet.toolkit.evaluate import evaluate
from fedhet.toolkit.local import derive_seed

ATTACK_STREAM = 0xA77AC  # the seed part of the malicious draw and of the gaussian attack's noise
DATA_ATTACKS = ("label_flip", "backdoor")
UPDATE_ATTACKS = ("sign_flip", "gaussian", "scale")
Poison = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


# Replies that carry the client's update instead of its model: SCAFFOLD's y - x, FedNova's x - y, q-FedAvg's scaled
# step. Their control variates, normalisers and the like stay honest, as buffers do.
UPDATE_TENSORS = ("delta_y", "cum_update", "delta")


def malicious_clients(cfg: AttackSection, num_clients: int, seed: int) -> list[int]:
    if cfg.kind == "none":
        return []
    count = min(num_clients, max(1, round(cfg.fraction * num_clients)))
    rng = np.random.default_rng([seed, ATTACK_STREAM])
    return sorted(int(c) for c in rng.choice(num_clients, size=count, replace=False))


def stamp(x: torch.Tensor, size: int, white: tuple[float, ...]) -> torch.Tensor:
    """``x`` (N, C, H, W) with a white ``size`` x ``size`` square in its bottom-right corner."""
    out = x.clone()
    out[..., -size:, -size:] = torch.tensor(white, dtype=x.dtype, device=x.device).view(-1, 1, 1)
    return out


class Attack:
    """What the malicious clients do; built with the client runner from the run config and the federation."""

    def __init__(self, cfg: AttackSection, fed: FederatedDataset, seed: int) -> None:
        check_attack(cfg, fed)
        self.cfg, self.seed, self.num_classes, self.white = cfg, seed, fed.num_classes, fed.white_value
        self.malicious = frozenset(malicious_clients(cfg, fed.num_clients, seed))

    def poison(self, cid: int) -> Poison | None:
        """The batch transformation of a malicious client under a data attack, else None."""
        if cid not in self.malicious or self.cfg.kind not in DATA_ATTACKS:
            return None
        if self.cfg.kind == "label_flip":
            return lambda x, y: (x, self.num_classes - 1 - y)
        return self.backdoor_batch

    def backdoor_batch(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = math.ceil(self.cfg.poison_fraction * len(y))
        x, y = x.clone(), y.clone()
        x[:k] = stamp(x[:k], self.cfg.pattern_size, self.white)
        y[:k] = self.cfg.target
        return x, y

    def corrupt(self, cid: int, rnd: int, phase_idx: int, msg: Message, reply: Reply) -> None:
        """A malicious client's reply under an update attack, in place: its model (``params``, attacked as the delta
        from the received model) or, for methods that reply with the update itself, that update. A phase whose
        reply carries neither (SphereFed's calibration statistics) is left alone."""
        if cid not in self.malicious or self.cfg.kind not in UPDATE_ATTACKS:
            return
        if "params" in reply.tensors:
            x = msg.tensors["params"]
            reply.tensors["params"] = x + self.attacked(reply.tensors["params"] - x, rnd, cid, phase_idx)
            return
        key = next((k for k in UPDATE_TENSORS if k in reply.tensors), None)
        if key is not None:
            reply.tensors[key] = self.attacked(reply.tensors[key], rnd, cid, phase_idx)

    def attacked(self, u: torch.Tensor, rnd: int, cid: int, phase_idx: int) -> torch.Tensor:
        """The malicious version of update u. Each attack commutes with a sign and a positive scale, so it is the
        same whether u is y - x, x - y (FedNova) or a scaled step (q-FedAvg)."""
        if self.cfg.kind == "sign_flip":
            return -self.cfg.flip_scale * u
        if self.cfg.kind == "scale":
            return self.cfg.scale * u
        gen = torch.Generator().manual_seed(derive_seed(self.seed, ATTACK_STREAM, rnd, cid, phase_idx))
        return (torch.randn(u.shape, generator=gen) * self.cfg.std).to(u)


def check_attack(cfg: AttackSection, fed: FederatedDataset) -> None:
    if cfg.kind == "backdoor":
        if fed.white_value is None or len(fed.input_shape) != 3:
            raise ConfigError(
                f"attack.kind='backdoor' stamps a pixel pattern on images; dataset {fed.name!r} has no normalised "
                "images (use an image dataset, or an update attack: sign_flip, gaussian, scale)"
            )
        if cfg.target >= fed.num_classes:
            raise ConfigError(f"attack.target={cfg.target} is not a class of {fed.name!r} (0..{fed.num_classes - 1})")
        if cfg.pattern_size > min(fed.input_shape[1:]):
            raise ConfigError(f"attack.pattern_size={cfg.pattern_size} exceeds the images ({fed.input_shape})")


def attack_success_rate(cfg: AttackSection, model: torch.nn.Module, fed: FederatedDataset, batch_size: int) -> float:
    """The share of stamped test samples of a class other than the target that the model labels as the target."""
    keep = fed.y_test != cfg.target
    x = stamp(fed.x_test[keep], cfg.pattern_size, fed.white_value)
    y = torch.full_like(fed.y_test[keep], cfg.target)
    return evaluate(model, x, y, fed.num_classes, batch_size).acc if len(y) else math.nan


def attack_metrics(cfg: Config, model: torch.nn.Module, fed: FederatedDataset) -> dict[str, float]:
    if cfg.attack.kind != "backdoor":
        return {}
    return {"attack/asr": attack_success_rate(cfg.attack, model, fed, cfg.run.eval_batch_size)}


def attack_record(cfg: Config, num_clients: int) -> dict[str, Any] | None:
    """attack.json's content (and summary.json's ``attack``): the kind, its settings and the malicious clients."""
    if cfg.attack.kind == "none":
        return None
    malicious = malicious_clients(cfg.attack, num_clients, cfg.run.seed)
    return {**cfg.attack.model_dump(mode="json"), "num_clients": num_clients, "malicious_clients": malicious}

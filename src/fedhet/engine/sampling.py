"""Which clients train in a round: a uniform draw, or FedUFO's dynamic sampling of the worst performers.

The draw depends only on (seed, round) and, for dynamic sampling, on the clients' last measured performance, which is
the sampler's state (in the checkpoint), so a resumed run draws what the uninterrupted one drew."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedhet.algorithms import Algorithm
from fedhet.config import Config
from fedhet.data.federated import FederatedDataset
from fedhet.results.store import MetricsLog
from fedhet.toolkit.evaluate import client_accuracy
from fedhet.toolkit.flat import FlatModel
from fedhet.toolkit.local import derive_seed


class ClientSampler:
    """``train.sampling``: "uniform" (``clients_per_round`` of the clients, without replacement) or "dynamic"."""

    def __init__(
        self, cfg: Config, fed: FederatedDataset, model: torch.nn.Module, flat: FlatModel, algo: Algorithm
    ) -> None:
        self.cfg, self.fed, self.model, self.flat, self.algo = cfg, fed, model, flat, algo
        # train.sampling = "dynamic": each client's last measured performance and the round it was measured in
        self.performance: list[float] | None = None
        self.performance_round = 0
        self.log: MetricsLog | None = None  # sampling.jsonl, while a run trains

    def open_log(self, run_dir: Path) -> None:
        if self.cfg.train.sampling == "dynamic":
            self.log = MetricsLog(run_dir / "sampling.jsonl")

    def sample(self, rnd: int, pool: list[int] | None = None, k: int | None = None) -> list[int]:
        """``k`` (default: clients per round) of the clients in ``pool`` (default: all; the system model passes the
        online ones), sorted. With every client in the pool, the draw is the same as without one."""
        pool = list(range(self.fed.num_clients)) if pool is None else pool
        n, k = len(pool), self.cfg.clients_per_round() if k is None else k
        if k >= n:
            return list(pool)
        rng = np.random.default_rng(derive_seed(self.cfg.run.seed, rnd, 0x5A))
        if self.cfg.train.sampling == "dynamic":
            return self.dynamic_sample(rnd, k, rng, pool)
        return sorted(pool[int(i)] for i in rng.choice(n, size=k, replace=False))

    def dynamic_sample(self, rnd: int, k: int, rng: np.random.Generator, pool: list[int]) -> list[int]:
        """FedUFO's dynamic sampling: the ``train.sampling_worst`` share of the ``k`` clients of ``pool`` with the
        lowest performance (ties in a random order), the rest uniformly from the others. The generator is the
        round's, as in uniform sampling, so the draw depends only on (seed, round, pool, performance); logged to
        sampling.jsonl."""
        acc = np.asarray(self.client_performance(rnd))[pool]
        n = len(acc)
        n_worst = math.floor(k * self.cfg.train.sampling_worst)
        worst = np.lexsort((rng.random(n), acc))[:n_worst]  # ascending performance; the random key breaks ties
        others = np.setdiff1d(np.arange(n), worst)
        drawn = rng.choice(others, size=k - n_worst, replace=False)
        if self.log is not None:
            self.log.append(
                {
                    "round": rnd,
                    "measured_round": self.performance_round,
                    "worst": [pool[c] for c in worst],
                    "worst_acc": [float(acc[c]) for c in worst],
                    "random": sorted(pool[c] for c in drawn),
                    "acc_mean": float(acc.mean()),
                }
            )
        return sorted(pool[int(c)] for c in np.concatenate([worst, drawn]))

    def client_performance(self, rnd: int) -> list[float]:
        """Every client's accuracy of the current global model (train.sampling_measure), re-measured at the start of
        every ``train.sampling_refresh``-th round."""
        t = self.cfg.train
        if self.performance is None or (rnd - 1) % t.sampling_refresh == 0:
            self.flat.set_params(self.algo.global_params)
            self.flat.set_buffers(self.algo.global_buffers)
            on_train = t.sampling_measure == "train"
            acc = client_accuracy(self.model, self.fed, self.cfg.run.eval_batch_size, on_train=on_train)
            self.performance, self.performance_round = [float(a) for a in acc], rnd
        return self.performance

    def state_dict(self) -> dict[str, Any]:
        return {"performance": self.performance, "performance_round": self.performance_round}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.performance = state.get("performance")
        self.performance_round = state.get("performance_round", 0)

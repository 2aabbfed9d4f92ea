"""FedAvg (McMahan et al. 2017): local SGD from the global model, then an average of the client models."""

from __future__ import annotations

from typing import Literal

from fedhet.algorithms.base import ALGORITHMS, AlgoConfig, Algorithm, Reply


class FedAvgConfig(AlgoConfig):
    # McMahan et al. 2017 weight clients by their number of samples; "uniform" is the equal-weight variant that
    # several non-IID papers use as their FedAvg baseline.
    weighting: Literal["samples", "uniform"] = "samples"


@ALGORITHMS.register(
    "fedavg", "FedAvg (McMahan et al. 2017): sample-weighted (or uniform) model averaging", FedAvgConfig
)
class FedAvg(Algorithm):
    name = "fedavg"
    Config = FedAvgConfig
    batchable = True  # default loss, hooks on the flat vectors only (engine/batched.py)
    dp_sgd = True  # default loss, no other hook reads the data

    def aggregation_weights(self, replies: dict[int, Reply]) -> list[float]:
        if getattr(self.config, "weighting", "samples") == "uniform":
            return [1.0 / len(replies)] * len(replies)
        return super().aggregation_weights(replies)

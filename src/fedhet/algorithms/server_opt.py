"""Server optimisers (Reddi et al. 2021, "Adaptive Federated Optimization"; Hsu et al. 2019 for FedAvgM).

Each algorithm's ``aggregate`` proposes a target model (for FedAvg: the weighted average of the client models). The
server optimiser turns the pseudo-gradient ``delta = target - x`` into the step actually taken, so any client-side
method composes with any server optimiser. ``sgd`` with ``lr = 1`` is plain replacement by the target.

The adaptive optimisers default to Reddi et al.'s Algorithm 2 (``form = "reddi"``: v_{-1} = tau^2, no bias
correction). ``form = "flower"`` is what Flower 1.41's strategies (flwr.serverapp.strategy FedAdam / FedYogi /
FedAdagrad) compute, for comparing with Flower users' runs: the second moment starts at 0, and FedAdam (only FedAdam
there) scales its step by sqrt(1 - beta2^(t+1)) / (1 - beta1^(t+1)) at server round t. Flower counts t in rounds;
we count the server optimiser's steps, which is the same unless a round had no reply to aggregate. Flower's
defaults differ from ours (its FedAdam lr 0.1, FedAdagrad beta1 0); set them explicitly to compare.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch
from pydantic import ConfigDict, Field, model_validator

from fedhet.params import Params
from fedhet.registry import Registry

SERVER_OPTIMIZERS = Registry("server optimiser", section="server")


class _Params(Params):
    model_config = ConfigDict(frozen=True)


class SgdParams(_Params):
    lr: float = Field(1.0, gt=0.0)  # 1.0: x <- target, i.e. plain FedAvg (McMahan et al. 2017)
    tunable: ClassVar[dict[str, str]] = {"lr": "log:0.1:3"}  # sensible default: around plain averaging (1)


class AvgMParams(_Params):
    lr: float = Field(1.0, gt=0.0)  # Hsu et al. 2019 use server lr 1 with momentum
    momentum: float = Field(0.9, ge=0.0, lt=1.0)  # Hsu et al. 2019, beta = 0.9
    tunable: ClassVar[dict[str, str]] = {"lr": "log:0.1:3", "momentum": "uniform:0:0.99"}  # sensible defaults


class AdaptiveParams(_Params):
    lr: float = Field(0.01, gt=0.0)  # Reddi et al. 2021 tune eta in 10^{-3..0}; 1e-2 is their common best
    beta1: float = Field(0.9, ge=0.0, lt=1.0)  # Reddi et al. 2021, Sec. 5
    beta2: float = Field(0.99, ge=0.0, lt=1.0)  # Reddi et al. 2021, Sec. 5
    tau: float = Field(1e-3, gt=0.0)  # adaptivity; Reddi et al. 2021 default 1e-3
    # lr: Reddi et al. 2021 tune eta over 10^{-3..0}; tau: sensible default, decades around their 1e-3
    tunable: ClassVar[dict[str, str]] = {"lr": "log:1e-3:1", "tau": "log:1e-5:1e-1"}
    # "reddi": Reddi et al. 2021, Alg. 2 (v starts at tau^2, no bias correction). "flower": flwr 1.41's strategies
    # (v starts at 0; FedAdam's step bias-corrected), see the module docstring.
    form: Literal["reddi", "flower"] = "reddi"


class ServerOptimizer:
    """``sgd``: x <- x + lr * delta."""

    def __init__(self, params: _Params | None = None) -> None:
        self.params = params or SgdParams()
        self.state: dict[str, torch.Tensor] = {}

    def init(self, x: torch.Tensor) -> None:
        self.state = {}

    def step(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return x + self.params.lr * (target - x)

    def state_dict(self) -> dict[str, Any]:
        return dict(self.state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = dict(state)


SERVER_OPTIMIZERS.register("sgd", "server SGD on the pseudo-gradient; lr=1 is plain averaging (FedAvg)", SgdParams)(
    ServerOptimizer
)


@SERVER_OPTIMIZERS.register(
    "fedavgm", "server momentum (Hsu et al. 2019): v <- beta v + delta; x <- x + lr v", AvgMParams
)
class FedAvgM(ServerOptimizer):
    def step(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        delta = target - x
        v = self.state.get("momentum")
        v = delta if v is None else self.params.momentum * v + delta
        self.state["momentum"] = v
        return x + self.params.lr * v


class _Adaptive(ServerOptimizer):
    """Reddi et al. 2021, Algorithm 2 (no bias correction, as in the paper), or Flower's form (``form``)."""

    def second_moment(self, v: torch.Tensor, d2: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def step_scale(self, t: int) -> float:
        """Factor on the server lr at step t (1-based) in Flower's form; 1 = no bias correction."""
        return 1.0

    def step(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        p = self.params
        flower = p.form == "flower"
        delta = target - x
        m = self.state.get("m", torch.zeros_like(x))
        v = self.state.get("v", torch.full_like(x, 0.0 if flower else p.tau**2))  # Reddi: v_{-1} >= tau^2 (Alg. 2)
        m = p.beta1 * m + (1 - p.beta1) * delta
        v = self.second_moment(v, delta * delta)
        self.state.update(m=m, v=v)
        lr = p.lr
        if flower:
            t = int(self.state.get("t", 0)) + 1
            self.state["t"] = torch.tensor(t)
            lr *= self.step_scale(t)
        return x + lr * m / (v.sqrt() + p.tau)


@SERVER_OPTIMIZERS.register("fedadam", "FedAdam (Reddi et al. 2021): Adam on the pseudo-gradient", AdaptiveParams)
class FedAdam(_Adaptive):
    def second_moment(self, v: torch.Tensor, d2: torch.Tensor) -> torch.Tensor:
        return self.params.beta2 * v + (1 - self.params.beta2) * d2

    def step_scale(self, t: int) -> float:
        # flwr 1.41 FedAdam.aggregate_train: eta * sqrt(1 - beta_2^(round + 1)) / (1 - beta_1^(round + 1))
        p = self.params
        return (1 - p.beta2 ** (t + 1)) ** 0.5 / (1 - p.beta1 ** (t + 1))


@SERVER_OPTIMIZERS.register(
    "fedyogi", "FedYogi (Reddi et al. 2021): Yogi's sign-controlled second moment", AdaptiveParams
)
class FedYogi(_Adaptive):
    def second_moment(self, v: torch.Tensor, d2: torch.Tensor) -> torch.Tensor:
        return v - (1 - self.params.beta2) * d2 * torch.sign(v - d2)


@SERVER_OPTIMIZERS.register(
    "fedadagrad", "FedAdagrad (Reddi et al. 2021): accumulated squared pseudo-gradients", AdaptiveParams
)
class FedAdagrad(_Adaptive):
    def second_moment(self, v: torch.Tensor, d2: torch.Tensor) -> torch.Tensor:
        return v + d2


class RpropParams(_Params):
    # The first step of every weight. Hartmann's code takes it as an argument (florian/federated-learning,
    # optimizers/rprop.py) and publishes no value for network weights; 0.01 is torch.optim.Rprop's default and
    # matched FedAvg on digits/shards in 20 rounds where 1e-3 lagged (0.85 vs 0.60 test accuracy)
    lr: float = Field(0.01, gt=0.0)
    eta_plus: float = Field(1.2, gt=1.0)  # Riedmiller & Braun 1993; Hartmann's rprop.py alpha = 1.2
    eta_minus: float = Field(0.5, gt=0.0, lt=1.0)  # Riedmiller & Braun 1993; Hartmann's rprop.py beta = 0.5
    min_step: float = Field(1e-7, gt=0.0)  # Hartmann's rprop.py min_value
    max_step: float = Field(50.0, gt=0.0)  # Hartmann's rprop.py max_value (torch.optim.Rprop: 50 too)
    tunable: ClassVar[dict[str, str]] = {"lr": "log:1e-3:1e-1"}  # sensible default: decades around 0.01

    @model_validator(mode="after")
    def _ordered(self) -> RpropParams:
        if not self.min_step <= self.lr <= self.max_step:
            raise ValueError(
                f"server rprop needs min_step <= lr <= max_step (got {self.min_step}, {self.lr}, {self.max_step})"
            )
        return self


@SERVER_OPTIMIZERS.register(
    "rprop",
    "Rprop on the pseudo-gradient (FedRetile: Hartmann et al. 2019): per-weight steps grown while its sign holds",
    RpropParams,
)
class ServerRprop(ServerOptimizer):
    """Rprop without weight backtracking (Riedmiller & Braun 1993, "Rprop-"), as the server of Hartmann et al.'s
    federated Firefox study ("Federated Learning for Ranking Browser History Suggestions", NeurIPS 2019 workshop,
    arXiv:1911.11807; FedUFO's "FedRetile" [5]): only the sign of the averaged update is used, and each weight has
    its own step, multiplied by ``eta_plus`` while the sign of its update stays the same and by ``eta_minus`` when it
    flips, within [min_step, max_step]:

        delta = target - x;  s <- clip(s * (eta_plus if delta * delta_prev > 0, eta_minus if < 0, else 1))
        x <- x + s * sign(delta)

    As in Hartmann's rprop.py, the step after a sign flip is still taken (no zeroing of the update). Their clients
    send finite-difference gradients of a non-differentiable ranking; here clients train with the shared local loop
    and the pseudo-gradient of the averaged model is the update (as FedUFO's comparison uses it). Their rprop.py
    rounds steps to integers (integer frecency weights); that does not apply to network weights."""

    def step(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        p = self.params
        delta = target - x
        steps, prev = self.state.get("steps"), self.state.get("prev")
        if steps is None:
            steps = torch.full_like(x, p.lr)
        else:
            agree = delta * prev
            factor = torch.where(agree > 0, p.eta_plus, torch.where(agree < 0, p.eta_minus, 1.0))
            steps = (steps * factor).clamp(p.min_step, p.max_step)
        self.state.update(steps=steps, prev=delta)
        return x + steps * torch.sign(delta)


def build_server_optimizer(name: str, values: dict[str, Any]) -> ServerOptimizer:
    entry, params = SERVER_OPTIMIZERS.parse(name, values)
    return entry.obj(params)

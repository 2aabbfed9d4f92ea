"""FedDyn (Acar et al. 2021, "Federated Learning Based on Dynamic Regularization").

Client k minimises  L_k(θ) − ⟨∇L_k(θ_k^{t−1}), θ⟩ + α/2 ‖θ − θ^{t−1}‖²  and then updates its gradient state
∇L_k(θ_k^t) = ∇L_k(θ_k^{t−1}) − α (θ_k^t − θ^{t−1})  (zero at its first participation).
The server keeps  h^t = h^{t−1} − α (1/m) Σ_{k∈P_t} (θ_k^t − θ^{t−1})  over all m clients and proposes
θ^t = (1/|P_t|) Σ_{k∈P_t} θ_k^t − h^t / α, applied through the server optimiser. The average is uniform, as in the
paper's Algorithm 1 and the official code.

``alpha_scaling = "data_size"`` is the official code's per-client coefficient α_k = α / w_k with w_k = n_k / n̄
(client sizes normalised to mean 1). Design: nothing crosses the wire but what the contract allows, so the server
learns client sizes from the ``num_examples`` of the replies, records them (they are part of its checkpointed
state) and sends the mean of the sizes known so far as the scalar ``mean_size``; each client computes its own
α_k from its own size. Until a client has reported (round 1) no sizes are known and every client uses α, and under
partial participation n̄ is the mean over the clients seen so far. The server side always uses the global α, as
the official code does (its h is the unscaled drift), so the per-client α only changes the local objective.

Which model is reported (``evaluate``; both are scored at every evaluation as ``feddyn_server_acc`` and
``feddyn_average_acc``, with their losses): "server" (default) reports θ^t above, the model the clients receive next,
which is what PFLlib's serverdyn.py evaluates (its ``global_model`` after ``aggregate_parameters`` is the mean minus
h/α, in every version) and so what FedRANE's FedDyn numbers are (FedRANE builds on PFLlib and tests the server's
``global_model``). "average" reports the plain average of the round's client models, the official code's
``avg_model`` (utils_methods.py ``train_FedDyn``: ``tst_perf_sel``; its example plots ``tst_perf_all``, the average of
every client's last model, which is the same under full participation), so FedDyn's own numbers; it swings much less
between rounds at strong label skew. The reported one is ``global_params`` (evaluated and checkpointed); the server
model is kept apart and broadcast (``global_message``), the pattern CReFF uses.

α = 0 turns the method off: h stays 0 and the h / α correction is dropped, which is FedAvg with uniform weights.
The official code's weight decay and gradient clipping are ``train.weight_decay`` and ``train.grad_clip``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
from pydantic import Field

from fedhet.algorithms.base import (
    ALGORITHMS,
    AlgoConfig,
    Algorithm,
    ClientContext,
    Message,
    Reply,
    Setup,
    weighted_sum,
)

if TYPE_CHECKING:
    from fedhet.algorithms.server_opt import ServerOptimizer


class FedDynConfig(AlgoConfig):
    alpha: float = Field(0.01, ge=0.0)  # official code alpha_coef = 1e-2 (example_cifar_10.py)
    tunable: ClassVar[dict[str, str]] = {"alpha": "log:1e-3:1e-1"}  # Acar et al. 2021: alpha in {0.001, 0.01, 0.1}
    # "none": one α for every client (the paper's Algorithm 1). "data_size": α / (n_k / mean n), what the official
    # code always does (identical on its equal-size partitions).
    alpha_scaling: Literal["none", "data_size"] = "none"
    # Reported as test_acc: "server" = mean - h / α (the paper's θ^t; PFLlib's and so FedRANE's evaluated model),
    # "average" = plain average of the round's client models (the official code's tst_perf_sel). Both are logged.
    evaluate: Literal["server", "average"] = "server"


@ALGORITHMS.register(
    "feddyn", "FedDyn (Acar et al. 2021): dynamic regularisation with client gradient states", FedDynConfig
)
class FedDyn(Algorithm):
    name = "feddyn"
    Config = FedDynConfig
    batchable = True  # default loss, hooks on the flat vectors only (engine/batched.py)

    def __init__(self, config: FedDynConfig, setup: Setup, server_opt: ServerOptimizer | None = None) -> None:
        super().__init__(config, setup, server_opt)
        self.h: torch.Tensor | None = None
        self.client_sizes: dict[int, int] = {}
        self.server_params: torch.Tensor | None = None  # θ^t, what the clients receive
        self.average_params: torch.Tensor | None = None  # plain average of the last round's client models

    # ----------------------------------------------------------------- server side
    def init_server(self, params: torch.Tensor, buffers: torch.Tensor) -> None:
        super().init_server(params, buffers)
        self.h = torch.zeros_like(params)
        self.server_params = self.average_params = self.global_params

    def global_message(self, rnd: int) -> Message:
        msg = super().global_message(rnd)
        msg.tensors["params"] = self.server_params
        return msg

    def configure(self, rnd: int, cids: list[int], phase: str) -> dict[int, Message]:
        msg = self.global_message(rnd)
        if self.config.alpha_scaling == "data_size" and self.client_sizes:
            msg.scalars["mean_size"] = sum(self.client_sizes.values()) / len(self.client_sizes)
        return {cid: msg for cid in cids}

    def aggregate(self, rnd: int, replies: dict[int, Reply], phase: str) -> dict[str, float]:
        alpha, n = self.config.alpha, len(replies)
        weights = [1.0 / n] * n
        mean = weighted_sum([r.tensors["params"] for r in replies.values()], weights)
        # Σ_k (θ_k − θ^{t−1}) = n (mean − θ^{t−1}); one vector instead of n differences.
        self.h.sub_(mean - self.server_params, alpha=alpha * n / self.setup.num_clients)
        target = mean - self.h / alpha if alpha > 0 else mean
        self.server_params = self.server_opt.step(self.server_params, target)
        self.average_params = mean
        self.global_params = self.server_params if self.config.evaluate == "server" else mean
        self.average_buffers(replies, weights)
        self.client_sizes.update({cid: r.num_examples for cid, r in replies.items()})
        return {}

    def round_metrics(self, rnd: int) -> dict[str, float]:
        return {"feddyn_h_norm": float(self.h.norm())}

    def extra_eval_params(self) -> dict[str, torch.Tensor]:
        return {"feddyn_server": self.server_params, "feddyn_average": self.average_params}

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "h": self.h,
            "client_sizes": dict(self.client_sizes),
            "server_params": self.server_params,
            "average_params": self.average_params,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.h = state["h"]
        # checkpoints written before both models were kept hold only the server model, as global_params
        self.server_params = state.get("server_params", self.global_params)
        self.average_params = state.get("average_params", self.global_params)
        self.client_sizes = {int(k): int(v) for k, v in state["client_sizes"].items()}

    # ----------------------------------------------------------------- client side
    def client_alpha(self, ctx: ClientContext) -> float:
        """α_k: α, or α · n̄ / n_k under data-size scaling once the server knows some sizes."""
        mean_size = ctx.message.scalars.get("mean_size")
        if self.config.alpha_scaling == "none" or mean_size is None:
            return self.config.alpha
        return self.config.alpha * float(mean_size) / len(ctx.data)

    def before_local(self, ctx: ClientContext) -> None:
        if "grad_state" not in ctx.state:
            ctx.state["grad_state"] = torch.zeros_like(ctx.flat.params)
        ctx.scratch["alpha"] = self.client_alpha(ctx)

    def after_backward(self, ctx: ClientContext) -> None:
        # Gradient of −⟨g_k, θ⟩ + α/2 ‖θ − θ^{t−1}‖², added exactly on the flat vectors.
        grad = ctx.flat.grad
        grad.sub_(ctx.state["grad_state"])
        grad.add_(ctx.flat.params - ctx.global_params, alpha=ctx.scratch["alpha"])

    def after_local(self, ctx: ClientContext) -> Reply:
        ctx.state["grad_state"].sub_(ctx.flat.params - ctx.global_params, alpha=ctx.scratch["alpha"])
        return super().after_local(ctx)

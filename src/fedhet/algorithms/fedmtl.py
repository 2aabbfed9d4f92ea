"""FedMTL: federated multi-task learning (Smith, Chiang, Sanjabi and Talwalkar, NeurIPS 2017, "Federated
Multi-Task Learning", MOCHA), trained with local SGD as PFLlib's FedMTL baseline does (FedRANE's [46]).

Every client k has its own model w_k, a column of W = [w_1 ... w_m] over all m clients of the federation, and the
federation solves

    min_W  sum_k F_k(w_k) + lam/2 tr(W Omega W^T)

with a task-relationship matrix Omega (m x m, symmetric). With the other columns held at the values the server
last received, client k's objective is F_k(w_k) + lam/2 tr(W Omega W^T), whose gradient is

    grad F_k(w_k) + lam (Omega_kk w_k + n_k),      n_k = sum_{j != k} Omega_kj w_j.

So a client needs only two things from the other clients: the one vector n_k and the scalar Omega_kk. The server
keeps W (m x P: each client's last model, the initial model until it first trains), sends client k its own model
w_k, n_k and Omega_kk (per-client messages, |S| + 1 vectors of P in all, never the m x P matrix to every client),
and puts the returned w_k into W. The client keeps w_k as its state for personalised evaluation (P-FL). The
evaluated "global" model (G-FL; FedMTL has none) is the mean of W's columns, through the server optimiser (which
changes nothing the clients train from).

Omega (``omega``):

* "mean": (I - 11^T/m)^2 = I - 11^T/m (MOCHA Sec. 3, mean-regularised MTL; the form PFLlib's servermtl.py sets
  out to build). Then lam (Omega_kk w_k + n_k) = lam (w_k - mean_j w_j): a pull toward the average of all m models.
* "learned": MOCHA's alternating update of the task relationships (official code ``gingsmith/fmtl``,
  ``opt/run_mocha.m``): Sigma = I/m, Omega = Sigma^{-1} = m I at the start, and after every ``omega_every`` rounds
  Sigma = (W^T W)^{1/2} / tr((W^T W)^{1/2}), Omega = Sigma^{-1}, computed in float64 from the eigen-decomposition of
  the m x m Gram matrix with its eigenvalues floored at 1e-7 (the code floors them only when one is negative;
  always flooring keeps Omega finite when two clients still hold the same model).

References and deviations:

* MOCHA solves each task's subproblem in the dual (SDCA for convex losses, hinge in the code) and combines updates
  through Sigma; a neural network has no usable dual, so, as PFLlib does, each client takes SGD steps on its primal
  objective (the shared loop, ``train``'s optimiser) with the regulariser's gradient added.
* The paper writes R = lam_1 tr(W Omega W^T) + lam_2 ||W||_F^2; the official code uses lam/2 tr(W Omega W^T) (its
  compute_primal.m), kept here. lam_2 ||W||^2 is weight decay 2 lam_2 on every client (``train.weight_decay``).
* PFLlib (clientmtl.py / servermtl.py, FedRANE's code base) differs in ways that make its regulariser inert:
  it flattens the models with ``state_dict()``, whose tensors are detached, so the regulariser has no gradient and
  its FedMTL is purely local training from the initial model (``lam = 0`` here reproduces exactly that); its Omega
  is built from ``torch.ones`` (not the identity) squared elementwise, and the client uses only the scalar
  sqrt(Omega[0][0]) = 1 - 1/m, with a regulariser ||W||_F^2 + (1 - 1/m)^2 ||W 1||^2 scaled by 10^-(digits(P) + 1);
  W holds only the round's selected clients, and each of them receives the whole P x m matrix.
* Under partial participation W keeps the last model of every client (MOCHA's stale/dropped tasks), not only the
  round's participants as PFLlib; under full participation (FedRANE's protocol) the two are the same.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch
from pydantic import Field

from fedhet.algorithms.base import ALGORITHMS, AlgoConfig, Algorithm, ClientContext, Message, Reply

PERSONAL = "personal"  # the client-state key of w_k
EIGEN_FLOOR = 1e-7  # run_mocha.m: the floor on the eigenvalues of W^T W


class FedMTLConfig(AlgoConfig):
    # lam in lam/2 tr(W Omega W^T). MOCHA's model_driver.m cross-validates lam over {1e-5, ..., 0.1, 10}; 0.01 is
    # our choice (mean Omega: a pull of 0.01 (w_k - mean w) per unit loss). lam = 0 is what PFLlib computes.
    lam: float = Field(0.01, ge=0.0)
    tunable: ClassVar[dict[str, str]] = {"lam": "log:1e-5:10"}  # MOCHA cross-validates lam over {1e-5, ..., 10}
    # "mean": fixed (I - 11^T/m)^2 (MOCHA Sec. 3, PFLlib's intent); "learned": Sigma = sqrtm(W^T W)/tr, Omega =
    # Sigma^-1, re-estimated from W (MOCHA's official run_mocha.m).
    omega: Literal["mean", "learned"] = "mean"
    # "learned" only: rounds between two Omega updates (run_mocha.m: one per outer iteration of W updates).
    omega_every: int = Field(1, ge=1)


def mean_omega(m: int) -> torch.Tensor:
    """(I - 11^T/m)^2, which equals I - 11^T/m (the centring matrix is idempotent)."""
    centre = torch.eye(m, dtype=torch.float64) - 1.0 / m
    return centre @ centre


def learned_omega(models: torch.Tensor) -> torch.Tensor:
    """MOCHA's Omega = Sigma^{-1}, Sigma = (W^T W)^{1/2} / tr((W^T W)^{1/2}), for W's columns = ``models``' rows."""
    gram = models.double() @ models.double().T
    evals, vecs = torch.linalg.eigh(gram)
    roots = evals.clamp_min(EIGEN_FLOOR).sqrt()
    return (vecs * (roots.sum() / roots)) @ vecs.T


@ALGORITHMS.register(
    "fedmtl",
    "FedMTL (Smith et al. 2017, MOCHA): per-client models coupled by lam/2 tr(W Omega W^T), trained by local SGD",
    FedMTLConfig,
)
class FedMTL(Algorithm):
    name = "fedmtl"
    Config = FedMTLConfig
    batchable = True  # default loss, hooks on the flat vectors only (engine/batched.py)
    personalized = True

    # ----------------------------------------------------------------- server side
    def init_server(self, params: torch.Tensor, buffers: torch.Tensor) -> None:
        super().init_server(params, buffers)
        m = self.setup.num_clients
        self.models = params.expand(m, -1).clone()  # W^T: row k is client k's last model
        if self.config.omega == "mean":
            self.omega = mean_omega(m)
        else:
            self.omega = torch.eye(m, dtype=torch.float64) * m  # run_mocha.m: Sigma = I/m at the start

    def configure(self, rnd: int, cids: list[int], phase: str) -> dict[int, Message]:
        base = self.global_message(rnd)
        rows = self.omega[cids].to(self.models)  # Omega lives on the CPU in float64; the models may be on a GPU
        mixed = rows @ self.models  # (Omega W^T)_k for each client, own term included
        out = {}
        for i, cid in enumerate(cids):
            own = float(self.omega[cid, cid])
            pull = mixed[i].sub_(self.models[cid], alpha=own)  # n_k: the other clients' models only
            # a copy: the row is replaced in place when the reply comes back
            tensors = {**base.tensors, "params": self.models[cid].clone(), "neighbours": pull}
            out[cid] = Message(tensors=tensors, scalars={**base.scalars, "omega_self": own})
        return out

    def aggregate(self, rnd: int, replies: dict[int, Reply], phase: str) -> dict[str, float]:
        for cid, reply in replies.items():
            self.models[cid] = reply.tensors["params"]
        self.global_params = self.server_opt.step(self.global_params, self.models.mean(dim=0))
        self.average_buffers(replies, self.aggregation_weights(replies))
        if self.config.omega == "learned" and rnd % self.config.omega_every == 0:
            self.omega = learned_omega(self.models)
        return {}

    def round_metrics(self, rnd: int) -> dict[str, float]:
        spread = (self.models - self.models.mean(dim=0)).norm(dim=1)
        return {"model_spread": float(spread.mean()), "omega_diag_mean": float(self.omega.diagonal().mean())}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "models": self.models, "omega": self.omega}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.models = state["models"]
        self.omega = state["omega"]

    # ----------------------------------------------------------------- client side
    def after_backward(self, ctx: ClientContext) -> None:
        # grad of lam/2 tr(W Omega W^T) in w_k with the other columns fixed: lam (Omega_kk w_k + n_k).
        msg = ctx.message
        term = msg.tensors["neighbours"].add(ctx.flat.params, alpha=float(msg.scalars["omega_self"]))
        ctx.flat.grad.add_(term, alpha=self.config.lam)

    def after_local(self, ctx: ClientContext) -> Reply:
        ctx.state[PERSONAL] = ctx.flat.get_params()
        return super().after_local(ctx)

    def personalize(self, ctx: ClientContext) -> torch.Tensor | None:
        return ctx.state.get(PERSONAL)

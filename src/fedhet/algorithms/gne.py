"""GNE: Nash-bargaining aggregation (the server side of FedRANE, Liao et al., ACM MM 2023, Sec. 3.4), for any
client method whose server forms a weighted average of the client models.

The participants' deviations Delta_k = theta_k - theta are the columns of G (d x K). The global update
Delta = G p is the Nash bargaining solution of max_{Delta in B_r} sum_k log(Delta_k^T Delta) (Eq. 12), whose KKT
condition with lambda = 1 (Eq. 14) is

    G^T G p = 1 / p        (elementwise; so ||G p||^2 = p^T G^T G p = K: the ball's radius r = K).

Two solvers of that equation, both in float64 on M = G^T G / ||G^T G||_F (Nash-MTL's Frobenius normalisation; p is
rescaled by ||G^T G||_F^{-1/2} afterwards, which solves the original equation exactly):

* ``newton`` (default): the equation is exactly the stationarity condition of the strictly convex problem
  min_{p > 0} 1/2 p^T M p - sum_k log p_k (notes/fedrane.md 2.3, "equivalent exact convex reformulation"), solved by
  damped Newton (Hessian M + diag(1/p^2), backtracking that keeps p > 0). Unique solution when M is positive
  definite; a few iterations.
* ``ccp``: the paper's sequential convex procedure (Eqs. 15-16, from Nash-MTL). With q_k(p) = (M p)_k and
  phi_k(p) = log p_k + log q_k(p), each iteration tau solves the convex problem
  min_p sum_k q_k(p) + grad phi(p_tau)^T (p - p_tau)  s.t.  phi_k(p) >= 0, p > 0
  (the concave phi linearised at p_tau; grad phi(p) = 1/p + M (1 / (M p))). The sub-problem is solved here by a
  log-barrier interior-point method (Newton on t c^T p - sum_k log phi_k(p), t raised a hundredfold until the
  duality gap K / t is negligible), written out because no cvxpy is installed and scipy is only an indirect
  dependency. As in the official code: warm start at the clients' sample ratios (the algorithm's own weights), at
  most 20 outer iterations, stop when ||p - p_prev|| < 1e-6 or the equation holds. The linearisation needs a start
  with M p > 0 (phi is undefined elsewhere; the official code evaluates its gradient formula there anyway); when the
  warm start lacks it (conflicting deltas), the start is a strictly feasible point found by the textbook phase I
  (Boyd & Vandenberghe 11.4.1), and if there is none the solve fails (fallback, below). When the sub-problem's
  solution makes every constraint active it is the solution of G^T G p = 1/p, so CCP usually stops after one or two
  iterations.

Aggregation (``GNE.target``), following the notes' gotchas 1-4 and 14:

* sign: G's columns are Delta_k = theta_k - theta and the target is theta + G p (Eq. 10). Algorithm 1's
  theta - G p is the same step written with pseudo-gradients theta - theta_k (as the official code does); p is
  the same either way, since G^T G does not change sign.
* scale (``normalize``): ``sum_to_one`` (default) divides p by its sum, as the official code does (``w /= sum(alpha)``),
  so the update is a convex combination of the deltas with FedAvg's magnitude; ``paper`` is the paper-literal
  ||G p||^2 = K, whatever the clients' step sizes; ``match_fedavg_norm`` rescales p so that ||G p|| equals the norm of
  the algorithm's own weighted update (the notes' third option).
* clients whose delta is exactly zero are dropped from G (official code: they make G^T G p = 1/p unsolvable) and get
  weight 0; if every delta is zero the update is zero.
* jitter: if the smallest eigenvalue of the normalised Gram matrix is below ``jitter``, ``jitter * I`` is added
  (notes, gotcha 3; without it almost collinear or opposite deltas leave Newton without a minimum).
* fallback: if the solver does not reach the equation (max_k |p_k (M p)_k - 1| > 1e-6) or returns a non-finite p,
  the round uses the algorithm's own weights (sample weights for FedAvg), counted in ``gne_fallbacks`` and warned.
* the Gram matrix is accumulated in float64 from the float32 deltas, in chunks (gotcha 4); buffers (BatchNorm
  statistics) are no deviations and stay with the algorithm's own weighted average (gotcha 14; the official code
  never updates them, which the notes call a bug).
* the final step still goes through the server optimiser, with target = theta + G p.

Diagnostics, kept for the next ``round_metrics`` (notes section 4, Fig. 3; gotcha 2): ``gne_cos_mean`` /
``gne_cos_min``, the cosine between the global update and each client's non-zero delta, and ``gne_update_norm``;
``gne_fedavg_*`` the same for the algorithm's own weighted update (FedAvg's for fedavg); ``gne_weight_min/max``,
``gne_iterations``, ``gne_residual``, ``gne_dropped``, ``gne_fallback`` (this round) and the running counts
``gne_fallbacks`` and ``gne_jitters``. All are read off the Gram matrix, at no extra pass over the parameters.

Use: ``server.aggregation = "gne"`` (any algorithm whose class accepts it, see ``Algorithm.accepts_gne``), or from
an algorithm's own code ``self.use_gne(GNE(solver, normalize, jitter))`` in its ``__init__`` (FedRANE); the base
``aggregate`` then calls ``GNE.target`` through ``aggregate_target``, and the counters travel in ``state_dict``.

Deviations from the official code (XeniaLLL/HyperFed_and_FedRANE-master, serverFedRANE.py, a copy of Nash-MTL's
solver in AvivNavon/nash-mtl methods/weight_methods.py): the CCP sub-problems are solved by our own barrier method
instead of cvxpy/ECOS (same problem); the official stop test ||M alpha - 1/alpha|| < 1e-3 compares the normalised M
with alpha on the original scale, here both are on the normalised scale; the official code keeps the previous
round's alpha when ECOS fails, here a failed solve falls back to the algorithm's weights; jitter and the
all-zero round are additions (notes, gotcha 3).
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any

import torch

from fedhet.toolkit.flat import weighted_sum

SOLVERS = ("newton", "ccp")
NORMALIZATIONS = ("sum_to_one", "paper", "match_fedavg_norm")
ACCEPT_RESIDUAL = 1e-6  # max_k |p_k (M p)_k - 1| above which a solve counts as failed (fallback)
NEWTON_TOL = 1e-12  # ours: Newton converges quadratically, so float64 reaches this in a step or two more
NEWTON_MAX_ITER = 100
CCP_MAX_OUTER = 20  # official code: ``for _ in range(20)  # optim_niter``
CCP_STEP_TOL = 1e-6  # official code: ||alpha - alpha_prev|| < 1e-6
BARRIER_GAP = 1e-13  # ours: relative duality gap of each CCP sub-problem (float64)
BARRIER_GROWTH = 100.0  # ours: t <- 100 t between centring steps (B&V 11.3: 10-100 work; 100 was fastest here)


class NashSolveError(ValueError):
    """The Gram matrix cannot give Nash weights (wrong shape or type, non-finite, a zero delta)."""


def nash_weights(
    gram: torch.Tensor,
    solver: str = "newton",
    start: torch.Tensor | None = None,
    *,
    jitter: float = 1e-8,
    tol: float = NEWTON_TOL,
    max_iter: int | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """The p > 0 with ``gram @ p = 1 / p`` (K x K float64 Gram matrix of the deltas, each with a non-zero norm).

    ``start``: the CCP warm start (official: the clients' sample ratios; default uniform); Newton starts at
    1/sqrt(diag) of the normalised matrix, exact when the deltas are orthogonal. Returns p (float64) and an info
    dict: solver, iterations, residual = max_k |p_k (gram p)_k - 1| (scale-free), converged, jittered."""
    check_gram(gram, solver)
    norm = torch.linalg.matrix_norm(gram)  # Frobenius (Nash-MTL's normalisation_factor)
    m = gram / norm
    jittered = jitter > 0 and bool(torch.linalg.eigvalsh(m)[0] < jitter)
    if jittered:
        m = m + jitter * torch.eye(len(m), dtype=m.dtype, device=m.device)
    start = torch.full_like(m[0], 1.0 / len(m)) if start is None else start.to(m)
    try:
        if solver == "newton":
            p, iters = newton_solve(m, tol, max_iter or NEWTON_MAX_ITER)
        else:
            p, iters = ccp_solve(m, start, tol, max_iter or CCP_MAX_OUTER)
    except torch.linalg.LinAlgError:  # a singular Newton system: the iterates ran off (no solution)
        p, iters = torch.full_like(start, math.nan), -1
    residual = nash_residual(m, p)
    info = {
        "solver": solver,
        "iterations": iters,
        "residual": residual,
        "converged": math.isfinite(residual) and residual <= ACCEPT_RESIDUAL,
        "jittered": jittered,
    }
    return p / norm.sqrt(), info


def check_gram(gram: torch.Tensor, solver: str) -> None:
    if solver not in SOLVERS:
        raise ValueError(f"unknown Nash solver {solver!r}; valid: {', '.join(SOLVERS)}")
    if gram.dtype != torch.float64 or gram.dim() != 2 or gram.shape[0] != gram.shape[1] or not len(gram):
        raise NashSolveError(
            f"the Gram matrix must be a non-empty square float64 tensor (got {gram.dtype} {tuple(gram.shape)})"
        )
    if not bool(torch.isfinite(gram).all()):
        raise NashSolveError("the Gram matrix has non-finite entries")
    if not bool((gram.diagonal() > 0).all()):
        raise NashSolveError("a delta with zero norm has no Nash weight (drop it first)")


def nash_residual(m: torch.Tensor, p: torch.Tensor) -> float:
    """max_k |p_k (M p)_k - 1|: zero exactly at the solution, whatever the scale of M."""
    value = float((p * (m @ p) - 1).abs().max())
    return value if math.isfinite(value) else math.inf


# --------------------------------------------------------------------------------------- Newton (convex form)
def newton_solve(m: torch.Tensor, tol: float, max_iter: int) -> tuple[torch.Tensor, int]:
    """Damped Newton on F(p) = 1/2 p^T M p - sum log p."""

    def objective(q: torch.Tensor) -> float:
        return float(0.5 * q @ m @ q - q.log().sum())

    p = m.diagonal().rsqrt()
    for it in range(max_iter):
        if nash_residual(m, p) <= tol:
            return p, it
        grad = m @ p - 1 / p
        step = -torch.linalg.solve(m + torch.diag(p.pow(-2)), grad)
        decrement = float(-(grad @ step))
        if decrement < 1 / 16 and bool((p + step > 0).all()):
            # F is self-concordant: with Newton decrement below 1/4 the full step stays in p > 0 and converges
            # quadratically (Boyd & Vandenberghe 9.6.4); no line search, whose objective test rounding would decide
            p = p + step
            continue
        new = backtrack(p, step, objective, -decrement)
        if new is p:  # no decrease left in float64: as close as it gets
            return p, it + 1
        p = new
    return p, max_iter


def backtrack(p: torch.Tensor, step: torch.Tensor, objective, slope: float) -> torch.Tensor:
    """The Armijo step (fraction 1/4, halving) along ``step`` from p that stays inside the domain (objective < inf);
    p itself when even a 1e-12 step does not decrease the objective (rounding has the last word)."""
    f0, t = objective(p), 1.0
    while t > 1e-12:
        value = objective(p + t * step)
        if value <= f0 + 0.25 * t * slope:
            return p + t * step
        t *= 0.5
    return p


# --------------------------------------------------------------------------------------- CCP (paper, Eqs. 15-16)
def ccp_solve(m: torch.Tensor, start: torch.Tensor, tol: float, max_outer: int) -> tuple[torch.Tensor, int]:
    """Sequential convex procedure: linearise phi at p_tau, solve the convex sub-problem, repeat."""
    p = ccp_start(m, start)
    if p is None:
        return torch.full_like(start, math.nan), 0  # the constraints phi_k >= 0 cannot all hold
    for it in range(1, max_outer + 1):
        c = m.sum(0) + 1 / p + m @ (1 / (m @ p))  # grad of sum_k q_k(p) plus grad phi(p_tau)
        new = ccp_subproblem(m, c, p)
        moved = float((new - p).norm())
        p = new
        if moved < CCP_STEP_TOL or nash_residual(m, p) <= tol:
            return p, it
    return p, max_outer


def ccp_start(m: torch.Tensor, start: torch.Tensor) -> torch.Tensor | None:
    """The warm start if phi is defined there (p > 0, M p > 0), else a strictly feasible point found by phase I."""
    if bool((start > 0).all() and (m @ start > 0).all()):
        return start.clone()
    return feasible_point(m)


def feasible_point(m: torch.Tensor) -> torch.Tensor | None:
    """Phase I (Boyd & Vandenberghe 11.4.1): min s s.t. 1/p_k - (M p)_k <= s, p > 0, stopped once s < 0, where
    p_k (M p)_k > 1 for every k. None if there is no such p (no update agrees with every client)."""
    k = len(m)
    p = m.diagonal().rsqrt()
    z = torch.cat([p, p.new_tensor([float((1 / p - m @ p).max()) + 1.0])])  # (p, s), strictly inside
    t = 1.0
    while t < 1e12:
        for _ in range(NEWTON_MAX_ITER):
            grad, hess = phase_one_derivatives(m, z, t)
            step = -torch.linalg.solve(hess, grad)
            new = backtrack(z, step, functools.partial(phase_one_barrier, m, t), float(grad @ step))
            if float(new[k]) < 0:
                return new[:k].clone()
            if new is z or float(-(grad @ step)) / 2 < 1e-12:
                break
            z = new
        t *= BARRIER_GROWTH
    return None


def phase_one_barrier(m: torch.Tensor, t: float, z: torch.Tensor) -> float:
    """t s - sum_k log u_k - sum_k log p_k, with the slacks u_k = s - 1/p_k + (M p)_k."""
    p, s = z[:-1], z[-1]
    if not bool((p > 0).all()):
        return math.inf
    u = s - 1 / p + m @ p
    return float(t * s - u.log().sum() - p.log().sum()) if bool((u > 0).all()) else math.inf


def phase_one_derivatives(m: torch.Tensor, z: torch.Tensor, t: float) -> tuple[torch.Tensor, torch.Tensor]:
    p, s = z[:-1], z[-1]
    k = len(p)
    u = s - 1 / p + m @ p
    jac = torch.cat([torch.diag(p.pow(-2)) + m, torch.ones_like(p)[:, None]], dim=1)  # row k: grad u_k over (p, s)
    grad = -(jac / u[:, None]).sum(0)
    grad[:k] -= 1 / p
    grad[k] += t
    hess = (jac.T / u**2) @ jac
    hess[:k, :k] += torch.diag(2 / (p**3 * u) + p.pow(-2))  # -hess u_k / u_k (hess u_k = -2/p_k^3), log p_k terms
    return grad, hess


def ccp_subproblem(m: torch.Tensor, c: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """min c^T p s.t. phi_k(p) = log p_k + log (M p)_k >= 0, by the log-barrier method from a scaled-up p."""
    k = len(p)
    # phi_k(s p) = phi_k(p) + 2 log s: scaling p up makes every constraint strictly feasible (phi_k >= log 2)
    p = p * math.exp(max(0.0, (math.log(2.0) - float(constraints(m, p).min())) / 2))
    t = k / float(c @ p)
    while True:
        p = centre(m, c, p, t)
        if k / t < BARRIER_GAP * abs(float(c @ p)):
            return p
        t *= BARRIER_GROWTH


def constraints(m: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return p.log() + (m @ p).log()


def centre(m: torch.Tensor, c: torch.Tensor, p: torch.Tensor, t: float) -> torch.Tensor:
    """Newton's method on the barrier function t c^T p - sum_k log phi_k(p)."""

    def barrier(q: torch.Tensor) -> float:
        mq = m @ q
        if not bool((q > 0).all() and (mq > 0).all()):
            return math.inf
        phi = q.log() + mq.log()
        return float(t * (c @ q) - phi.log().sum()) if bool((phi > 0).all()) else math.inf

    eye = torch.eye(len(p), dtype=p.dtype, device=p.device)
    for _ in range(NEWTON_MAX_ITER):
        mp = m @ p
        phi = p.log() + mp.log()
        jac = eye / p + m / mp[:, None]  # row k: grad phi_k = e_k / p_k + M_k / (M p)_k
        grad = t * c - (jac / phi[:, None]).sum(0)
        # sum_k [grad phi_k grad phi_k^T / phi_k^2 - hess phi_k / phi_k],
        # with hess phi_k = -e_k e_k^T / p_k^2 - M_k M_k^T / (M p)_k^2
        hess = (jac.T / phi**2) @ jac + torch.diag(1 / (p**2 * phi)) + (m.T / (mp**2 * phi)) @ m
        step = -torch.linalg.solve(hess, grad)
        decrement = float(-(grad @ step))
        # the barrier grows like t, and so does the rounding floor of its decrement: the test is relative to t
        if decrement / 2 < 1e-14 * max(1.0, t):
            return p
        new = backtrack(p, step, barrier, -decrement)
        if float((new - p).norm()) <= 1e-14 * float(p.norm()):  # moves in the last bits only: centred
            return new
        p = new
    return p


# --------------------------------------------------------------------------------------- aggregation
def gram_matrix(deltas: list[torch.Tensor], chunk: int = 1 << 20) -> torch.Tensor:
    """G^T G in float64 from float32 deltas, a chunk of coordinates at a time (memory: K x chunk doubles)."""
    size = deltas[0].numel()
    gram = torch.zeros(len(deltas), len(deltas), dtype=torch.float64, device=deltas[0].device)
    for lo in range(0, size, chunk):
        block = torch.stack([d[lo : lo + chunk] for d in deltas]).double()
        gram += block @ block.T
    return gram


class GNE:
    """Nash-bargaining aggregation of the participants' deltas; see the module docstring.

    ``target(x, client_params, weights)`` returns theta + G p (to be handed to the server optimiser);
    ``metrics()`` the last round's diagnostics; ``state_dict`` holds the counters and those diagnostics."""

    def __init__(self, solver: str = "newton", normalize: str = "sum_to_one", jitter: float = 1e-8) -> None:
        if solver not in SOLVERS:
            raise ValueError(f"unknown GNE solver {solver!r}; valid: {', '.join(SOLVERS)}")
        if normalize not in NORMALIZATIONS:
            raise ValueError(f"unknown GNE normalisation {normalize!r}; valid: {', '.join(NORMALIZATIONS)}")
        if not (math.isfinite(jitter) and jitter >= 0):
            raise ValueError(f"GNE jitter must be a finite number >= 0 (got {jitter})")
        self.solver, self.normalize, self.jitter = solver, normalize, jitter
        self.fallbacks = 0  # rounds that used the algorithm's own weights because the solve failed
        self.jitters = 0  # rounds whose Gram matrix needed jitter
        self.last: dict[str, float] = {}

    def target(self, x: torch.Tensor, client_params: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
        deltas = [p - x for p in client_params]
        gram = gram_matrix(deltas)
        own = torch.tensor(weights, dtype=torch.float64, device=gram.device)
        p = self.weights(gram, own)
        self.last.update(diagnostics(gram, p, own))
        return x + weighted_sum(deltas, p.tolist())

    def weights(self, gram: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
        """GNE's weight per client (0 for a zero delta), or ``own`` if the solve fails."""
        kept = (gram.diagonal() > 0).nonzero().flatten()
        out = torch.zeros_like(own)
        self.last = {"gne_dropped": float(len(own) - len(kept)), "gne_fallback": 0.0}
        if not len(kept):
            return out  # every delta is zero: so is the update
        sub = gram[kept][:, kept]
        start = own[kept] / own[kept].sum() if float(own[kept].sum()) > 0 else None
        p, info = nash_weights(sub, self.solver, start, jitter=self.jitter)
        self.jitters += info["jittered"]
        self.last.update(gne_iterations=float(info["iterations"]), gne_residual=info["residual"])
        if not (info["converged"] and bool(torch.isfinite(p).all())):
            self.fallbacks += 1
            self.last["gne_fallback"] = 1.0
            warnings.warn(
                f"GNE: the {self.solver} solve did not converge (residual {info['residual']:.3g}); "
                f"this round uses the algorithm's own weights ({self.fallbacks} fallbacks so far)",
                stacklevel=2,
            )
            return own
        out[kept] = self.scaled(p, sub, own[kept])
        return out

    def scaled(self, p: torch.Tensor, gram: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
        if self.normalize == "sum_to_one":
            return p / p.sum()
        if self.normalize == "match_fedavg_norm":
            return p * (own @ gram @ own / (p @ gram @ p)).sqrt()
        return p

    def metrics(self) -> dict[str, float]:
        return {**self.last, "gne_fallbacks": float(self.fallbacks), "gne_jitters": float(self.jitters)}

    def state_dict(self) -> dict[str, Any]:
        return {"fallbacks": self.fallbacks, "jitters": self.jitters, "last": dict(self.last)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.fallbacks = int(state["fallbacks"])
        self.jitters = int(state["jitters"])
        self.last = dict(state["last"])


def diagnostics(gram: torch.Tensor, p: torch.Tensor, own: torch.Tensor) -> dict[str, float]:
    """Update norms and cosines with each non-zero delta (Fig. 3), all read off the Gram matrix."""
    out: dict[str, float] = {}
    kept = gram.diagonal() > 0
    lengths = gram.diagonal()[kept].sqrt()
    for name, w in (("gne", p), ("gne_fedavg", own)):
        norm = float(w @ gram @ w) ** 0.5 if float(w @ gram @ w) > 0 else 0.0
        out[f"{name}_update_norm"] = norm
        if norm > 0 and bool(kept.any()):
            cos = (gram @ w)[kept] / (lengths * norm)
            out[f"{name}_cos_mean"] = float(cos.mean())
            out[f"{name}_cos_min"] = float(cos.min())
    if bool(kept.any()):
        out["gne_weight_min"] = float(p[kept].min())
        out["gne_weight_max"] = float(p[kept].max())
    return out

"""Local relational augmentation (LRA, FedRANE Sec. 3.3): a block between a model's body and its head that enriches
each sample's representation with those of related samples in the same mini-batch.

For a batch of representations Z (B x d):

1. P = the Pearson correlation matrix of the rows of Z (B x B, sample against sample over the d features).
2. The SLIM relation matrix Bm of Eq. 2-4: min ½||P - P Bm||² + lambda_R Tr(Bmᵀ Phi Bm), diag(Bm) = 0, alternating
   Bm (Phi fixed) and Phi = (Bm Bmᵀ)^(-1/2) (Bm fixed) from Phi = I. ``relation_form`` says how Bm is solved with Phi
   fixed: ``"eq4"`` the closed form as printed, H = (PᵀP + lambda_R (Phi + Phiᵀ))^-1, Bm_ij = -H_ij / H_jj (exact
   only when Phi + Phiᵀ is diagonal); ``"kkt"`` the exact solution of the constrained problem,
   Bm = I - lambda_R H M - H diag(gamma), gamma_j = (1 - lambda_R (H M)_jj) / H_jj, M = Phi + Phiᵀ (notes 2.2(b)4);
   ``"oneshot"`` the official code's GraphGenerator: one EASE solve on P itself, H = (P + lambda_R I)^-1, no Phi.
   Phi's inverse square root floors the eigenvalues of Bm Bmᵀ at ``eig_floor`` times the largest.
3. Adjacency A = (|Bm| + |Bm|ᵀ) / 2 (zero diagonal). The Laplacian D - A is never used by Eq. 5-6, so it is not
   formed. Neighbourhood N_i: the ``topk`` largest A_ij, j != i (notes' proposal), or every j != i with A_ij > 0
   (``"all"``, the official code's full mask).
4. ``steps`` rounds of attentive message passing (Eq. 5-6): h_i <- sum_{j in N_i} alpha_ij W h_j with
   alpha_ij = softmax_{j in N_i}((W_m h_i) . (W_n h_j) / sqrt(d)). The softmax is the notes' reading: Eq. 6 prints
   the raw score. No self term (diag(Bm) = 0) unless ``self_loop``; no bias, non-linearity or normalisation (none is
   printed). The output z~ = h^L has the width d of z, so the predictor and the CD loss read it directly.
   ``attention = "gat"`` replaces Eq. 5-6 by the official code's GAT layer (``graph_models.GAT``, its default
   ``gnn_type``): per head, e_ij = LeakyReLU_0.1(aᵀ[W h_i ; W h_j]) softmax-normalised over N_i, h'_i =
   ELU(sum_j alpha_ij W h_j); the heads (2) are averaged, then dropout 0.2 in training. Its scores split as
   s_i + t_j inside the LeakyReLU, so every node ranks its neighbours alike ("static" attention, Brody et al. 2022):
   over the full mask every z~_i is nearly the same mix of the batch.

The graph (P, Bm, A) is built in float64 without gradient. It enters Eq. 5-6 only through the discrete
neighbourhood N_i (A weights no edge), so no gradient could reach the extractor through it anyway; the notes'
question whether to differentiate through ``inverse`` and ``eigh`` (2.2(b)5) does not arise. The official code
does not detach, but its A also enters only through the mask adj > 0 (``mult_attr = 0``). The extractor learns
through the message passing and the CD loss. A batch smaller than ``min_batch`` has no usable
correlation, so LRA passes it through unchanged.

LRA is batch-dependent: a sample's z~ depends on the other samples of its batch. In eval mode it therefore either
runs on chunks of exactly ``eval_batch`` samples (``at_eval``; the last chunk may be short) or is skipped (z~ = z,
the official evaluation). ``attach_lra`` records that chunk size as the model's ``transductive_batch``, and the
engine's evaluation (``toolkit/evaluate.py``) then cuts every test set into those chunks whatever
``run.eval_batch_size`` says, so a reported accuracy never depends on how the test set was cut.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedhet.models.base import FedModel

RelationForm = Literal["eq4", "kkt", "oneshot"]
Neighbourhood = Literal["topk", "all"]
Attention = Literal["dot", "gat"]
GAT_SLOPE = 0.1  # the official GraphAttentionLayer's LeakyReLU slope (its ``alpha``)
PEARSON_EPS = 1e-8  # inside the square root of a row's norm, so a constant row has finite gradients


@dataclass(frozen=True)
class LRASettings:
    lambda_r: float = 0.1
    relation_form: RelationForm = "eq4"
    slim_iters: int = 1
    slim_tol: float = 1e-4
    eig_floor: float = 1e-6
    neighbourhood: Neighbourhood = "topk"
    topk: int = 10
    self_loop: bool = False
    steps: int = 1
    attention: Attention = "dot"
    gat_heads: int = 2
    gat_dropout: float = 0.2
    min_batch: int = 2
    at_eval: bool = True
    eval_batch: int = 128


# --------------------------------------------------------------------------------------------- graph
def centred_unit_rows(z: Tensor) -> Tensor:
    """Rows centred over their features and scaled to unit norm: their dot products are Pearson correlations."""
    zc = z - z.mean(dim=1, keepdim=True)
    return zc / torch.sqrt((zc * zc).sum(dim=1, keepdim=True) + PEARSON_EPS)


def pearson(z: Tensor) -> Tensor:
    """B x B correlation of the rows of z (a constant row correlates 0 with everything, itself included)."""
    u = centred_unit_rows(z)
    return u @ u.T


def zero_diagonal(m: Tensor) -> Tensor:
    return m - torch.diag_embed(torch.diagonal(m))


def slim_solve(p: Tensor, phi: Tensor, lambda_r: float, form: RelationForm) -> Tensor:
    """The relation matrix Bm for a fixed Phi (Eq. 4 as printed, or the exact KKT solution)."""
    m = phi + phi.T
    h = torch.linalg.inv(p.T @ p + lambda_r * m)
    h_diag = torch.diagonal(h)
    if form == "eq4":
        return zero_diagonal(-h / h_diag[None, :])
    hm = h @ m
    gamma = (1.0 - lambda_r * torch.diagonal(hm)) / h_diag
    eye = torch.eye(len(p), dtype=p.dtype, device=p.device)
    return zero_diagonal(eye - lambda_r * hm - h * gamma[None, :])  # the diagonal is 0 up to rounding


def oneshot_relation(p: Tensor, lambda_r: float) -> Tensor:
    """The official GraphGenerator: one EASE solve on the correlation matrix, (P + lambda_R I)^-1."""
    h = torch.linalg.inv(p + lambda_r * torch.eye(len(p), dtype=p.dtype, device=p.device))
    return zero_diagonal(-h / torch.diagonal(h)[None, :])


def inverse_sqrt_psd(s: Tensor, floor: float) -> Tensor:
    """S^(-1/2) of a symmetric PSD matrix, eigenvalues floored at ``floor`` times the largest (at least 1e-12)."""
    e, v = torch.linalg.eigh(s)
    e = e.clamp_min(max(floor * float(e.max()), 1e-12))
    return (v * e.rsqrt()[None, :]) @ v.T


def relation_matrix(p: Tensor, s: LRASettings) -> Tensor:
    """Bm of Eq. 2-4 by alternating Bm and Phi from Phi = I, at most ``slim_iters`` times, stopping early once Bm
    changes by less than ``slim_tol`` relative to its norm."""
    if s.relation_form == "oneshot":
        return oneshot_relation(p, s.lambda_r)
    phi = torch.eye(len(p), dtype=p.dtype, device=p.device)
    bm = slim_solve(p, phi, s.lambda_r, s.relation_form)
    for _ in range(s.slim_iters - 1):
        phi = inverse_sqrt_psd(bm @ bm.T, s.eig_floor)
        new = slim_solve(p, phi, s.lambda_r, s.relation_form)
        change = float(torch.linalg.matrix_norm(new - bm)) / max(float(torch.linalg.matrix_norm(bm)), 1e-12)
        bm = new
        if change < s.slim_tol:
            break
    return bm


def adjacency(z: Tensor, s: LRASettings) -> Tensor:
    """A = (|Bm| + |Bm|ᵀ) / 2 of the batch, in z's dtype; computed in float64."""
    p = pearson(z.double())
    bm = relation_matrix(p, s)
    return ((bm.abs() + bm.abs().T) / 2).to(z.dtype)


def neighbour_mask(a: Tensor, s: LRASettings) -> Tensor:
    """Boolean B x B mask of N_i per row: the top-k of A_ij over j != i, or every j != i with A_ij > 0."""
    n = len(a)
    off = ~torch.eye(n, dtype=torch.bool, device=a.device)
    if s.neighbourhood == "all":
        mask = (a > 0) & off
    else:
        k = min(s.topk, n - 1)
        scores = a.masked_fill(~off, -math.inf)
        mask = torch.zeros_like(off)
        mask.scatter_(1, scores.topk(k, dim=1).indices, True)
    if s.self_loop:
        mask = mask | ~off
    return mask


def masked_softmax(scores: Tensor, mask: Tensor) -> Tensor:
    """Softmax of each row over its masked-in entries; a row with none is all zeros (an empty sum in Eq. 5)."""
    has_any = mask.any(dim=1, keepdim=True)
    weights = torch.softmax(scores.masked_fill(~(mask | ~has_any), -math.inf), dim=1)
    return weights * has_any


# --------------------------------------------------------------------------------------------- module
class LRA(nn.Module):
    """The relational augmentation block: (B, d) -> (B, d). Parameters per step: W, W_m, W_n (d x d, no bias) for
    Eq. 5-6, or per GAT head W (d x d) and a (2d -> 1), no bias, Xavier-initialised as the official code."""

    def __init__(self, dim: int, settings: LRASettings) -> None:
        super().__init__()
        self.dim = dim
        self.settings = settings
        if settings.attention == "gat":
            self.gat = nn.ModuleList(
                nn.ModuleList(GATHead(dim) for _ in range(settings.gat_heads)) for _ in range(settings.steps)
            )
            return
        self.message = nn.ModuleList(nn.Linear(dim, dim, bias=False) for _ in range(settings.steps))  # W^l
        self.receive = nn.ModuleList(nn.Linear(dim, dim, bias=False) for _ in range(settings.steps))  # W_m^l
        self.send = nn.ModuleList(nn.Linear(dim, dim, bias=False) for _ in range(settings.steps))  # W_n^l

    def forward(self, z: Tensor) -> Tensor:
        if self.training:
            return self.augment(z)
        if not self.settings.at_eval:
            return z
        return torch.cat([self.augment(chunk) for chunk in z.split(self.settings.eval_batch)]) if len(z) else z

    def augment(self, z: Tensor) -> Tensor:
        """z~ of one batch (graph + L steps of message passing)."""
        if len(z) < self.settings.min_batch:
            return z
        with torch.no_grad():
            mask = neighbour_mask(adjacency(z, self.settings), self.settings)
        if self.settings.attention == "gat":
            return self.gat_steps(z, mask)
        h = z
        for w, w_m, w_n in zip(self.message, self.receive, self.send, strict=True):
            h = self.attention(h, w_m, w_n, mask) @ w(h)
        return h

    def attention(self, h: Tensor, w_m: nn.Linear, w_n: nn.Linear, mask: Tensor) -> Tensor:
        """alpha (B x B): Eq. 6's scores, softmax-normalised over each node's neighbourhood."""
        return masked_softmax(w_m(h) @ w_n(h).T / math.sqrt(self.dim), mask)

    def gat_steps(self, h: Tensor, mask: Tensor) -> Tensor:
        for heads in self.gat:
            h = torch.stack([head(h, mask) for head in heads]).mean(0)
            h = F.dropout(h, self.settings.gat_dropout, training=self.training)
        return h


class GATHead(nn.Module):
    """One head of the official GAT layer: ELU(softmax_{N_i}(LeakyReLU(aᵀ[W h_i ; W h_j])) W h)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w = nn.Linear(dim, dim, bias=False)
        self.a = nn.Linear(2 * dim, 1, bias=False)
        nn.init.xavier_uniform_(self.w.weight)
        nn.init.xavier_uniform_(self.a.weight)

    def forward(self, h: Tensor, mask: Tensor) -> Tensor:
        wh = self.w(h)
        return F.elu(self.attention(wh, mask) @ wh)

    def attention(self, wh: Tensor, mask: Tensor) -> Tensor:
        """alpha (B x B) over N_i from W h. aᵀ[Wh_i ; Wh_j] = a_selfᵀ Wh_i + a_otherᵀ Wh_j, a B x B sum instead of
        the official B x B x 2d concatenation."""
        a_self, a_other = self.a.weight[0].split(len(self.w.weight))
        scores = F.leaky_relu((wh @ a_self)[:, None] + (wh @ a_other)[None, :], GAT_SLOPE)
        return masked_softmax(scores, mask)


class LRAHead(nn.Module):
    """``predictor(lra(z))``: what replaces a FedModel's head, so ``FedModel.forward`` predicts from z~. With
    ``normalize`` (the official code's representation), z is L2-normalised before LRA and z~ after it.

    ``residual_mix`` m: the predictor reads m z + (1 - m) z~ instead of z~ (both as ``pair`` returns them, so unit
    vectors with ``normalize``; the mix itself is not normalised again). m = 0 is the paper (Eq. 5 has no self or
    residual term, z~ replaces z) and leaves the forward untouched; the official code's unused ``LocalGModel`` mixes
    with 0.9. The CD loss still compares z with z~ itself."""

    def __init__(self, lra: LRA, predictor: nn.Module, normalize: bool = False, residual_mix: float = 0.0) -> None:
        super().__init__()
        if not 0.0 <= residual_mix <= 1.0:
            raise ValueError(f"residual_mix must lie in [0, 1], got {residual_mix}")
        self.lra = lra
        self.predictor = predictor
        self.normalize = normalize
        self.residual_mix = residual_mix

    def pair(self, z: Tensor) -> tuple[Tensor, Tensor]:
        """(z, z~) as the predictor and the CD loss see them."""
        if self.normalize:
            z = F.normalize(z, dim=1)
        z_aug = self.lra(z)
        return z, F.normalize(z_aug, dim=1) if self.normalize else z_aug

    def mix(self, z: Tensor, z_aug: Tensor) -> Tensor:
        """What the predictor reads: z~, or m z + (1 - m) z~ with ``residual_mix`` m > 0."""
        m = self.residual_mix
        return z_aug if m == 0 else m * z + (1.0 - m) * z_aug

    def forward(self, z: Tensor) -> Tensor:
        return self.predictor(self.mix(*self.pair(z)))


class Normalized(nn.Module):
    """``head(z / |z|)``: a head that reads the L2-normalised representation (FedRANE-w/o-LRA, official form)."""

    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        self.head = head

    def forward(self, z: Tensor) -> Tensor:
        return self.head(F.normalize(z, dim=1))


def attach_lra(model: FedModel, settings: LRASettings, normalize: bool = False, residual_mix: float = 0.0) -> FedModel:
    """Put LRA between ``model``'s body and its head (which becomes the predictor), and record the model's fixed
    evaluation batch when LRA runs at evaluation (read by ``toolkit.evaluate.eval_batch_size``). ``residual_mix``:
    see ``LRAHead``."""
    model.head = LRAHead(LRA(model.embedding_dim, settings), model.head, normalize, residual_mix)
    model.transductive_batch = settings.eval_batch if settings.at_eval else None
    return model


def contrastive_discrimination(
    z: Tensor, z_aug: Tensor, temperature: float, similarity: Literal["pearson", "cosine"], symmetric: bool
) -> Tensor:
    """Eq. 7: with Zhat = [Z; Z~], anchor i's positive is B + i and its negatives the other 2B - 2 rows,
    -1/B sum_i log(exp(sim(i, B+i)/tau) / sum_{j != i} exp(sim(i, j)/tau)). ``similarity``: Pearson (paper) or
    cosine (official code). ``symmetric``: also anchor the B augmented rows and average over 2B (NT-Xent, the
    official code); the paper's Eq. 7 anchors the B original rows only."""
    b = len(z)
    both = torch.cat([z, z_aug])
    unit = centred_unit_rows(both) if similarity == "pearson" else F.normalize(both, dim=1)
    logits = (unit @ unit.T / temperature).masked_fill(torch.eye(2 * b, dtype=torch.bool, device=z.device), -math.inf)
    positives = torch.cat([torch.arange(b, 2 * b), torch.arange(b)]).to(z.device)
    anchors = 2 * b if symmetric else b
    return F.cross_entropy(logits[:anchors], positives[:anchors])

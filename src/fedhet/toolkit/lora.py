"""Federated aggregation of LoRA adapters on the flat parameter vector (``server.lora_aggregation``).

Each adapted layer computes ``W x + s B A x`` (``s = alpha / r``; ``models/adapt.py``). Client i replies its own
``A_i`` (r x in) and ``B_i`` (out x r); with weights ``w_i`` summing to 1 the rules are:

- ``fedit`` (FedIT, Zhang et al. 2024): ``A = sum w_i A_i``, ``B = sum w_i B_i``, i.e. the algorithm's own average of
  the flat vector, untouched. The product of the averages is not the average of the products.
- ``ffa`` (FFA-LoRA, Sun et al. 2024): every ``A_i`` is the same fixed matrix (frozen, so outside the flat vector),
  ``B = sum w_i B_i``, so ``B A = sum w_i B_i A`` exactly: again the plain average.
- ``flexlora`` (FlexLoRA, Bai et al. 2024): ``dW = sum w_i B_i A_i``, its SVD ``U S V^T`` truncated to rank r gives
  ``B = U_r S_r`` and ``A = V_r^T`` (the official code puts the singular values on B), the best rank-r approximation
  of the averaged update (Eckart-Young).
- ``flora`` (FLoRA, Wang et al. 2024; the math only, see ``flora_stack``): stacking ``[w_1 B_1 ... w_K B_K]`` and
  ``[A_1; ...; A_K]`` gives a rank ``sum r_i`` pair whose product is ``sum w_i B_i A_i`` exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

A_SUFFIX = ".lora_A.default.weight"
B_SUFFIX = ".lora_B.default.weight"


@dataclass(frozen=True)
class LoraPair:
    """One adapted layer's A and B in the flat vector: their spans and matrix shapes (r x in, out x r); ``a`` is None
    where A is frozen (FFA-LoRA)."""

    layer: str
    a: slice | None
    b: slice
    a_shape: tuple[int, int]
    b_shape: tuple[int, int]


def lora_pairs(slices: dict[str, slice], shapes: dict[str, torch.Size]) -> list[LoraPair]:
    """The adapted layers whose B trains, from ``FlatModel.slices()`` and every parameter's shape (``shapes`` by
    name, frozen ones too). A Conv2d's A (r, in, kh, kw) is read as r x (in kh kw) and its B (out, r, 1, 1) as
    out x r."""
    pairs = []
    for name, span in slices.items():
        if not name.endswith(B_SUFFIX):
            continue
        layer = name[: -len(B_SUFFIX)]
        a_name = layer + A_SUFFIX
        pairs.append(LoraPair(layer, slices.get(a_name), span, matrix(shapes[a_name]), matrix(shapes[name])))
    return pairs


def matrix(shape: torch.Size) -> tuple[int, int]:
    """A weight's shape as a matrix: (rows, the product of the other dimensions)."""
    rows = shape[0]
    return rows, int(torch.Size(shape[1:]).numel())


def fedit(a: list[torch.Tensor], b: list[torch.Tensor], w: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """FedIT: (sum w_i A_i, sum w_i B_i)."""
    return weighted(a, w), weighted(b, w)


def ffa(a: torch.Tensor, b: list[torch.Tensor], w: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """FFA-LoRA: A stays, B is averaged."""
    return a, weighted(b, w)


def flexlora(
    a: list[torch.Tensor], b: list[torch.Tensor], w: list[float], rank: int, ranks: list[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlexLoRA: the rank-``rank`` truncated SVD of sum w_i B_i A_i, split as (A, B) = (V_r^T, U_r S_r); with
    ``ranks``, client i's product uses only its first r_i slots (B_i[:, :r_i] A_i[:r_i]). Computed in float64,
    returned in the inputs' dtype."""
    ranks = ranks or [ai.shape[0] for ai in a]
    products = [bi[:, :r].double() @ ai[:r].double() for ai, bi, r in zip(a, b, ranks, strict=True)]
    u, s, vh = torch.linalg.svd(weighted(products, w), full_matrices=False)
    return vh[:rank].to(a[0].dtype), (u[:, :rank] * s[:rank]).to(b[0].dtype)


def slot_average(
    mats: list[torch.Tensor], w: list[float], ranks: list[int], dim: int, current: torch.Tensor
) -> torch.Tensor:
    """Heterogeneous FedIT (zero-padding without the zeros): slot k of the adapters (row k of A, ``dim`` 0; column k
    of B, ``dim`` 1) is the weighted average over the clients whose rank exceeds k, their weights renormalised; a
    slot no client of the round holds keeps ``current``'s value."""
    out = current.clone()
    for k in range(current.shape[dim]):
        held = [(m.select(dim, k), wi) for m, wi, r in zip(mats, w, ranks, strict=True) if r > k]
        total = sum(wi for _, wi in held)
        if held and total > 0:
            out.select(dim, k).copy_(weighted([m for m, _ in held], [wi / total for _, wi in held]))
    return out


def flora_stack(a: list[torch.Tensor], b: list[torch.Tensor], w: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """FLoRA's stacking: A = [A_1; ...; A_K] (sum r_i x in), B = [w_1 B_1, ..., w_K B_K] (out x sum r_i), so that
    B A = sum w_i B_i A_i whatever the ranks r_i."""
    return torch.cat(a, dim=0), torch.cat([wi * bi for wi, bi in zip(w, b, strict=True)], dim=1)


def weighted(tensors: list[torch.Tensor], w: list[float]) -> torch.Tensor:
    out = torch.zeros_like(tensors[0])
    for t, wi in zip(tensors, w, strict=True):
        out.add_(t, alpha=wi)
    return out


def slot_mask(pairs: list[LoraPair], numel: int, rank: int) -> torch.Tensor:
    """The entries of a flat vector (of ``numel`` entries) that a client of rank ``rank`` does not train: rows
    ``rank`` on of each A, columns ``rank`` on of each B."""
    mask = torch.zeros(numel, dtype=torch.bool)
    for pair in pairs:
        mask[pair.b] = (torch.arange(pair.b_shape[1]) >= rank).repeat(pair.b_shape[0])
        if pair.a is not None:
            mask[pair.a] = (torch.arange(pair.a_shape[0]) >= rank).repeat_interleave(pair.a_shape[1])
    return mask


def model_pairs(flat) -> list[LoraPair]:
    """``lora_pairs`` of a ``FlatModel``."""
    return lora_pairs(flat.slices(), {n: p.shape for n, p in flat.model.named_parameters()})


def masked_slots(flat, rank: int) -> int:
    """How many of ``flat``'s trainable entries a client of rank ``rank`` leaves untouched."""
    return int(slot_mask(model_pairs(flat), flat.num_params, rank).sum())


class LoraAggregator:
    """The server half of the LoRA rules that change the weighted average: ``flexlora``, and with heterogeneous ranks
    (``ranks``: client c has rank ``ranks[c]``) ``fedit`` and ``ffa`` too. In the target the algorithm's
    weighted average formed, each adapter pair is replaced by the rule's value; the rest of the model keeps it."""

    def __init__(self, rule: str, pairs: list[LoraPair], ranks: list[int] | None = None) -> None:
        self.rule, self.pairs, self.ranks = rule, pairs, ranks

    def rank_of(self, cid: int) -> int | None:
        return None if self.ranks is None else self.ranks[cid]

    def target(
        self,
        target: torch.Tensor,
        params: list[torch.Tensor],
        weights: list[float],
        cids: list[int],
        current: torch.Tensor,
    ) -> torch.Tensor:
        out = target.clone()
        for pair in self.pairs:
            full = pair.b_shape[1]
            ranks = [self.rank_of(c) or full for c in cids]
            b = [p[pair.b].view(pair.b_shape) for p in params]
            a = None if pair.a is None else [p[pair.a].view(pair.a_shape) for p in params]
            if self.rule == "flexlora":
                new_a, new_b = flexlora(a, b, weights, full, ranks)
            else:
                new_b = slot_average(b, weights, ranks, 1, current[pair.b].view(pair.b_shape))
                new_a = None if a is None else slot_average(a, weights, ranks, 0, current[pair.a].view(pair.a_shape))
            out[pair.b] = new_b.reshape(-1)
            if new_a is not None:
                out[pair.a] = new_a.reshape(-1)
        return out

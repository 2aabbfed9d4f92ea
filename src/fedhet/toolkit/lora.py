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
    """One adapted layer's A and B in the flat vector: their spans and their matrix shapes (r x in, out x r)."""

    layer: str
    a: slice
    b: slice
    a_shape: tuple[int, int]
    b_shape: tuple[int, int]


def lora_pairs(slices: dict[str, slice], shapes: dict[str, torch.Size]) -> list[LoraPair]:
    """The adapted layers whose A and B both train, from ``FlatModel.slices()`` and the parameters' shapes. A
    Conv2d's A (r, in, kh, kw) is read as r x (in kh kw) and its B (out, r, 1, 1) as out x r."""
    pairs = []
    for name, span in slices.items():
        if not name.endswith(A_SUFFIX):
            continue
        layer = name[: -len(A_SUFFIX)]
        b_name = layer + B_SUFFIX
        if b_name not in slices:
            continue
        a_shape, b_shape = shapes[name], shapes[b_name]
        pairs.append(LoraPair(layer, span, slices[b_name], matrix(a_shape), matrix(b_shape)))
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
    a: list[torch.Tensor], b: list[torch.Tensor], w: list[float], rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlexLoRA: the rank-``rank`` truncated SVD of sum w_i B_i A_i, split as (A, B) = (V_r^T, U_r S_r). Computed in
    float64, returned in the inputs' dtype."""
    delta = weighted([bi.double() @ ai.double() for ai, bi in zip(a, b, strict=True)], w)
    u, s, vh = torch.linalg.svd(delta, full_matrices=False)
    return vh[:rank].to(a[0].dtype), (u[:, :rank] * s[:rank]).to(b[0].dtype)


def flora_stack(a: list[torch.Tensor], b: list[torch.Tensor], w: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """FLoRA's stacking: A = [A_1; ...; A_K] (sum r_i x in), B = [w_1 B_1, ..., w_K B_K] (out x sum r_i), so that
    B A = sum w_i B_i A_i whatever the ranks r_i."""
    return torch.cat(a, dim=0), torch.cat([wi * bi for wi, bi in zip(w, b, strict=True)], dim=1)


def weighted(tensors: list[torch.Tensor], w: list[float]) -> torch.Tensor:
    out = torch.zeros_like(tensors[0])
    for t, wi in zip(tensors, w, strict=True):
        out.add_(t, alpha=wi)
    return out


class FlexLoraAggregator:
    """The server half of ``server.lora_aggregation = "flexlora"``: in the target the algorithm's weighted average
    formed, each adapter pair is replaced by the truncated SVD of the clients' averaged products."""

    def __init__(self, pairs: list[LoraPair]) -> None:
        self.pairs = pairs

    def target(self, target: torch.Tensor, params: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
        out = target.clone()
        for pair in self.pairs:
            a = [p[pair.a].view(pair.a_shape) for p in params]
            b = [p[pair.b].view(pair.b_shape) for p in params]
            new_a, new_b = flexlora(a, b, weights, pair.a_shape[0])
            out[pair.a] = new_a.reshape(-1)
            out[pair.b] = new_b.reshape(-1)
        return out

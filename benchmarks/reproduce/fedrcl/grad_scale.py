"""How large FedRCL's contrastive gradients are against cross-entropy's, per model, at the start of training.

    .venv/bin/python benchmarks/reproduce/fedrcl/grad_scale.py [--alpha 0.3] [--clients 10] [--models ...]

For each model it builds the run of fmnist.toml (FedRCL, official variant) with that model, takes the initial global
model (run seed 0) and one training batch (B = 60, no augmentation) from each of the first --clients clients, and
measures on it:

- the norms of the gradients of CE, of L_scl and of β·L_pen over all parameters, and the ratio of the contrastive
  gradient (scl + β pen) to CE's;
- per contrasted level, the mean cosine similarity between two samples of the batch and the share of anchors whose
  penalty fires (least similar same-class partner at cosine ≥ λ).

It prints the median over the batches (and their range) as a Markdown table; docs/reproductions/fedrcl.md quotes it.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

CONFIG = Path(__file__).resolve().parent / "fmnist.toml"
MODELS = {
    "lenet5": ["model.name='lenet5'"],
    "resnet18-gn-w8": ["model.name='resnet18'", "model.width=8"],
    "resnet18-gn-w16": ["model.name='resnet18'", "model.width=16"],
    "resnet18-gn-w64": ["model.name='resnet18'", "model.width=64"],
}


def grad_norm(loss: torch.Tensor, params: list[torch.Tensor]) -> float:
    grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
    return float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads if g is not None)))


def level_stats(feature: torch.Tensor, y: torch.Tensor, threshold: float) -> tuple[float, float]:
    """(mean off-diagonal cosine, share of anchors whose official penalty fires) for one level's batch features."""
    from fedhet.algorithms.fedrcl import pooled_unit

    z = pooled_unit(feature)
    s = z @ z.T
    eye = torch.eye(len(y), dtype=torch.bool)
    others = (y[:, None] == y[None, :]) & ~eye
    least = s.masked_fill(~others, float("inf")).amin(1)
    has_partner = others.any(1)
    fires = has_partner & (least >= threshold)
    return float(s[~eye].mean()), float(fires.sum() / has_partner.sum().clamp(min=1))


def measure(model_sets: list[str], alpha: float, clients: int) -> list[dict]:
    from fedhet.algorithms.fedrcl import rcl_loss, resolve_levels
    from fedhet.config import load_config
    from fedhet.engine.simulation import algorithm_config, build_federation, build_training

    sets = ["algorithm.name='fedrcl'", "algorithm.variant='official'", f"partition.alpha={alpha}", *model_sets]
    cfg = load_config(CONFIG, sets)
    fed = build_federation(cfg)
    model = build_training(cfg, fed).model.train()
    algo_cfg = algorithm_config(cfg)[1]
    levels = resolve_levels(model, algo_cfg.levels)
    params = [p for p in model.parameters() if p.requires_grad]
    generator = torch.Generator().manual_seed(0)
    rows = []
    for client in fed.clients[:clients]:
        batch = torch.randperm(len(client), generator=generator)[: cfg.train.batch_size]
        x, y = client.x[batch], client.y[batch]
        logits, features = model.forward_features(x)
        scl, pen = rcl_loss([features[name] for name in levels], y, algo_cfg)
        ce_norm = grad_norm(F.cross_entropy(logits, y), params)
        scl_norm = grad_norm(scl, params)
        pen_norm = grad_norm(algo_cfg.beta * pen, params)
        rcl_norm = grad_norm(scl + algo_cfg.beta * pen, params)
        stats = [level_stats(features[name].detach(), y, algo_cfg.threshold) for name in levels]
        rows.append(
            {
                "ce": ce_norm,
                "scl": scl_norm,
                "pen": pen_norm,
                "ratio": rcl_norm / ce_norm,
                "cos": [c for c, _ in stats],
                "fires": [f for _, f in stats],
                "levels": levels,
            }
        )
    return rows


def spread(values: list[float], fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--alpha", type=float, default=0.3)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"Initial global model, one batch of 60 from each of {args.clients} clients, alpha = {args.alpha}; ")
    print("median over the batches (min-max).\n")
    head = ["model", "‖∇CE‖", "‖∇L_scl‖", "‖∇β·L_pen‖", "‖∇(L_scl + β·L_pen)‖ / ‖∇CE‖", "mean cosine per level"]
    print("| " + " | ".join([*head, "penalty fires"]) + " |")
    print("|:---|---:|---:|---:|---:|:---|:---|")
    for name in args.models.split(","):
        rows = measure(MODELS[name], args.alpha, args.clients)
        levels = rows[0]["levels"]
        cos = ", ".join(f"{lv} {statistics.median(r['cos'][i] for r in rows):.2f}" for i, lv in enumerate(levels))
        fires = ", ".join(f"{100 * statistics.median(r['fires'][i] for r in rows):.0f}%" for i in range(len(levels)))
        cells = [spread([r[k] for r in rows], "{:.3g}") for k in ("ce", "scl", "pen")]
        cells.append(spread([r["ratio"] for r in rows], "{:.1f}"))
        print(f"| {name} | " + " | ".join(cells) + f" | {cos} | {fires} |")


if __name__ == "__main__":
    main()

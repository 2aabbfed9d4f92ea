"""Whom LRA lets a sample read: how many of its neighbours share its class, how much attention they get, and what
the same model scores when its neighbours are restricted to its own class. Evidence for
docs/reproductions/fedrane.md ("What LRA does to a sample's representation").

    python benchmarks/reproduce/fedrane/neighbour_purity.py RUN [RUN ...]

RUN is a FedRANE run folder with a checkpoint (e.g. the 20 % study protocol of lra_study.sh, ``rane-h0``). Its last
global model is evaluated as the engine evaluates it: the test set in its order, cut into LRA's fixed batches
(``algorithm.eval_batch_size``, 128), LRA in eval mode on each batch. Per batch, for every sample i and its
neighbourhood N_i (top-k of the SLIM adjacency, as the model uses it):

* ``same-class neighbours``: the share of N_i that holds i's class (mean over samples; ``chance`` is the share of
  the other samples of the batch that hold it);
* ``attention on them``: the attention weight alpha_ij summed over those neighbours (mean over samples; the weights
  of a row sum to 1);
* ``acc``: the model's test accuracy as evaluated; ``acc, own-class neighbours``: the same model when N_i is
  replaced by the top-k of the SLIM adjacency among the batch's samples of i's own class (a diagnostic that reads
  the test labels, so not a method: it says what the predictor could do if the graph found the right neighbours).
Single-step dot attention only (FedRANE's default); other settings are refused.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from fedhet.config import build_config
from fedhet.engine.checkpoint import load_latest
from fedhet.engine.simulation import build_federation, build_training
from fedhet.models import lra as lra_mod
from fedhet.toolkit.flat import FlatModel


def load(run: Path):
    cfg = build_config(json.loads((run / "config.json").read_text()))
    fed = build_federation(cfg)
    training = build_training(cfg, fed)
    loaded, _ = load_latest(run / "checkpoints")
    state = loaded.state["algo"]
    model = training.model
    flat = FlatModel(model)
    flat.set_params(state["global_params"])
    if state["global_buffers"] is not None and state["global_buffers"].numel():
        flat.set_buffers(state["global_buffers"])
    return cfg, fed, model.eval(), loaded.state["round"]


def own_class_mask(a: torch.Tensor, y: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k of A_ij over the j != i of i's class (fewer where the batch holds fewer)."""
    n = len(a)
    same = (y[:, None] == y[None, :]) & ~torch.eye(n, dtype=torch.bool)
    scores = a.masked_fill(~same, -math.inf)
    mask = torch.zeros_like(same)
    top = scores.topk(min(k, n - 1), dim=1)
    rows = torch.arange(n)[:, None].expand_as(top.indices)
    keep = torch.isfinite(top.values)
    mask[rows[keep], top.indices[keep]] = True
    return mask


@torch.no_grad()
def measure(run: Path) -> dict[str, float]:
    cfg, fed, model, rnd = load(run)
    head = model.head
    s = head.lra.settings
    if s.attention != "dot" or s.steps != 1 or s.neighbourhood != "topk" or head.normalize:
        raise SystemExit(f"{run}: only single-step dot attention over the top-k without normalize is measured")
    w, w_m, w_n = head.lra.message[0], head.lra.receive[0], head.lra.send[0]
    same_share = attn_same = chance = 0.0
    correct = correct_own = n_total = 0
    for start in range(0, len(fed.y_test), s.eval_batch):
        x, y = fed.x_test[start : start + s.eval_batch], fed.y_test[start : start + s.eval_batch]
        z = model.body(x)
        n = len(y)
        same = (y[:, None] == y[None, :]) & ~torch.eye(n, dtype=torch.bool)
        a = lra_mod.adjacency(z, s)
        results = []
        for mask in (lra_mod.neighbour_mask(a, s), own_class_mask(a, y, s.topk)):
            alpha = head.lra.attention(z, w_m, w_n, mask)
            results.append((mask, alpha, head.predictor(head.mix(z, alpha @ w(z)))))
        (mask, alpha, logits), (_, _, logits_own) = results
        same_share += float(((mask & same).sum(1) / mask.sum(1).clamp_min(1)).sum())
        attn_same += float((alpha * same).sum())
        chance += float((same.sum(1) / max(n - 1, 1)).sum())
        correct += int((logits.argmax(1) == y).sum())
        correct_own += int((logits_own.argmax(1) == y).sum())
        n_total += n
    return {
        "round": rnd,
        "same-class neighbours": same_share / n_total,
        "chance": chance / n_total,
        "attention on them": attn_same / n_total,
        "acc": correct / n_total,
        "acc, own-class neighbours": correct_own / n_total,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path, nargs="+")
    args = parser.parse_args()
    torch.set_num_threads(1)
    keys = ["same-class neighbours", "chance", "attention on them", "acc", "acc, own-class neighbours"]
    print("| run | round | " + " | ".join(keys) + " |")
    print("|---|---:|" + "---:|" * len(keys))
    for run in args.runs:
        m = measure(run)
        print(f"| {run} | {m['round']} | " + " | ".join(f"{100 * m[k]:.1f} %" for k in keys) + " |", flush=True)


if __name__ == "__main__":
    main()

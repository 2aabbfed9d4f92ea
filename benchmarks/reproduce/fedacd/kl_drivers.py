"""What drives FedACD's Table 9 KL(P || Q): the same local training from the same global model with one part of
FedACD's loss switched off at a time. Evidence for docs/reproductions/fedacd.md (Table 9 discussion).

    fedhet run -c benchmarks/reproduce/fedacd/fmnist.toml -a fedacd -s partition.alpha=0.1 --seed 0 -r 10 \
        -s run.eval_local_models=false -s run.client_dist_sampled=false --threads 1 -o runs/acd-kl --name fedacd
    python benchmarks/reproduce/fedacd/kl_drivers.py runs/acd-kl/fedacd

From the run's last checkpoint (the round-R global model), every client of the federation trains once more exactly as
the run's next round would (the engine's client runner, its seed for that round), under each variant:

* ``as run``: FedACD's loss, L1 + L2 on mixup batches (delta_missing = 1e-4);
* ``L1 off``: L2 alone (flatten_loss returns 0);
* ``mixup off``: ``algorithm.mixup = false``;
* ``delta_missing = 1``: the absent classes' columns of A get log 1 = 0 (no shift of their logits in L2);
* ``mixup off, delta_missing = 1``;
* ``plain CE``: FedAvg's local training (cross-entropy), same optimiser.

It prints the mean over clients of KL(P || Q) with FedACD's template (tau = 1 - 1e-5, mean over the present rows,
``toolkit.confusion.template_kl``, the quantity of Table 9 and of the run's ``local_kl``) on each client's clean local
training data, after ``--steps`` local steps (1: a single SGD step) and after the full local round (the run's 5
epochs). It first checks ``template_kl`` against a naive double loop on the first client's P.
"""

from __future__ import annotations

import argparse
import json
import math
from contextlib import contextmanager
from pathlib import Path

import torch

from fedhet.algorithms import fedacd
from fedhet.config import build_config
from fedhet.engine.checkpoint import load_latest
from fedhet.engine.simulation import build_federation, build_training
from fedhet.toolkit.confusion import PAPER_TAU, probability_matrix, soft_confusion, template_kl

VARIANTS = {  # name -> (algorithm, algorithm overrides, L1 on)
    "as run": ("fedacd", {}, True),
    "L1 off": ("fedacd", {}, False),
    "mixup off": ("fedacd", {"mixup": False}, True),
    "delta_missing = 1": ("fedacd", {"delta_missing": 1.0}, True),
    "mixup off, delta_missing = 1": ("fedacd", {"mixup": False, "delta_missing": 1.0}, True),
    "plain CE": ("fedavg", {}, True),
}


@contextmanager
def l1(on: bool):
    """FedACD's L1 (flatten_loss) as written, or returning 0 per sample."""
    original = fedacd.flatten_loss
    if not on:
        fedacd.flatten_loss = lambda logits, y, detach_target=False: logits.new_zeros(len(y))
    try:
        yield
    finally:
        fedacd.flatten_loss = original


def naive_template_kl(p: torch.Tensor, tau: float) -> float:
    """KL(P || Q) averaged over the defined rows, written as a double loop (0 log 0 = 0)."""
    c, rows = p.shape[0], []
    for i in range(c):
        if any(math.isnan(float(v)) for v in p[i]):
            continue
        total = 0.0
        for j in range(c):
            q = tau if i == j else (1 - tau) / (c - 1)
            pij = float(p[i, j])
            total += pij * math.log(pij / q) if pij > 0 else 0.0
        rows.append(total)
    return sum(rows) / len(rows)


def mean_kl(run: Path, algo: str, overrides: dict, l1_on: bool, steps: int | None) -> tuple[float, list[float]]:
    raw = json.loads((run / "config.json").read_text())
    raw["algorithm"] = {"name": algo, **({} if algo == "fedavg" else {**raw["algorithm"], **overrides})}
    raw["algorithm"]["name"] = algo
    if steps is not None:
        raw["train"]["local_steps"] = steps
    cfg = build_config(raw)
    fed = build_federation(cfg)
    training = build_training(cfg, fed)
    loaded, _ = load_latest(run / "checkpoints")
    state = loaded.state["algo"]
    training.algo.global_params = state["global_params"]
    training.algo.global_buffers = state["global_buffers"]
    rnd = loaded.state["round"] + 1
    kls = []
    with l1(l1_on):
        for cid in range(fed.num_clients):
            msg = training.algo.configure(rnd, [cid], "train")[cid]
            client = fed.clients[cid]
            training.runner.run(cid, rnd, 0, "train", msg, client, {})
            p = probability_matrix(*soft_confusion(training.model, client.x, client.y, fed.num_classes, 64))
            kls.append(template_kl(p, PAPER_TAU))
            if cid == 0 and algo == "fedacd" and not overrides and l1_on and steps is None:
                gap = abs(kls[0] - naive_template_kl(p.double(), PAPER_TAU))
                print(f"template_kl against a naive double loop (client 0, as run): |difference| = {gap:.1e}")
    return sum(kls) / len(kls), kls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a FedACD run folder with checkpoints")
    parser.add_argument("--steps", type=int, default=1, help="local steps of the short measurement (default 1)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rnd = json.loads((args.run / "summary.json").read_text()).get("rounds_done", "?")
    print(f"{args.run}: global model of round {rnd}; mean KL(P || Q) over every client's clean local data")
    print(f"| variant | after {args.steps} local step(s) | after the full local round |")
    print("|---|---|---|")
    for name, (algo, overrides, l1_on) in VARIANTS.items():
        short, _ = mean_kl(args.run, algo, overrides, l1_on, args.steps)
        full, _ = mean_kl(args.run, algo, overrides, l1_on, None)
        print(f"| {name} | {short:.2f} | {full:.2f} |", flush=True)


if __name__ == "__main__":
    main()

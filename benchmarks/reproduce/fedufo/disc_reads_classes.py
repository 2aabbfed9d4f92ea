"""Does FedUFO's client-ID discriminator D read the *classes* of a feature? Evidence for docs/reproductions/fedufo.md.

    python benchmarks/reproduce/fedufo/disc_reads_classes.py RUN_DIR [RUN_DIR ...]

For each run folder (a FedUFO or FedUAD run), loads the last checkpoint's global model and D, computes the global
model's features of every client's training data, and prints: D's top-1 accuracy at naming the sample's own client
(chance 1/K), the share of samples whose top-1 client holds the sample's class (chance: the mean share of clients
holding a class, printed beside it), and the mean entropy of D's prediction against log K. With pathological shards
a client's identity is nearly its pair of classes: a D that named the right classes would have learned class
content, and the UAD loss (make D uniform) would ask the features to hide it. A D that is confident (low entropy)
but names neither the client nor its classes pushes the features in a direction unrelated to the task.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from fedhet.config import build_config
from fedhet.engine.checkpoint import load_latest
from fedhet.engine.simulation import build_federation, build_training
from fedhet.toolkit.flat import FlatModel


def measure(run: Path) -> dict[str, float]:
    cfg = build_config(json.loads((run / "config.json").read_text()))
    fed = build_federation(cfg)
    training = build_training(cfg, fed)
    loaded, _ = load_latest(run / "checkpoints")
    training.algo.load_state_dict(loaded.state["algo"])
    model = training.model
    FlatModel(model).set_params(training.algo.global_params)
    model.eval()
    holds = torch.stack([torch.bincount(c.y, minlength=fed.num_classes) > 0 for c in fed.clients])  # (K, C)
    own = right_class = entropy = n = 0.0
    with torch.no_grad():
        for cid, client in enumerate(fed.clients):
            probs = F.softmax(model.discriminator(model.body(client.x)), dim=1)
            top = probs.argmax(1)
            own += float((top == cid).sum())
            right_class += float(holds[top, client.y].sum())
            entropy += float(-(probs * probs.clamp_min(1e-12).log()).sum())
            n += len(client.y)
    k = fed.num_clients
    return {
        "round": loaded.state["round"],
        "own client": own / n,
        "chance own": 1 / k,
        "top-1 holds the class": right_class / n,
        "chance class": float(holds.float().mean(0).mean()),
        "entropy / log K": entropy / n / math.log(k),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| run | round | D names the own client | chance | D's client holds the class | chance | entropy / log K |")
    print("|---|---|---|---|---|---|---|")
    for run in args.runs:
        m = measure(run)
        print(
            f"| {run} | {m['round']} | {m['own client']:.3f} | {m['chance own']:.3f} | "
            f"{m['top-1 holds the class']:.3f} | {m['chance class']:.3f} | {m['entropy / log K']:.3f} |"
        )


if __name__ == "__main__":
    main()

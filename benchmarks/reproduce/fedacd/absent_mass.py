"""Where local models put their probability on their own clean training data: the client's classes or the ones it
lacks. Evidence for docs/reproductions/fedacd.md (Table 9 discussion).

    python benchmarks/reproduce/fedacd/absent_mass.py fedacd fedavg [--runs runs/reproduce/fedacd-fmnist/alpha0.1]

For each named method's seed-0 run, loads the last checkpoint's global model, trains clients 0, 4, 8, 12 and 16 for
one more round exactly as the run would (the engine's client runner), and prints per client: classes held, mean
P_ii over them, mean probability mass on absent classes, and KL(P || Q) with FedACD's template (tau = 1 - 1e-5).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from fedhet.config import build_config
from fedhet.engine.checkpoint import load_latest
from fedhet.engine.simulation import build_federation, build_training
from fedhet.toolkit.confusion import PAPER_TAU, probability_matrix, soft_confusion, template_kl


def client_rows(algo: str, runs: Path) -> list[tuple[int, float, float, float]]:
    run = runs / f"{algo}-s0"
    cfg = build_config(json.loads((run / "config.json").read_text()))
    fed = build_federation(cfg)
    training = build_training(cfg, fed)
    loaded, _ = load_latest(run / "checkpoints")
    training.algo.load_state_dict(loaded.state["algo"])
    rnd = loaded.state["round"] + 1
    rows = []
    for cid in range(0, fed.num_clients, 4):
        msg = training.algo.configure(rnd, [cid], "train")[cid]
        client = fed.clients[cid]
        training.runner.run(cid, rnd, 0, "train", msg, client, {})
        sums, counts = soft_confusion(training.model, client.x, client.y, fed.num_classes, 256)
        p, held = probability_matrix(sums, counts), counts > 0
        diag = p.diagonal()[held].mean()
        absent = p[held][:, ~held].sum(dim=1).mean() if (~held).any() else torch.tensor(0.0)
        rows.append((int(held.sum()), float(diag), float(absent), template_kl(p, PAPER_TAU)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("methods", nargs="+")
    parser.add_argument("--runs", type=Path, default=Path("runs/reproduce/fedacd-fmnist/alpha0.1"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| method | client | classes held | mean P_ii | mass on absent classes | KL(P‖Q) |")
    print("|---|---|---|---|---|---|")
    for algo in args.methods:
        for i, (held, diag, absent, kl) in enumerate(client_rows(algo, args.runs)):
            print(f"| {algo} | {4 * i} | {held} | {diag:.3f} | {absent:.3f} | {kl:.3f} |")


if __name__ == "__main__":
    main()

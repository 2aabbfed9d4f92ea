"""What local training does to the features and logits, global model against the clients' local models: the
mechanism behind FedUFO's readings of its discriminator (docs/reproductions/fedufo.md, "Discriminator readings").

    python benchmarks/reproduce/fedufo/feature_norms.py RUN [RUN ...] [--clients 10]

RUN is a run folder with a checkpoint (FedUFO in any disc_mode, or FedAvg). From its last global model (round R)
the script trains ``--clients`` clients (ids 0, 10, 20, ... for 100 clients) through round R + 1 exactly as the run
would (every phase, the engine's client runner and seeds; for FedUFO the group is those clients) and prints, on the
whole test set:

* ``|f|``: the mean L2 norm of the embedding f = h_e(x) (the 200-d feature D reads), for the global model and the
  mean over the local (posterior) models;
* ``logit std``: the standard deviation of a sample's logits over the classes, averaged over the test set (how
  confident the head is before the softmax);
* ``acc``: test accuracy, global and mean local;
* ``uad``: the UAD loss (Eq. 4) of the global model's features under the model's own D, whose minimum is log K,
  and ``D entropy / log K`` (1 = D cannot tell clients apart), where the model has a D.
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


@torch.no_grad()
def stats(model, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    model.eval()
    f = torch.cat([model.body(part) for part in x.split(1024)])
    logits = model.head(f)
    out = {
        "|f|": float(f.norm(dim=1).mean()),
        "logit std": float(logits.std(dim=1).mean()),
        "acc": float((logits.argmax(1) == y).float().mean()),
    }
    disc = getattr(model, "discriminator", None)
    if disc is not None:
        logp = F.log_softmax(disc(f), dim=1)
        k = logp.shape[1]
        out["uad"] = float(-logp.mean(1).mean())
        out["D entropy / log K"] = float(-(logp.exp() * logp).sum(1).mean() / math.log(k))
    return out


def measure(run: Path, n_clients: int) -> tuple[int, dict[str, float], dict[str, float]]:
    cfg = build_config(json.loads((run / "config.json").read_text()))
    fed = build_federation(cfg)
    training = build_training(cfg, fed)
    loaded, _ = load_latest(run / "checkpoints")
    algo = training.algo
    algo.load_state_dict(loaded.state["algo"])
    rnd = loaded.state["round"] + 1
    step = max(fed.num_clients // n_clients, 1)
    cids = list(range(0, fed.num_clients, step))[:n_clients]
    replies = {}
    for phase_idx, phase in enumerate(algo.phases):
        msgs = algo.configure(rnd, cids, phase)
        replies = {c: training.runner.run(c, rnd, phase_idx, phase, msgs[c], fed.clients[c], {})[0] for c in msgs}
        if phase_idx < len(algo.phases) - 1:
            algo.aggregate(rnd, replies, phase)
    model = training.model
    flat = FlatModel(model)
    flat.set_params(algo.global_params)
    global_stats = stats(model, fed.x_test, fed.y_test)
    local = [stats_of(flat, model, r.tensors["params"], fed) for r in replies.values()]
    local_mean = {k: sum(s[k] for s in local) / len(local) for k in local[0]}
    return rnd - 1, global_stats, local_mean


def stats_of(flat: FlatModel, model, params: torch.Tensor, fed) -> dict[str, float]:
    flat.set_params(params)
    return stats(model, fed.x_test, fed.y_test)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path, nargs="+")
    parser.add_argument("--clients", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(
        "| run | round | |f| global | |f| local | logit std global | logit std local | acc global | acc local "
        "| uad global (log K = 4.61) | D entropy / log K |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for run in args.runs:
        rnd, g, loc = measure(run, args.clients)
        uad = f"{g['uad']:.3f}" if "uad" in g else "—"
        ent = f"{g['D entropy / log K']:.3f}" if "uad" in g else "—"
        print(
            f"| {run} | {rnd} | {g['|f|']:.2f} | {loc['|f|']:.2f} | {g['logit std']:.2f} | {loc['logit std']:.2f} "
            f"| {100 * g['acc']:.1f} | {100 * loc['acc']:.1f} | {uad} | {ent} |",
            flush=True,
        )


if __name__ == "__main__":
    main()

"""Why FedBABU's personalised accuracy fell as training went on: feature scale and fine-tuning at two lrs.

    .venv/bin/python benchmarks/reproduce/fedrane/babu_finetune.py RUN_DIR [--clients 0,5] [--lrs 0.01,0.001]

RUN_DIR is a FedBABU run folder with a checkpoint (e.g. ``fedhet run -c benchmarks/reproduce/fedrane/fmnist.toml -a
fedbabu -r 3 -s dataset.train_fraction=0.2 -o /tmp/babu --name a05``). For each client and lr this prints the global
model's mean feature norm and head norm, then fine-tunes the whole model as FedBABU's personalisation does (SGD with
the run's momentum and batch size, 5 epochs on the client's training data) and prints the training loss and local
test accuracy after every epoch. docs/reproductions/fedrane.md quotes its output.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from fedhet.config import build_config
from fedhet.engine.checkpoint import read_checkpoint
from fedhet.engine.simulation import Simulation
from fedhet.toolkit.flat import FlatModel


def finetune(sim: Simulation, params: torch.Tensor, cid: int, lr: float, epochs: int = 5) -> None:
    client, train = sim.fed.clients[cid], sim.cfg.train
    torch.manual_seed(0)
    model = sim.algo.setup.build_model()
    FlatModel(model).params.copy_(params)
    with torch.no_grad():
        scale = model.body(client.x[:512]).norm(dim=1).mean()
    print(f"client {cid}, lr {lr}: mean |feature| {scale:.1f}, |head| {model.head.weight.norm():.2f}")
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=train.momentum)
    for epoch in range(epochs):
        for batch in torch.randperm(len(client.x)).split(train.batch_size):
            opt.zero_grad()
            F.cross_entropy(model(client.x[batch]), client.y[batch]).backward()
            opt.step()
        with torch.no_grad():
            loss = F.cross_entropy(model(client.x), client.y)
            acc = (model(client.x_test).argmax(1) == client.y_test).float().mean()
        print(f"  epoch {epoch + 1}: train loss {loss:.3f}, local test acc {100 * acc:.1f} %")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("--clients", default="0,5")
    parser.add_argument("--lrs", default="0.01,0.001")
    args = parser.parse_args()
    sim = Simulation(build_config(json.loads((args.run / "config.json").read_text())))
    params = read_checkpoint(args.run / "checkpoints" / "last.pt")["algo"]["global_params"]
    for cid in map(int, args.clients.split(",")):
        for lr in map(float, args.lrs.split(",")):
            finetune(sim, params, cid, lr)


if __name__ == "__main__":
    main()

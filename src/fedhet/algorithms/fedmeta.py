"""FedMeta as FedUFO runs it (Yao, Huang, Zhang, Li and Sun, NeurIPS 2019 workshop, "Federated Learning with
Unbiased Gradient Aggregation and Controllable Meta Updating"; FedUFO's baseline [31]). A DATA-SHARING method.

**Every client shares a copy of ``meta_fraction`` (FedUFO: 10%) of its training data with the server.** Clients
train as in FedAvg; after each aggregation the server fine-tunes the averaged model on the shared "meta" data with
the same local loop (``algorithms.loop.train_locally``: mini-batch SGD with momentum and weight decay, no loop of its
own), and the fine-tuned model is the new global model:

    w_avg = sum_k n_k / n  w_k          (FedAvg, through the server optimiser)
    w_{t+1} = SGD_{meta_epochs}(w_avg; meta data)

FedUFO (Sec. 4.1.1): "for FedMeta, 10% data of every client are used to construct the meta data that finetune the
aggregated global model in each iteration", and "we use the SGD optimizer in both client and server, with 0.01 as
learning rate, 0.9 as momentum and 0.0002 as weight decay" (notes/fedufo.md reading 14: the server SGD is this
fine-tuning). So the fine-tuning's optimiser defaults to the run's ``train`` settings, ``train.optimizer``
included (with Adam or AdamW the ``meta_*`` settings other than ``meta_momentum`` apply; its state starts anew at
every fine-tuning, whatever ``train.optimizer_state`` says, since the server is no client).

Choices where FedUFO is silent (each a Config field): one epoch over the meta data per round (``meta_epochs``); the
meta data are a random ``meta_fraction`` of each client's training samples (at least one), drawn once from the run
seed; clients keep training on all their data (sharing copies it, it does not take it away); no augmentation on the
server. Not implemented: Yao et al.'s unbiased gradient aggregation (keep-trace gradients) and their meta-gradient
form of the controllable update; FedUFO describes its FedMeta baseline as the fine-tuning above, which is what is
compared. The shared data exist only where the server holds the federation (the simulation, or Flower with the
partitions rebuilt from the config); a server without client data refuses to run it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch
from pydantic import Field

from fedhet.algorithms.base import ALGORITHMS, ClientContext, Message, Reply, Setup
from fedhet.algorithms.fedavg import FedAvg, FedAvgConfig
from fedhet.data.types import ClientData
from fedhet.toolkit.flat import FlatModel

if TYPE_CHECKING:
    from fedhet.algorithms.server_opt import ServerOptimizer
    from fedhet.config import TrainSection
    from fedhet.data.federated import FederatedDataset


class FedMetaConfig(FedAvgConfig):
    meta_fraction: float = Field(0.1, gt=0.0, le=1.0)  # FedUFO Sec. 4.1.1: 10% of every client's data
    meta_epochs: float = Field(1.0, gt=0.0)  # not given by FedUFO; one pass per round (our choice)
    # None: the run's train.lr / momentum / weight_decay / batch_size (FedUFO: the same SGD on client and server)
    meta_lr: float | None = Field(None, gt=0.0)
    tunable: ClassVar[dict[str, str]] = {"meta_lr": "log:1e-3:3e-1"}  # sensible default, as train.lr's range
    meta_momentum: float | None = Field(None, ge=0.0, lt=1.0)
    meta_weight_decay: float | None = Field(None, ge=0.0)
    meta_batch_size: int | None = Field(None, ge=1)


def shared_indices(sizes: list[int], fraction: float, rng: np.random.Generator) -> list[np.ndarray]:
    """Per client, a random ``fraction`` of its sample indices (rounded, at least one where it has any)."""
    return [
        np.sort(rng.choice(n, size=max(1, round(fraction * n)), replace=False)) if n else np.zeros(0, int)
        for n in sizes
    ]


@ALGORITHMS.register(
    "fedmeta",
    "FedMeta (Yao et al. 2019), DATA-SHARING: server fine-tunes the average on a shared 10% of every client's data",
    FedMetaConfig,
)
class FedMeta(FedAvg):
    name = "fedmeta"
    Config = FedMetaConfig
    batchable = True  # the clients are FedAvg's; the fine-tuning runs on the server
    shares_data = True

    @classmethod
    def optimizer_refusal(cls, config: FedMetaConfig, train: TrainSection) -> str | None:  # type: ignore[override]
        if train.optimizer != "sgd" and config.meta_momentum:
            return (
                f"fedmeta's server fine-tunes with the clients' optimiser, and algorithm.meta_momentum="
                f"{config.meta_momentum} is sgd's momentum; unset it or use train.optimizer='sgd'"
            )
        return super().optimizer_refusal(config, train)

    def __init__(self, config: FedMetaConfig, setup: Setup, server_opt: ServerOptimizer | None = None) -> None:
        super().__init__(config, setup, server_opt)
        self.meta: ClientData | None = None
        self.seed = 0
        self._server_model: tuple[torch.nn.Module, FlatModel] | None = None
        self._meta_loss = float("nan")

    def receive_shared_data(self, fed: FederatedDataset, seed: int) -> None:
        """The copies every client shares with the server (the engine calls this once, before round 1)."""
        from fedhet.toolkit.local import derive_seed

        sizes = [len(c.y) for c in fed.clients]
        if sum(sizes) == 0:
            raise ValueError("fedmeta needs the clients' shared data on the server, and this server holds none")
        picks = shared_indices(sizes, self.config.meta_fraction, np.random.default_rng(derive_seed(seed, 0x3E7A)))
        parts = [
            (c.x[torch.from_numpy(ix)], c.y[torch.from_numpy(ix)]) for c, ix in zip(fed.clients, picks, strict=True)
        ]
        self.meta = ClientData(
            x=torch.cat([x for x, _ in parts]), y=torch.cat([y for _, y in parts]), num_classes=fed.num_classes
        )
        self.seed = seed

    # ------------------------------------------------------------------------------------------------ server side
    def aggregate(self, rnd: int, replies: dict[int, Reply], phase: str) -> dict[str, float]:
        out = super().aggregate(rnd, replies, phase)
        self.fine_tune(rnd)
        return out

    def fine_tune(self, rnd: int) -> None:
        """The averaged model, trained on the meta data by the shared local loop; it becomes the global model."""
        from fedhet.algorithms.loop import train_locally
        from fedhet.toolkit.local import derive_seed

        if self.meta is None:
            raise RuntimeError("fedmeta: the server has no shared data (receive_shared_data was not called)")
        model, flat = self.server_model()
        c, t = self.config, self.setup.train
        train = t.model_copy(
            update={
                "local_epochs": c.meta_epochs,
                "local_steps": None,
                "batch_size": c.meta_batch_size or t.batch_size,
                "momentum": t.momentum if c.meta_momentum is None else c.meta_momentum,
                "weight_decay": t.weight_decay if c.meta_weight_decay is None else c.meta_weight_decay,
                "nesterov": t.nesterov and (c.meta_momentum is None or c.meta_momentum > 0),
            }
        )
        tensors = {"params": self.global_params}
        if self.global_buffers is not None and self.global_buffers.numel():
            tensors["buffers"] = self.global_buffers
        msg = Message(tensors=tensors, scalars={"lr": c.meta_lr or self.round_lr(rnd)})
        seed = derive_seed(self.seed, rnd, 0xFEED)
        ctx = ClientContext(
            -1, rnd, "meta", msg, self.meta, {}, model, flat, train, torch.Generator().manual_seed(seed)
        )
        with torch.random.fork_rng(devices=[]):  # dropout on the server draws from its own seeded stream
            torch.manual_seed(seed)
            reply = train_locally(self, ctx)
        self.global_params = reply.tensors["params"]
        if "buffers" in reply.tensors:
            self.global_buffers = reply.tensors["buffers"]
        self._meta_loss = reply.metrics["train_loss"]

    def server_model(self) -> tuple[torch.nn.Module, FlatModel]:
        if self._server_model is None:
            model = self.setup.build_model()
            self._server_model = (model, FlatModel(model))
        return self._server_model

    def round_metrics(self, rnd: int) -> dict[str, float]:
        return {"meta_loss": self._meta_loss, "meta_samples": float(len(self.meta.y)) if self.meta else 0.0}

"""How alike LRA makes the samples of a batch: the mean pairwise cosine of z~'s rows, at initialisation, for Eq. 6's
dot attention and the official code's GAT, over the full neighbourhood (the official mask) and the top-10.

    .venv/bin/python benchmarks/reproduce/fedrane/attention_spread.py

One Fashion-MNIST training batch of 128 (drawn with seed 0), the official CNNModel (1568-d z, L2-normalised as the
official code does) and the one-shot EASE graph, for three initialisation seeds. A mean cosine of 1.000 means every
sample's z~ is the same vector, so a predictor reading z~ cannot tell the samples apart
(docs/reproductions/fedrane.md, "The released code as a whole").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fedhet.data.datasets import load_dataset
from fedhet.data.federated import normalise
from fedhet.models import build_model
from fedhet.models.lra import LRA, LRASettings

BATCH = 128
SETTINGS = [(att, nb) for att in ("dot", "gat") for nb in ("all", "topk")]


def mean_cosine(v: torch.Tensor) -> float:
    """Mean cosine over the pairs of distinct rows."""
    u = F.normalize(v, dim=1)
    n = len(u)
    return float(((u @ u.T).sum() - n) / (n * n - n))


def batch() -> torch.Tensor:
    ds = load_dataset("fmnist")
    idx = torch.randperm(len(ds.y_train), generator=torch.Generator().manual_seed(0))[:BATCH]
    return torch.as_tensor(normalise(ds.x_train[idx.numpy()], ds))  # as the engine feeds the model


def main() -> None:
    torch.set_num_threads(1)
    x = batch()
    print("| init seed | z | " + " | ".join(f"{att}, {nb}" for att, nb in SETTINGS) + " |")
    print("|---:|---:|" + "---:|" * len(SETTINGS))
    for seed in range(3):
        torch.manual_seed(seed)
        model = build_model("convnet", tuple(x.shape[1:]), 10, channels=[16, 32], hidden=0)
        with torch.no_grad():
            z = F.normalize(model.body(x), dim=1)
            cells = [mean_cosine(z)]
            for att, nb in SETTINGS:
                torch.manual_seed(seed)
                lra = LRA(z.shape[1], LRASettings(relation_form="oneshot", neighbourhood=nb, attention=att)).eval()
                cells.append(mean_cosine(lra(z)))
        print(f"| {seed} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")


if __name__ == "__main__":
    main()

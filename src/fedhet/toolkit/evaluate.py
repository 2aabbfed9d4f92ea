"""Evaluation protocols: global accuracy, accuracy on each client's distribution, fairness across clients."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:  # a runtime import would be circular: algorithms -> evaluate -> data.federated -> algorithms
    from fedhet.data.federated import FederatedDataset


@dataclass
class EvalStats:
    loss_sum: float
    correct: np.ndarray  # per class
    count: np.ndarray  # per class
    hits: np.ndarray | None = None  # per sample: predicted right

    @property
    def n(self) -> int:
        return int(self.count.sum())

    @property
    def acc(self) -> float:
        return float(self.correct.sum() / max(self.n, 1))

    @property
    def loss(self) -> float:
        return self.loss_sum / max(self.n, 1)

    def per_class_acc(self) -> np.ndarray:
        """Accuracy per class; NaN for classes absent from the test data."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.count > 0, self.correct / self.count, np.nan)


def eval_batch_size(model: nn.Module, requested: int) -> int:
    """The batch size to evaluate ``model`` with: ``requested`` (``run.eval_batch_size``), unless the model's
    predictions depend on the other samples of a batch (FedRANE's LRA at evaluation), in which case it fixes its
    own (``model.transductive_batch``) so its accuracy does not depend on how the caller cuts the data."""
    fixed = getattr(model, "transductive_batch", None)
    return fixed if fixed is not None else requested


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, num_classes: int, batch_size: int) -> EvalStats:
    batch_size = eval_batch_size(model, batch_size)
    was_training = model.training
    model.eval()
    losses, hits = [], []  # kept on the device and read once at the end: a GPU never waits between batches
    for start in range(0, len(y), batch_size):
        xb, yb = x[start : start + batch_size], y[start : start + batch_size]
        logits = model(xb)
        losses.append(F.cross_entropy(logits, yb, reduction="sum").float())
        hits.append(logits.argmax(1) == yb)
    model.train(was_training)
    loss_sum = 0.0
    for value in torch.stack(losses).tolist() if losses else []:  # the float sum of one float() per batch
        loss_sum += value
    hit = torch.cat(hits).cpu() if hits else torch.zeros(0, dtype=torch.bool)
    correct = torch.zeros(num_classes, dtype=torch.float64).index_add_(0, y.cpu(), hit.to(torch.float64))
    count = torch.bincount(y.cpu(), minlength=num_classes).numpy().astype(np.float64)
    return EvalStats(loss_sum, correct.numpy(), count, hit.numpy())


@torch.no_grad()
def local_test_acc(model: nn.Module, clients: list, batch_size: int, on_train: bool = False) -> np.ndarray:
    """Each client's accuracy on its local test split, or with ``on_train`` on its training data (NaN where empty)."""
    data = [(c.x, c.y) if on_train else (c.x_test, c.y_test) for c in clients]
    hits, _, counts = per_client_scores(model, data, batch_size)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, hits / counts, np.nan)


@torch.no_grad()
def per_client_scores(
    model: nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]], batch_size: int, with_loss: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per client (one ``(x, y)`` pair each): the samples predicted right, the summed cross-entropy (with
    ``with_loss``, else zeros) and the number of samples.

    The clients' data are evaluated in full batches drawn across clients, so 10,000 clients of a few samples cost what
    their union costs, not 10,000 forward passes (the model is in eval mode: a sample's prediction does not depend on
    the others in its batch). A model whose prediction does depend on them (``transductive_batch``) is evaluated on
    each client's data alone, in batches of its own size, so no client's score depends on another client's data."""
    counts = np.array([len(y) for _, y in data], dtype=np.float64)
    hits, losses = np.zeros(len(data)), np.zeros(len(data))
    if getattr(model, "transductive_batch", None) is not None:
        for i, (x, y) in enumerate(data):
            if len(y):
                stats = evaluate(model, x, y, int(y.max()) + 1, batch_size)
                hits[i], losses[i] = stats.correct.sum(), stats.loss_sum
        return hits, losses, counts
    was_training = model.training
    model.eval()
    xs, ys, owners = [], [], []

    def flush() -> None:
        if ys:
            y = torch.cat(ys)
            logits = model(torch.cat(xs))
            who = np.concatenate(owners)
            np.add.at(hits, who, (logits.argmax(1) == y).cpu().numpy())
            if with_loss:
                np.add.at(losses, who, F.cross_entropy(logits, y, reduction="none").float().cpu().numpy())
            xs.clear(), ys.clear(), owners.clear()

    pending = 0
    for i, (x_c, y_c) in enumerate(data):
        for start in range(0, len(y_c), batch_size):
            y = y_c[start : start + batch_size]
            xs.append(x_c[start : start + batch_size])
            ys.append(y)
            owners.append(np.full(len(y), i))
            pending += len(y)
            if pending >= batch_size:
                flush()
                pending = 0
    flush()
    model.train(was_training)
    return hits, losses, counts


def validation_metrics(model: nn.Module, fed: FederatedDataset, batch_size: int) -> dict[str, float]:
    """The global model on the clients' validation data (partition.validation_fraction), the federated way: each
    client scores it on its own validation samples and the scores are aggregated by size (``val_acc``, ``val_loss``:
    the accuracy and mean loss over all validation samples), with the spread across clients as the fairness metrics
    give it for test data (``val_client_acc_mean`` ... ``val_acc_largest_client``; clients without validation
    samples left out). Nothing without validation data. Never reads a test set."""
    if not fed.has_validation:
        return {}
    data = [(c.x_val, c.y_val) for c in fed.clients]
    hits, losses, counts = per_client_scores(model, data, batch_size, with_loss=True)
    total = max(counts.sum(), 1)
    out = {"val_acc": float(hits.sum() / total), "val_loss": float(losses.sum() / total)}
    mine = counts > 0
    if mine.any():
        spread = fairness(hits[mine] / counts[mine], fed.sizes[mine])
        out.update({f"val_{key}": value for key, value in spread.items()})
    return out


def client_distribution_acc(per_class_acc: np.ndarray, label_dist: np.ndarray) -> np.ndarray:
    """acc_m = sum_c pi_c^m acc_c for every client m (FedACD Table 2 protocol, notes/fedacd.md 4.5).

    This is the expected accuracy on a test set drawn with client m's training label proportions. Classes absent
    from the test set are left out and the client's proportions renormalised over the rest.
    """
    known = ~np.isnan(per_class_acc)
    pi = label_dist[:, known]
    pi = pi / np.maximum(pi.sum(axis=1, keepdims=True), 1e-12)
    return pi @ per_class_acc[known]


def client_test_samples(
    y_test: np.ndarray, label_dist: np.ndarray, sizes: np.ndarray, rng: np.random.Generator
) -> list[np.ndarray]:
    """Per client, indices into the test set forming a test sample with the client's label proportions.

    Client m's ``sizes[m]`` class labels are drawn from pi^m restricted to the classes the test set has; each class's
    share is then taken from that class's test samples without replacement, or with replacement where it asks for
    more than the test set holds (a large client of one class)."""
    by_class = [np.flatnonzero(y_test == c) for c in range(label_dist.shape[1])]
    known = np.array([len(ix) > 0 for ix in by_class])
    samples = []
    for pi, n in zip(label_dist, sizes, strict=True):
        p = np.where(known, pi, 0.0)
        if p.sum() <= 0 or n <= 0:
            samples.append(np.zeros(0, dtype=np.int64))
            continue
        per_class = rng.multinomial(int(n), p / p.sum())
        parts = [rng.choice(by_class[c], size=k, replace=k > len(by_class[c])) for c, k in enumerate(per_class) if k]
        samples.append(np.sort(np.concatenate(parts)))
    return samples


def sampled_distribution_acc(hits: np.ndarray, samples: list[np.ndarray]) -> float:
    """Mean over clients (each counted once, as in FedACD's Eq. 2) of the accuracy on their own test sample."""
    accs = [hits[ix].mean() for ix in samples if len(ix)]
    return float(np.mean(accs)) if accs else math.nan


def local_risk(per_class_acc: np.ndarray, label_dist: np.ndarray) -> float:
    """FedACD's Eq. 3: a model's error averaged over every client's label distribution, clients weighted equally,
    eps . mean_m(pi^m) (Table 3). Classes absent from the test set are left out and the weights renormalised."""
    known = ~np.isnan(per_class_acc)
    pibar = label_dist.mean(axis=0)[known]
    return float((1.0 - per_class_acc[known]) @ pibar / max(pibar.sum(), 1e-12))


def fairness(acc: np.ndarray, sizes: np.ndarray) -> dict[str, float]:
    """Spread of per-client accuracies: mean, std, min, max, mean of the worst 10%, smallest/largest client."""
    k = max(1, math.ceil(0.1 * len(acc)))
    return {
        "client_acc_mean": float(acc.mean()),
        "client_acc_std": float(acc.std()),
        "client_acc_min": float(acc.min()),
        "client_acc_max": float(acc.max()),
        "client_acc_worst10": float(np.sort(acc)[:k].mean()),
        "acc_smallest_client": float(acc[int(np.argmin(sizes))]),
        "acc_largest_client": float(acc[int(np.argmax(sizes))]),
    }


def evaluate_global(
    model: nn.Module, fed: FederatedDataset, batch_size: int, samples: list[np.ndarray] | None = None
) -> dict[str, float]:
    """All global-model metrics of one evaluation round; ``samples`` are the clients' sampled test sets, if any."""
    stats = evaluate(model, fed.x_test, fed.y_test, fed.num_classes, batch_size)
    per_class = stats.per_class_acc()
    dist_acc = client_distribution_acc(per_class, fed.label_distribution())
    out = {"test_acc": stats.acc, "test_loss": stats.loss, "client_dist_acc": float(dist_acc.mean())}
    if samples is not None:
        out["client_dist_acc_sampled"] = sampled_distribution_acc(stats.hits, samples)
    out.update(domain_acc(stats.hits, fed))
    out.update(fairness(client_accuracy(model, fed, batch_size, dist_acc=dist_acc), fed.sizes))
    return out


def domain_acc(hits: np.ndarray, fed: FederatedDataset) -> dict[str, float]:
    """Under a feature skew with domains, the accuracy on each domain's test samples (``test_acc/domain/<name>``)
    and on the worst of them (``test_acc/domain/worst``); nothing otherwise. A domain without test samples is left
    out."""
    if fed.test_domains is None:
        return {}
    which = fed.test_domains.numpy()
    out = {}
    for k, name in enumerate(fed.domain_names):
        mine = which == k
        if mine.any():
            out[f"test_acc/domain/{name}"] = float(hits[mine].mean())
    if out:
        out["test_acc/domain/worst"] = min(out.values())
    return out


def client_accuracy(
    model: nn.Module, fed: FederatedDataset, batch_size: int, on_train: bool = False, dist_acc: np.ndarray | None = None
) -> np.ndarray:
    """Each client's accuracy of the model, as the fairness metrics measure it: on the client's own local test data
    (the exact per-client accuracy), or with ``on_train`` on its training data; a client without such data gets its
    distribution-weighted accuracy on the global test set (``dist_acc``, computed here when not given)."""
    if on_train or fed.has_local_test:
        acc = local_test_acc(model, fed.clients, batch_size, on_train=on_train)
    else:
        acc = np.full(fed.num_clients, np.nan)
    if np.isnan(acc).any():
        if dist_acc is None:
            per_class = evaluate(model, fed.x_test, fed.y_test, fed.num_classes, batch_size).per_class_acc()
            dist_acc = client_distribution_acc(per_class, fed.label_distribution())
        acc = np.where(np.isnan(acc), dist_acc, acc)
    return acc

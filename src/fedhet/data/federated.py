"""FederatedDataset: a dataset split across clients, as tensors on the compute device, plus its statistics."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from fedhet.data.types import ArrayDataset, ClientData, DataError


@dataclass
class FederatedDataset:
    name: str
    clients: list[ClientData]
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int
    input_shape: tuple[int, ...]
    train_counts: np.ndarray  # (num_clients, num_classes) local training label counts
    test_source: str  # "official" or "local-union"
    pad_value: tuple[float, ...] | None = None  # a black pixel after normalisation, per channel (augmentation fill)
    white_value: tuple[float, ...] | None = None  # a white pixel after normalisation (the backdoor attack's trigger)
    provenance: dict | None = None  # where the data came from (files, hash), for the run folder's provenance.json

    @property
    def num_clients(self) -> int:
        return len(self.clients)

    @property
    def sizes(self) -> np.ndarray:
        return self.train_counts.sum(axis=1)

    @property
    def has_local_test(self) -> bool:
        return self.clients[0].y_test is not None

    def pooled(self) -> FederatedDataset:
        """One client holding every client's training data, in client order (the centralized upper bound). The
        clients' local test data are left out: they stay with the partition, on which evaluation is measured."""
        one = ClientData(
            x=torch.cat([c.x for c in self.clients]),
            y=torch.cat([c.y for c in self.clients]),
            num_classes=self.num_classes,
        )
        return replace(self, clients=[one], train_counts=self.train_counts.sum(axis=0, keepdims=True))

    def label_distribution(self) -> np.ndarray:
        """Each client's training label proportions pi^m (rows sum to 1)."""
        return self.train_counts / np.maximum(self.train_counts.sum(axis=1, keepdims=True), 1)


def black_value(ds: ArrayDataset) -> tuple[float, ...] | None:
    """The normalised value of a black (0) pixel per channel, or None when the inputs are not normalised images."""
    if ds.task != "image" or ds.mean is None:
        return None
    return tuple(-m / s for m, s in zip(ds.mean, ds.std, strict=True))


def white_value(ds: ArrayDataset) -> tuple[float, ...] | None:
    """The normalised value of a white (1) pixel per channel, or None when the inputs are not normalised images."""
    if ds.task != "image" or ds.mean is None:
        return None
    return tuple((1 - m) / s for m, s in zip(ds.mean, ds.std, strict=True))


def normalise(x: np.ndarray, ds: ArrayDataset) -> np.ndarray:
    if ds.task != "image" or ds.mean is None:
        return x
    mean = np.asarray(ds.mean, dtype=np.float32).reshape(1, -1, 1, 1)
    std = np.asarray(ds.std, dtype=np.float32).reshape(1, -1, 1, 1)
    return (x - mean) / std


def _split_local(idx: np.ndarray, frac: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Shuffle a client's indices and cut off ``frac`` of them (at least one) as its local test split."""
    if frac <= 0:
        return idx, idx[:0]
    perm = rng.permutation(idx)
    n_test = max(1, int(round(frac * len(idx)))) if len(idx) > 1 else 0
    return np.sort(perm[n_test:]), np.sort(perm[:n_test])


def federate(
    ds: ArrayDataset,
    parts: list[np.ndarray],
    *,
    local_test_fraction: float = 0.0,
    merged: bool = False,
    seed: int = 0,
    device: torch.device | str = "cpu",
    test_parts: list[np.ndarray] | None = None,
) -> FederatedDataset:
    """Build client tensors from ``parts`` (indices into ``ds.x_train``, or into train+test when ``merged``).

    The global test set is the official one, unless the dataset has none or was merged, in which case it is the
    union of the clients' local test splits (FedBC's protocol); that needs ``local_test_fraction > 0``.
    ``test_parts`` (indices into ``ds.x_test``, one array per client) give each client local test data taken from
    the official test set instead of a split of its own training data; the global test set stays the whole one.
    """
    use_local_union = merged or not ds.has_test_set
    if use_local_union and local_test_fraction <= 0:
        raise DataError(
            f"dataset {ds.name!r} has no separate test set here (merged or natural split): set "
            "partition.local_test_fraction (e.g. 0.2) so each client keeps a local test split"
        )
    x_all, y_all = ds.x_train, ds.y_train
    if merged:
        x_all = np.concatenate([ds.x_train, ds.x_test])
        y_all = np.concatenate([ds.y_train, ds.y_test])
    x_all = normalise(x_all, ds)
    rng = np.random.default_rng([seed, 0x5EED])
    x_t = torch.from_numpy(np.ascontiguousarray(x_all)).to(device)
    y_t = torch.from_numpy(np.ascontiguousarray(y_all)).long().to(device)
    if use_local_union:
        x_test = y_test = None
    else:
        x_test = torch.from_numpy(np.ascontiguousarray(normalise(ds.x_test, ds))).to(device)
        y_test = torch.from_numpy(np.ascontiguousarray(ds.y_test)).long().to(device)
    if test_parts is not None and (use_local_union or local_test_fraction > 0):
        raise DataError("local test data come either from the official test set or from a split, not both")
    clients, counts, held_out = [], [], []
    for i, idx in enumerate(parts):
        tr, te = _split_local(np.asarray(idx), local_test_fraction, rng)
        tr_t, te_t = torch.from_numpy(tr).to(device), torch.from_numpy(te).to(device)
        client = ClientData(x=x_t[tr_t], y=y_t[tr_t], num_classes=ds.num_classes)
        if local_test_fraction > 0:
            client.x_test, client.y_test = x_t[te_t], y_t[te_t]
        elif test_parts is not None:
            mine = torch.from_numpy(np.asarray(test_parts[i], np.int64)).to(device)
            client.x_test, client.y_test = x_test[mine], y_test[mine]
        clients.append(client)
        counts.append(np.bincount(y_all[tr], minlength=ds.num_classes))
        held_out.append(te)
    if use_local_union:
        te_all = torch.from_numpy(np.concatenate(held_out)).to(device)
        x_test, y_test, source = x_t[te_all], y_t[te_all], "local-union"
    else:
        source = "official"
    return FederatedDataset(
        name=ds.name,
        clients=clients,
        x_test=x_test,
        y_test=y_test,
        num_classes=ds.num_classes,
        input_shape=tuple(ds.input_shape),
        train_counts=np.stack(counts),
        test_source=source,
        pad_value=black_value(ds),
        white_value=white_value(ds),
        provenance=ds.provenance(),
    )

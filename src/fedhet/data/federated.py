"""FederatedDataset: a dataset split across clients, as tensors on the compute device, plus its statistics."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

import numpy as np
import torch

from fedhet.data.features import FeatureSkew
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
    notes: tuple[str, ...] = ()  # what loading did to the data that the user should hear of (shown when a run starts)
    # feature skew with domains (data/features.py): the domain of each global test sample (on the CPU), the domains'
    # names, and each client's domain (empty for natural domains, whose clients may span several)
    test_domains: torch.Tensor | None = None
    domain_names: tuple[str, ...] = ()
    client_domains: tuple[int, ...] = ()

    @property
    def num_clients(self) -> int:
        return len(self.clients)

    @property
    def sizes(self) -> np.ndarray:
        return self.train_counts.sum(axis=1)

    @property
    def has_local_test(self) -> bool:
        return self.clients[0].y_test is not None

    @property
    def has_validation(self) -> bool:
        """Whether the clients hold validation data (partition.validation_fraction > 0)."""
        return any(c.y_val is not None for c in self.clients)

    def pooled(self) -> FederatedDataset:
        """One client holding every client's training data, in client order (the centralized upper bound). The
        clients' local test data are left out: they stay with the partition, on which evaluation is measured."""
        one = ClientData(
            x=torch.cat([c.x for c in self.clients]),
            y=torch.cat([c.y for c in self.clients]),
            num_classes=self.num_classes,
        )
        return replace(self, clients=[one], train_counts=self.train_counts.sum(axis=0, keepdims=True))

    def fingerprint(self) -> str:
        """The SHA-256 that names the data: the provenance's (the files read, or the loaded arrays; computed once as
        they were loaded), else, for clients built by hand, a hash of every client's and the test set's tensors."""
        info = self.provenance or {}
        if info.get("sha256"):
            if info.get("partition_sha256"):  # the clients' indices came from a partition file: it counts too
                return hashlib.sha256(f"{info['sha256']} {info['partition_sha256']}".encode()).hexdigest()
            return str(info["sha256"])
        digest = hashlib.sha256()
        tensors = [t for c in self.clients for t in (c.x, c.y, c.x_test, c.y_test, c.x_val, c.y_val)]
        tensors += [self.x_test, self.y_test]
        for i, tensor in enumerate(tensors):
            if tensor is not None:
                flat = tensor.detach().reshape(-1).cpu().contiguous()
                digest.update(f"{i} {flat.dtype} {tuple(tensor.shape)}\n".encode())
                digest.update(flat.view(torch.uint8).numpy())
        return digest.hexdigest()

    def describe_source(self) -> str:
        """Where the data came from, for a message: ``dataset 'hf' (/data/x.csv)``; a folder when several files."""
        info = self.provenance or {}
        source, files = info.get("source"), info.get("files") or []
        if source and len(files) == 1 and info.get("file_count") == 1:
            source = f"{source.rstrip('/')}/{files[0]}"
        text = f"dataset {self.name!r}" + (f" ({source})" if source else "")
        if info.get("partition_file"):
            text += f" or partition file {info['partition_file']}"
        return text

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
    """Images with the dataset's per-channel mean subtracted and divided by its std; other inputs as they are."""
    return normalise_tensor(torch.from_numpy(x), ds).numpy() if ds.task == "image" and ds.mean is not None else x


def normalise_tensor(x: torch.Tensor, ds: ArrayDataset) -> torch.Tensor:
    """``normalise`` on a tensor (on the CPU, so every process computes the same bits)."""
    if ds.task != "image" or ds.mean is None:
        return x
    mean = torch.tensor(ds.mean, dtype=torch.float32).reshape(1, -1, 1, 1)
    std = torch.tensor(ds.std, dtype=torch.float32).reshape(1, -1, 1, 1)
    return (x - mean) / std


def _split_local(idx: np.ndarray, frac: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Shuffle a client's indices and cut off ``frac`` of them (at least one, none of a single sample) as its local
    test (or validation) split; ``frac = 0`` draws nothing from ``rng``."""
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
    validation_fraction: float = 0.0,
    merged: bool = False,
    seed: int = 0,
    device: torch.device | str = "cpu",
    test_parts: list[np.ndarray] | None = None,
    skew: FeatureSkew | None = None,
) -> FederatedDataset:
    """Build client tensors from ``parts`` (indices into ``ds.x_train``, or into train+test when ``merged``).

    The global test set is the official one, unless the dataset has none or was merged, in which case it is the
    union of the clients' local test splits (FedBC's protocol); that needs ``local_test_fraction > 0``.
    ``test_parts`` (indices into ``ds.x_test``, one array per client) give each client local test data taken from
    the official test set instead of a split of its own training data; the global test set stays the whole one.
    ``skew`` (data/features.py) changes each client's training and local test inputs; with domains, the official
    test set becomes one transformed copy per domain, and ``test_domains`` says which copy each sample is in.
    ``validation_fraction`` of what is left of each client's share after its local test split becomes its validation
    data (``x_val``, ``y_val``), drawn with a generator of its own from ``seed``: the training and local test data of
    a run without validation are exactly those of one with it, less the validation samples.
    """
    use_local_union = merged or not ds.has_test_set
    if use_local_union and local_test_fraction <= 0:
        raise DataError(
            f"dataset {ds.name!r} has no separate test set here (merged or natural split): set "
            "partition.local_test_fraction (e.g. 0.2) so each client keeps a local test split"
        )
    if test_parts is not None and (use_local_union or local_test_fraction > 0):
        raise DataError("local test data come either from the official test set or from a split, not both")
    x_all, y_all, domains_all = ds.x_train, ds.y_train, ds.domains_train
    if merged:
        x_all = np.concatenate([ds.x_train, ds.x_test])
        y_all = np.concatenate([ds.y_train, ds.y_test])
        domains_all = None if domains_all is None else np.concatenate([ds.domains_train, ds.domains_test])
    rng = np.random.default_rng([seed, 0x5EED])
    val_rng = np.random.default_rng([seed, 0x7A11D])  # its own stream: the local test split stays as it was
    inputs = ClientInputs(ds, skew, len(parts), seed, device)
    skew = inputs.skew
    x_t = torch.from_numpy(np.ascontiguousarray(inputs.prepare(x_all)))
    y_t = torch.from_numpy(np.ascontiguousarray(y_all)).long().to(device)
    official = None if use_local_union else torch.from_numpy(np.ascontiguousarray(inputs.prepare(ds.x_test)))
    y_official = torch.from_numpy(np.ascontiguousarray(ds.y_test)).long()
    clients, counts, held_out = [], [], []
    for i, idx in enumerate(parts):
        tr, te = _split_local(np.asarray(idx), local_test_fraction, rng)
        tr, va = _split_local(tr, validation_fraction, val_rng)
        tr_t, te_t = torch.from_numpy(tr), torch.from_numpy(te)
        client = ClientData(x=inputs.client(x_t[tr_t], i, 0), y=y_t[tr_t.to(device)], num_classes=ds.num_classes)
        if validation_fraction > 0:
            va_t = torch.from_numpy(va)
            client.x_val, client.y_val = inputs.client(x_t[va_t], i, 2), y_t[va_t.to(device)]
        if local_test_fraction > 0:
            client.x_test, client.y_test = inputs.client(x_t[te_t], i, 1), y_t[te_t.to(device)]
        elif test_parts is not None:
            mine = torch.from_numpy(np.asarray(test_parts[i], np.int64))
            client.x_test = inputs.client(official[mine], i, 1)
            client.y_test = y_official[mine].to(device)
        clients.append(client)
        counts.append(np.bincount(y_all[tr], minlength=ds.num_classes))
        held_out.append(te)
    if use_local_union:
        x_test = torch.cat([c.x_test for c in clients])
        y_test = torch.cat([c.y_test for c in clients])
        test_domains = inputs.union_domains(held_out, domains_all)
        source = "local-union"
    else:
        x_test, y_test, test_domains = inputs.official_test(official, y_official, ds.domains_test)
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
        notes=tuple(ds.extra.get("notes", ())),
        **inputs.domains(test_domains),
    )


class ClientInputs:
    """How a client's inputs are made: without a feature skew, the normalised arrays as they are (normalised once,
    up front); with one, the raw inputs transformed per client (and per domain for the test set), then
    normalised."""

    def __init__(self, ds: ArrayDataset, skew: FeatureSkew | None, num_clients: int, seed: int, device) -> None:
        self.skew = None if skew is None or skew.name == "none" else skew
        self.ds, self.num_clients, self.seed, self.device = ds, num_clients, seed, device

    def domains(self, test_domains: torch.Tensor | None) -> dict:
        """The FederatedDataset fields that describe the domains."""
        skew = self.skew
        names, clients = (skew.domain_names, skew.client_domains) if skew is not None else ((), ())
        return {"test_domains": test_domains, "domain_names": names, "client_domains": clients}

    def prepare(self, x: np.ndarray) -> np.ndarray:
        return x if self.skew is not None else normalise(x, self.ds)

    def client(self, x: torch.Tensor, i: int, role: int) -> torch.Tensor:
        if self.skew is not None:
            x = normalise_tensor(self.skew.client(x, i, self.num_clients, self.seed, role), self.ds)
        return x.to(self.device)

    def official_test(self, x: torch.Tensor, y_t: torch.Tensor, domains: np.ndarray | None):
        """The global test set, its labels and each sample's domain (None without domains)."""
        skew = self.skew
        if skew is None:
            return x.to(self.device), y_t.to(self.device), None
        if not skew.transforms_test_set:
            natural = None if skew.name != "natural" else torch.from_numpy(np.asarray(domains, np.int64))
            return normalise_tensor(x, self.ds).to(self.device), y_t.to(self.device), natural
        k = len(skew.domain_names)
        copies = torch.cat([normalise_tensor(skew.domain(x, d), self.ds) for d in range(k)])
        which = torch.arange(k).repeat_interleave(len(y_t))
        return copies.to(self.device), y_t.repeat(k).to(self.device), which

    def union_domains(self, held_out: list[np.ndarray], domains_all: np.ndarray | None) -> torch.Tensor | None:
        """The domain of each sample of the union of the clients' local test splits."""
        skew = self.skew
        if skew is None or not skew.domain_names:
            return None
        if skew.name == "natural":
            return torch.from_numpy(np.asarray(domains_all, np.int64)[np.concatenate(held_out)])
        return torch.cat([torch.full((len(te),), skew.client_domains[i]) for i, te in enumerate(held_out)])

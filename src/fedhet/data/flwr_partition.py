"""Flower Datasets' partitioners by name: ``partition.name = "flwr.<name>"`` runs flwr-datasets' own class.

Flower Datasets (``flwr-datasets``, the ``hf`` extra) partitions a Hugging Face ``Dataset``. Any dataset fedhet loads
becomes a thin ``Dataset`` view of its labels (column ``label``), its natural groups where it has them (column
``natural_id``) and each sample's position, so every partitioner runs unchanged and its clients' index sets are read
back through that position. What a caller of flwr-datasets does is repeated exactly: the view is shuffled with the
partition seed first (``FederatedDataset(shuffle=True, seed=...)``), the partitioner gets the same seed where it
takes one, ``num_partitions`` is ``partition.num_clients`` and ``partition_by`` the label (or natural-id) column.
The order of the samples inside a client is fedhet's (ascending), so flwr-datasets' own ``shuffle`` of each
partition, which changes no client's set, is not a setting.

Left out, since they do not split a labelled dataset's samples: ``VerticalEvenPartitioner`` and
``VerticalSizePartitioner`` (they split the columns: vertical federated learning), ``IdToSizeFncPartitioner`` (it
takes a Python function; ``linear``, ``square`` and ``exponential`` are its named forms) and
``ContinuousPartitioner`` (it sorts by a real-valued property; a class label is a category, not a quantity).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import Field, field_validator, model_validator

from fedhet import registry
from fedhet.data.datasets import NoParams
from fedhet.data.types import DataError
from fedhet.errors import ConfigError, FedhetWarning

PREFIX = "flwr."
INSTALL = "pip install 'fedhet[hf]'"
# flwr-datasets warns on each redraw before it either succeeds or raises: noise, not news
RETRY_WARNING = "was not satisfied for alpha"
# DirichletPartitioner's first draw and its ten redraws
FLWR_DIRICHLET_DRAWS = 11


class FlwrParams(NoParams):
    # FederatedDataset's shuffle: the dataset is shuffled with the partition seed before it is partitioned, as
    # flwr-datasets' FederatedDataset(shuffle=True) does (its default); the size-based partitioners (iid, linear,
    # square, exponential, size) then cut random samples, not the dataset's own order
    shuffle: bool = True

    @model_validator(mode="after")
    def _installed(self) -> FlwrParams:
        # refused with the config, before any data is loaded (find_spec imports nothing)
        if importlib.util.find_spec("flwr_datasets") is None or importlib.util.find_spec("datasets") is None:
            raise ValueError(f"the partitioners flwr.* need Flower Datasets (flwr-datasets): {INSTALL}")
        return self


def positive(alpha: float | list[float]) -> float | list[float]:
    values = alpha if isinstance(alpha, list) else [alpha]
    if not values or min(values) <= 0:
        raise ValueError("must be greater than 0")
    return alpha


class DirichletParams(FlwrParams):
    # concentration of Dir(alpha) over the clients, per class: one number, or one per client (flwr's list form)
    alpha: float | list[float] = 0.5
    min_partition_size: int = Field(10, ge=0)  # redraw (at most 10 times) until every client has this many
    self_balancing: bool = False  # a client above the mean size takes no more samples (flwr-datasets' option)

    _alpha = field_validator("alpha")(positive)


class InnerDirichletParams(FlwrParams):
    # concentration of each client's class prior Dir(alpha): one number, or one per class
    alpha: float | list[float] = 0.5
    # each client's size (one per client, summing to at most the samples); None: equal sizes (+-1) using every sample
    partition_sizes: list[int] | None = None

    _alpha = field_validator("alpha")(positive)

    @model_validator(mode="after")
    def _sizes(self) -> InnerDirichletParams:
        if self.partition_sizes is not None and any(size < 0 for size in self.partition_sizes):
            raise ValueError("partition_sizes: every size must be 0 or more")
        return self


class ShardParams(FlwrParams):
    num_shards_per_partition: int | None = Field(2, ge=1)  # shards per client (McMahan et al.: 2)
    shard_size: int | None = Field(None, ge=1)  # samples per shard; None: samples / (clients x shards per client)
    keep_incomplete_shard: bool = False  # keep the last, smaller shard (with shard_size alone)

    @model_validator(mode="after")
    def _one_given(self) -> ShardParams:
        if self.num_shards_per_partition is None and self.shard_size is None:
            raise ValueError("set num_shards_per_partition or shard_size (or both)")
        return self


class PathologicalParams(FlwrParams):
    num_classes_per_partition: int = Field(2, ge=1)  # the exact number of classes each client holds
    # how classes go to clients: "random"; "first-deterministic" (NIID-Bench's #C=k, client i first gets class
    # i mod K); "deterministic" (client i holds classes i, i+1, ... mod K)
    class_assignment_mode: Literal["random", "deterministic", "first-deterministic"] = "random"


class SizeParams(FlwrParams):
    partition_sizes: list[int] = Field(min_length=1)  # each client's size, one per client, each at least 1

    @model_validator(mode="after")
    def _positive(self) -> SizeParams:
        if any(size < 1 for size in self.partition_sizes):
            raise ValueError("partition_sizes: every size must be at least 1")
        return self


class GroupedNaturalIdParams(FlwrParams):
    group_size: int = Field(2, ge=1)  # natural ids (users) per client
    # what happens to the ids left over: "allow-smaller" (a last, smaller client), "allow-bigger" (spread over the
    # clients), "drop-reminder" (dropped), "strict" (refused)
    mode: Literal["allow-smaller", "allow-bigger", "drop-reminder", "strict"] = "allow-smaller"
    sort_unique_ids: bool = False  # group the ids in sorted order instead of their order in the shuffled data


class DistributionParams(FlwrParams):
    # one row per class (in ascending order), num_unique_labels_per_partition x num_clients / classes columns: how
    # each class is spread over the clients that hold it (rescaled to the class's size with rescale)
    distribution_array: list[list[float]] = Field(min_length=1)
    num_unique_labels_per_partition: int = Field(2, ge=1)  # classes per client, adjacent in sorted order
    preassigned_num_samples_per_label: int = Field(0, ge=0)  # samples of each class a client gets first (rescale)
    rescale: bool = True  # read the rows as proportions of each class (False: as sample counts)

    @model_validator(mode="after")
    def _finite(self) -> DistributionParams:
        rows = self.distribution_array
        if any(len(row) != len(rows[0]) or not row for row in rows):
            raise ValueError("distribution_array: every row must hold the same number (at least one) of values")
        if any(v < 0 or not np.isfinite(v) for row in rows for v in row):
            raise ValueError("distribution_array: values must be finite and 0 or more")
        return self


@dataclass(frozen=True)
class Scheme:
    """One flwr-datasets partitioner as fedhet runs it."""

    name: str  # fedhet's name, without the "flwr." prefix
    cls: str  # its class in flwr_datasets.partitioner
    summary: str
    params: type[FlwrParams]
    # the constructor's keywords from fedhet's inputs: (params, num_clients, seed, labels, groups) -> kwargs
    kwargs: Callable[..., dict]
    by_groups: bool = False  # partitions the natural ids, not the labels
    # flwr-datasets' error message -> fedhet's words for it (None: keep its own): (params, num_clients, message)
    explain: Callable[..., str | None] | None = None
    # flwr-datasets' warning -> fedhet's words for it: (params, labels, parts, message)
    reword: Callable[..., str] | None = None


def _labelled(n: int, seed: int, **extra) -> dict:
    return {"num_partitions": n, "partition_by": "label", "seed": seed, **extra}


def _alpha(alpha):
    return np.asarray(alpha, float) if isinstance(alpha, list) else float(alpha)


def _dirichlet(p: DirichletParams, n, seed, labels, groups) -> dict:
    extra = {"min_partition_size": p.min_partition_size, "self_balancing": p.self_balancing}
    if isinstance(p.alpha, list) and len(p.alpha) != n:
        raise ConfigError(f"partitioner 'flwr.dirichlet': alpha holds {len(p.alpha)} values; give one per client ({n})")
    if n * p.min_partition_size > len(labels):
        # no draw can succeed: flwr-datasets would redraw its ten times first
        raise DataError(
            f"partitioner 'flwr.dirichlet': {n} clients x min_partition_size={p.min_partition_size} = "
            f"{n * p.min_partition_size} samples, more than the {len(labels)} there are; use fewer clients or a "
            f"min_partition_size of at most {len(labels) // n}"
        )
    return _labelled(n, seed, alpha=_alpha(p.alpha), **extra)


def _dirichlet_failed(p: DirichletParams, n: int, message: str) -> str | None:
    if "max number of attempts" not in message:
        return None
    return (
        f"partitioner 'flwr.dirichlet': none of flwr-datasets' {FLWR_DIRICHLET_DRAWS} draws at alpha={p.alpha} gave "
        f"each of the {n} clients min_partition_size={p.min_partition_size} samples; use a larger alpha, fewer "
        "clients or a smaller min_partition_size (fedhet's own 'dirichlet' partitioner takes max_tries)"
    )


def _inner_dirichlet(p: InnerDirichletParams, n, seed, labels, groups) -> dict:
    classes = np.unique(labels)
    if not np.array_equal(classes, np.arange(len(classes))):
        # flwr-datasets indexes its classes 0..K-1 by the count of distinct labels: a missing class would be misread
        raise DataError(
            f"partitioner 'flwr.inner_dirichlet' needs every class 0 to {len(classes) - 1} present in the training "
            f"labels; these are {classes.tolist()} (use flwr.dirichlet, or a dataset with every class)"
        )
    if isinstance(p.alpha, list) and len(p.alpha) != len(classes):
        raise ConfigError(
            f"partitioner 'flwr.inner_dirichlet': alpha holds {len(p.alpha)} values; give one per class "
            f"({len(classes)})"
        )
    sizes = _sizes("flwr.inner_dirichlet", p.partition_sizes, n, len(labels), equal=True)
    return {"partition_sizes": sizes, "partition_by": "label", "alpha": _alpha(p.alpha), "seed": seed}


def _sizes(name: str, sizes: list[int] | None, n: int, total: int, equal: bool = False) -> np.ndarray | list[int]:
    if sizes is None:
        out = np.full(n, total // n, np.int64)
        out[: total % n] += 1
        return out if equal else out.tolist()
    if len(sizes) != n:
        raise ConfigError(f"partitioner {name!r}: partition_sizes holds {len(sizes)} sizes; give one per client ({n})")
    if sum(sizes) > total:
        raise DataError(f"partitioner {name!r}: partition_sizes sum to {sum(sizes)}, more than the {total} samples")
    return np.asarray(sizes, np.int64) if equal else list(sizes)


def _size(p: SizeParams, n, seed, labels, groups) -> dict:
    return {"partition_sizes": _sizes("flwr.size", p.partition_sizes, n, len(labels))}


def _shard(p: ShardParams, n, seed, labels, groups) -> dict:
    check_shards(p, n, len(labels))
    extra = {"num_shards_per_partition": p.num_shards_per_partition, "shard_size": p.shard_size}
    return _labelled(n, seed, keep_incomplete_shard=p.keep_incomplete_shard, **extra)


def check_shards(p: ShardParams, n: int, total: int) -> None:
    """The shard settings flwr-datasets cannot meet (some divide by zero there), refused with the numbers."""
    name, k, size = "partitioner 'flwr.shard'", p.num_shards_per_partition, p.shard_size
    if k is not None and size is None and n * k > total:
        raise DataError(
            f"{name}: {n} clients x num_shards_per_partition={k} = {n * k} shards, more than the {total} samples (a "
            f"shard holds at least one); use fewer clients or shards per client ({total} shards at most)"
        )
    if k is not None and size is not None and n * k * size > total:
        raise DataError(
            f"{name}: {n} clients x num_shards_per_partition={k} x shard_size={size} = {n * k * size} samples, more "
            f"than the {total} there are; use a smaller shard_size, fewer shards per client or fewer clients"
        )
    if k is None:
        shards = -(-total // size) if p.keep_incomplete_shard else total // size
        if shards < n:
            raise DataError(
                f"{name}: shard_size={size} cuts the {total} samples into {shards} shards, fewer than the {n} clients; "
                f"use a shard_size of at most {total // n} or at most {shards} clients"
            )


def _pathological(p: PathologicalParams, n, seed, labels, groups) -> dict:
    k, mode = p.num_classes_per_partition, p.class_assignment_mode
    return _labelled(n, seed, num_classes_per_partition=k, class_assignment_mode=mode)


def _unused_classes(p: PathologicalParams, labels, parts, message: str) -> str:
    if "will NOT be used" not in message:
        return message
    classes = np.unique(labels)
    held = np.unique(labels[np.concatenate(parts)]) if parts else classes[:0]
    unused = ", ".join(str(c) for c in np.setdiff1d(classes, held))
    text = f"classes {unused} go to no client ({len(held)} of the {len(classes)} classes are used)"
    if len(parts) >= len(classes):
        return f"{text}; partition.class_assignment_mode='first-deterministic' uses every class"
    return (
        f"{text}; with partition.num_clients of at least {len(classes)} (the classes), "
        "partition.class_assignment_mode='first-deterministic' uses every class"
    )


def _distribution(p: DistributionParams, n, seed, labels, groups) -> dict:
    classes, k = len(np.unique(labels)), p.num_unique_labels_per_partition
    if n % classes:
        raise ConfigError(
            f"partitioner 'flwr.distribution': partition.num_clients={n} must be a multiple of the {classes} classes"
        )
    shape = (classes, k * n // classes)
    got = (len(p.distribution_array), len(p.distribution_array[0]))
    if got != shape:
        raise ConfigError(
            f"partitioner 'flwr.distribution': distribution_array must be {shape[0]} x {shape[1]} (one row per class, "
            f"num_unique_labels_per_partition x num_clients / classes = {k} x {n} / {classes} columns), not "
            f"{got[0]} x {got[1]}"
        )
    extra = {
        "distribution_array": np.asarray(p.distribution_array, float),
        "num_unique_labels_per_partition": p.num_unique_labels_per_partition,
        "preassigned_num_samples_per_label": p.preassigned_num_samples_per_label,
        "rescale": p.rescale,
    }
    return _labelled(n, seed, **extra)


def _grouped(p: GroupedNaturalIdParams, n, seed, labels, groups) -> dict:
    return {
        "partition_by": "natural_id",
        "group_size": p.group_size,
        "mode": p.mode,
        "sort_unique_ids": p.sort_unique_ids,
    }


SCHEMES = [
    Scheme(
        "iid",
        "IidPartitioner",
        "Flower Datasets: equal random shares",
        FlwrParams,
        lambda p, n, *_: {"num_partitions": n},
    ),
    Scheme(
        "dirichlet",
        "DirichletPartitioner",
        "Flower Datasets: per class, client shares ~ Dir(alpha)",
        DirichletParams,
        _dirichlet,
        explain=_dirichlet_failed,
    ),
    Scheme(
        "inner_dirichlet",
        "InnerDirichletPartitioner",
        "Flower Datasets: per client, class shares ~ Dir(alpha), given sizes (FedDyn)",
        InnerDirichletParams,
        _inner_dirichlet,
    ),
    Scheme(
        "shard",
        "ShardPartitioner",
        "Flower Datasets: label-sorted shards, a few per client (McMahan et al.)",
        ShardParams,
        _shard,
    ),
    Scheme(
        "pathological",
        "PathologicalPartitioner",
        "Flower Datasets: exactly k classes per client (NIID-Bench)",
        PathologicalParams,
        _pathological,
        reword=_unused_classes,
    ),
    Scheme(
        "distribution",
        "DistributionPartitioner",
        "Flower Datasets: classes spread over clients by a given array (FedProx)",
        DistributionParams,
        _distribution,
    ),
    Scheme(
        "linear",
        "LinearPartitioner",
        "Flower Datasets: client i gets a share proportional to i",
        FlwrParams,
        lambda p, n, *_: {"num_partitions": n},
    ),
    Scheme(
        "square",
        "SquarePartitioner",
        "Flower Datasets: client i gets a share proportional to i^2",
        FlwrParams,
        lambda p, n, *_: {"num_partitions": n},
    ),
    Scheme(
        "exponential",
        "ExponentialPartitioner",
        "Flower Datasets: client i gets a share proportional to e^i",
        FlwrParams,
        lambda p, n, *_: {"num_partitions": n},
    ),
    Scheme("size", "SizePartitioner", "Flower Datasets: clients of the sizes given", SizeParams, _size),
    Scheme(
        "natural_id",
        "NaturalIdPartitioner",
        "Flower Datasets: one client per natural id (user)",
        FlwrParams,
        lambda p, n, *_: {"partition_by": "natural_id"},
        by_groups=True,
    ),
    Scheme(
        "grouped_natural_id",
        "GroupedNaturalIdPartitioner",
        "Flower Datasets: group_size natural ids (users) per client",
        GroupedNaturalIdParams,
        _grouped,
        by_groups=True,
    ),
]


def flwr_modules():
    """``(datasets, flwr_datasets.partitioner)``, or one line saying how to install them."""
    try:
        import datasets
        from flwr_datasets import partitioner
    except ImportError:
        raise ConfigError(
            f"the partitioners flwr.* need Flower Datasets (flwr-datasets) and Hugging Face datasets: {INSTALL}"
        ) from None
    return datasets, partitioner


def view(labels: np.ndarray, groups: np.ndarray | None, seed: int, shuffle: bool):
    """A Hugging Face ``Dataset`` of ``label``, ``natural_id`` (with groups) and ``index`` (each sample's position),
    shuffled with ``seed`` as FederatedDataset shuffles before partitioning."""
    datasets, _ = flwr_modules()
    columns = {"label": np.asarray(labels, np.int64), "index": np.arange(len(labels), dtype=np.int64)}
    if groups is not None:
        columns["natural_id"] = np.asarray(groups)
    out = datasets.Dataset.from_dict(columns)
    return out.shuffle(seed=seed) if shuffle else out


def run(scheme: Scheme, labels, num_clients: int, seed: int, groups, p: FlwrParams) -> list[np.ndarray]:
    """The clients' index sets (ascending) from flwr-datasets' partitioner of ``scheme`` over ``labels``."""
    name = PREFIX + scheme.name
    _, module = flwr_modules()
    if scheme.by_groups and groups is None:
        raise DataError(
            f"partitioner {name!r} needs a dataset with natural ids (e.g. shakespeare, synthetic, leaf_*, or hf with "
            "dataset.id_column)"
        )
    if not scheme.by_groups and num_clients > len(labels):
        raise DataError(
            f"partitioner {name!r}: {num_clients} clients but only {len(labels)} samples to split (fewer samples "
            f"than clients); use at most {len(labels)} clients"
        )
    kwargs = scheme.kwargs(p, num_clients, seed, labels, groups)
    shown: list[str] = []
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("always")
        try:
            partitioner = getattr(module, scheme.cls)(**kwargs)
            partitioner.dataset = view(labels, groups, seed, p.shuffle)
            count = partitioner.num_partitions
            if count != num_clients:
                raise DataError(
                    f"partitioner {name!r} makes {count} clients from this dataset, but partition.num_clients is "
                    f"{num_clients}; set partition.num_clients={count}"
                )
            parts = [np.sort(np.asarray(partitioner.load_partition(i)["index"], np.int64)) for i in range(count)]
        except (ValueError, TypeError, AssertionError, KeyError, IndexError, ZeroDivisionError) as exc:
            if isinstance(exc, DataError):
                raise
            message = " ".join(str(exc).split()) or type(exc).__name__
            explained = scheme.explain(p, num_clients, message) if scheme.explain else None
            raise DataError(explained or f"partitioner {name!r}: {message}") from None
    for warning in caught:
        if warning.category is not UserWarning:  # the libraries' deprecation notes are not about the partition
            continue
        text = " ".join(str(warning.message).split())
        if scheme.reword is not None:
            text = scheme.reword(p, labels, parts, text)
        if RETRY_WARNING not in text and text not in shown:
            shown.append(text)
    for text in shown:
        warnings.warn(f"partitioner {name!r}: {text}", FedhetWarning, stacklevel=3)
    return parts


def partitioner(scheme: Scheme) -> Callable[..., list[np.ndarray]]:
    """fedhet's partitioner function for ``scheme``: ``fn(labels, num_clients, rng, *, groups, seed, **params)``."""

    def split(labels, num_clients, rng, *, groups=None, seed=0, **params) -> list[np.ndarray]:
        p = registry.parse_params("partitioner", PREFIX + scheme.name, scheme.params, params)
        return run(scheme, labels, num_clients, seed, groups, p)

    split.takes_seed = True  # flwr-datasets seeds its own generator with the partition seed itself
    split.__doc__ = f"flwr_datasets.partitioner.{scheme.cls}, as fedhet runs it (module docstring)."
    return split

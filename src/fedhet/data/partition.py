"""Partitioners: split a dataset's sample indices among clients.

Every partitioner is ``fn(labels, num_clients, rng, *, groups=None, **params) -> list[np.ndarray]`` and returns one
sorted int64 index array per client. The arrays are disjoint and together cover every sample exactly once, except
for ``natural`` with fewer clients than groups, which by definition drops the samples of the groups not chosen.
Partitioners split whatever labels they are given; a local train/test split of each client happens afterwards.
Flower Datasets' partitioners are registered here too, as ``flwr.<name>`` (``data/flwr_partition.py``); they take
the partition seed itself (``takes_seed``), since flwr-datasets seeds its own generators.
"""

from __future__ import annotations

import math

import numpy as np
from pydantic import BaseModel, Field

from fedhet import registry
from fedhet.data import flwr_partition, partition_file
from fedhet.data.datasets import NoParams
from fedhet.data.types import DataError
from fedhet.errors import ConfigError
from fedhet.registry import Registry

PARTITIONERS = Registry("partitioner", section="partition")


class DirichletParams(NoParams):
    alpha: float = Field(0.5, gt=0)
    min_size: int = Field(10, ge=1)
    max_tries: int = Field(1000, ge=1)


class BalancedDirichletParams(NoParams):
    alpha: float = Field(0.3, gt=0)


class ShardsParams(NoParams):
    shards_per_client: int = Field(2, ge=1)
    # None: each class gets a share of the shards proportional to its size (McMahan et al.'s sort-and-cut, kept
    # inside classes); a number: every class is cut into exactly that many shards (FedUFO Sec. 4.1.1: "data of each
    # category is divided into 20 shards"), so num_classes * shards_per_class must equal num_clients *
    # shards_per_client
    shards_per_class: int | None = Field(None, ge=1)


class KClassesParams(NoParams):
    k: int = Field(2, ge=1)


class QuantityParams(NoParams):
    sigma: float = Field(1.0, gt=0)
    min_size: int = Field(10, ge=1)


class FileParams(NoParams):
    path: str = Field(min_length=1)  # a partition file written by `fedhet partition --save` (docs/non-iid.md)
    allow_overlap: bool = False  # let clients share samples (a sample in two clients is refused otherwise)


class PowerLawParams(NoParams):
    exponent: float = Field(1.2, ge=1.0)
    classes_per_client: int = Field(2, ge=1)


def parse_params(name: str, model: type[BaseModel], params: dict) -> BaseModel:
    return registry.parse_params("partitioner", name, model, params)


def partition(name: str, labels, num_clients: int, seed: int, groups=None, **params) -> list[np.ndarray]:
    """Split ``labels``' indices among ``num_clients`` with the named partitioner and a generator seeded by ``seed``."""
    entry = PARTITIONERS.get(name)
    labels = np.asarray(labels)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise DataError(f"partitioner {name!r} needs a 1-D integer label array, got {labels.dtype} {labels.shape}")
    if groups is not None:
        groups = np.asarray(groups)
        if groups.shape != labels.shape:
            raise DataError(f"groups of shape {groups.shape} do not match labels of shape {labels.shape}")
    if getattr(entry.obj, "takes_seed", False):
        params = {**params, "seed": seed}
    return entry.obj(labels, num_clients, np.random.default_rng(seed), groups=groups, **params)


def match_test(labels_test: np.ndarray, train_counts: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
    """Deal the test set to clients like their training data: each class's test samples, in random order, go to the
    clients holding that class in proportion to how many training samples of it they hold (largest remainder).

    With per-class shards this is the shard mechanism applied to the test set (FedUFO, notes/fedufo.md reading 12):
    a client holding 2 of a class's 20 training shards gets 2/20 of that class's test samples. Test samples of a
    class no client holds go to nobody."""
    labels_test = np.asarray(labels_test)
    owner = np.full(len(labels_test), -1, np.int64)
    for c in range(train_counts.shape[1]):
        holders = np.flatnonzero(train_counts[:, c])
        pool = rng.permutation(np.flatnonzero(labels_test == c))
        if len(holders) == 0 or len(pool) == 0:
            continue
        sizes = apportion(len(pool), train_counts[holders, c].astype(float))
        owner[pool] = np.repeat(holders, sizes)
    return parts_from_owner(owner, len(train_counts))


def natural_test(groups_train: np.ndarray, parts: list[np.ndarray], groups_test: np.ndarray) -> list[np.ndarray]:
    """Each client's own test samples: those of ``groups_test`` whose user is the one its training samples belong
    to (a natural partition gives a client one user's samples; an empty client gets no test samples)."""
    groups_train, groups_test = np.asarray(groups_train), np.asarray(groups_test)
    out = []
    for idx in parts:
        users = np.unique(groups_train[idx])
        if len(users) > 1:
            raise DataError("partition.local_test='natural' needs clients that each hold one user's samples")
        out.append(np.flatnonzero(groups_test == users[0]) if len(users) else np.empty(0, np.int64))
    return out


def label_counts(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> np.ndarray:
    """``(num_clients, num_classes)`` matrix of how many samples of each class every client holds."""
    labels = np.asarray(labels)
    counts = np.zeros((len(parts), num_classes), np.int64)
    for row, part in zip(counts, parts, strict=True):
        row[:] = np.bincount(labels[part], minlength=num_classes)
    return counts


# ----------------------------------------------------------------------------------------------------------
# Helpers


def check_clients(name: str, n: int, num_clients: int, per_client: int = 1) -> None:
    if num_clients < 1:
        raise ConfigError(f"partitioner {name!r}: num_clients must be at least 1, got {num_clients}")
    if num_clients * per_client > n:
        raise DataError(
            f"partitioner {name!r}: {num_clients} clients x {per_client} sample(s) each need more than the "
            f"{n} samples available; use fewer clients"
        )


def parts_from_owner(owner: np.ndarray, num_clients: int) -> list[np.ndarray]:
    """Index arrays from an owner-per-sample vector (-1 = dropped); stable sorting keeps each array ascending."""
    kept = np.flatnonzero(owner >= 0)
    order = kept[np.argsort(owner[kept], kind="stable")]
    counts = np.bincount(owner[kept], minlength=num_clients)
    return [part.astype(np.int64) for part in np.split(order, np.cumsum(counts)[:-1])]


def class_pools(labels: np.ndarray, rng: np.random.Generator) -> dict[int, np.ndarray]:
    """Class -> its sample indices in random order."""
    return {int(c): rng.permutation(np.flatnonzero(labels == c)) for c in np.unique(labels)}


def apportion(total: int, weights: np.ndarray) -> np.ndarray:
    """Integers proportional to ``weights`` that sum to ``total`` (largest remainder)."""
    quota = total * weights / weights.sum()
    counts = np.floor(quota).astype(np.int64)
    short = total - counts.sum()
    counts[np.argsort(counts - quota, kind="stable")[:short]] += 1
    return counts


def split_evenly(indices: np.ndarray, holders: list[int], owner: np.ndarray) -> None:
    for holder, piece in zip(holders, np.array_split(indices, len(holders)), strict=True):
        owner[piece] = holder


# ----------------------------------------------------------------------------------------------------------
# Partitioners


@PARTITIONERS.register("iid", "uniformly random, equal sizes (+-1)", NoParams)
def iid(labels, num_clients, rng, *, groups=None, **params) -> list[np.ndarray]:
    parse_params("iid", NoParams, params)
    check_clients("iid", len(labels), num_clients)
    owner = np.empty(len(labels), np.int64)
    split_evenly(rng.permutation(len(labels)), list(range(num_clients)), owner)
    return parts_from_owner(owner, num_clients)


@PARTITIONERS.register("dirichlet", "label skew: per class, client shares ~ Dir(alpha) (Hsu et al.)", DirichletParams)
def dirichlet(labels, num_clients, rng, *, groups=None, **params) -> list[np.ndarray]:
    """Per class c, ``q_c ~ Dir(alpha 1_N)`` splits the class among clients; redrawn until every client has
    ``min_size`` samples, at most ``max_tries`` times. Only counts are drawn per try (cheap even for many clients
    and small alpha), and there is no "skip full clients" renormalisation, so no NaN from all-zero shares."""
    p = parse_params("dirichlet", DirichletParams, params)
    check_clients("dirichlet", len(labels), num_clients, p.min_size)
    classes, class_sizes = np.unique(labels, return_counts=True)
    best = -1
    for _ in range(p.max_tries):
        counts = dirichlet_counts(class_sizes, num_clients, p.alpha, rng)
        smallest = int(counts.sum(axis=0).min())
        if smallest >= p.min_size:
            return assign_counts(labels, classes, counts, rng)
        best = max(best, smallest)
    raise DataError(
        f"dirichlet partition: no draw in {p.max_tries} tries gave every one of num_clients={num_clients} clients "
        f"min_size={p.min_size} samples at alpha={p.alpha} (best smallest client: {best}); use a larger alpha, "
        f"fewer clients, a smaller min_size or more max_tries, or balanced_dirichlet for equal sizes"
    )


def dirichlet_counts(class_sizes: np.ndarray, num_clients: int, alpha: float, rng) -> np.ndarray:
    """``(num_classes, num_clients)`` sample counts: class sizes cut at the cumulative Dirichlet shares."""
    shares = rng.dirichlet(np.full(num_clients, alpha), size=len(class_sizes))
    bounds = np.floor(np.cumsum(shares, axis=1) * class_sizes[:, None]).astype(np.int64)
    bounds[:, -1] = class_sizes  # the cumulative sum can fall a hair short of 1
    return np.diff(bounds, axis=1, prepend=0)


def assign_counts(labels, classes, counts, rng) -> list[np.ndarray]:
    owner = np.empty(len(labels), np.int64)
    for c, row in zip(classes, counts, strict=True):
        owner[rng.permutation(np.flatnonzero(labels == c))] = np.repeat(np.arange(len(row)), row)
    return parts_from_owner(owner, counts.shape[1])


@PARTITIONERS.register(
    "balanced_dirichlet", "label skew with equal client sizes (FedRCL's Dirichlet split)", BalancedDirichletParams
)
def balanced_dirichlet(labels, num_clients, rng, *, groups=None, **params) -> list[np.ndarray]:
    """FedRCL's ``cifar_dirichlet_balanced``: clients in order draw ``p_i ~ Dir(alpha 1_K)`` and then exactly n/N
    still-unassigned samples without replacement, each weighted by ``p_i[label]``.

    The first ``n % N`` clients get one extra sample so that every sample is used. When fewer unassigned samples
    have non-zero weight than a client needs (late clients whose favoured classes ran out), the shortfall is drawn
    uniformly from the remaining unassigned samples."""
    p = parse_params("balanced_dirichlet", BalancedDirichletParams, params)
    n = len(labels)
    check_clients("balanced_dirichlet", n, num_clients)
    classes, label_ids = np.unique(labels, return_inverse=True)
    sizes = np.full(num_clients, n // num_clients)
    sizes[: n % num_clients] += 1
    owner = np.full(n, -1, np.int64)
    for client, size in enumerate(sizes):
        weights = rng.dirichlet(np.full(len(classes), p.alpha))[label_ids] * (owner < 0)
        owner[weighted_draw(weights, owner < 0, size, rng)] = client
    return parts_from_owner(owner, num_clients)


def weighted_draw(weights: np.ndarray, free: np.ndarray, size: int, rng) -> np.ndarray:
    """``size`` distinct indices drawn with probability proportional to ``weights`` (sequentially, without
    replacement, via exponential keys), topped up uniformly from ``free`` when too few weights are non-zero."""
    candidates = np.flatnonzero(weights > 0)
    if len(candidates) <= size:
        rest = np.setdiff1d(np.flatnonzero(free), candidates)
        return np.concatenate([candidates, rng.choice(rest, size - len(candidates), replace=False)])
    keys = rng.exponential(size=len(candidates)) / weights[candidates]
    return candidates[np.argpartition(keys, size - 1)[:size]]


@PARTITIONERS.register("shards", "pathological: label-sorted shards, a few per client (McMahan et al.)", ShardsParams)
def shards(labels, num_clients, rng, *, groups=None, **params) -> list[np.ndarray]:
    """Sort by label, cut into ``num_clients * shards_per_client`` shards, deal each client ``shards_per_client``.

    Shards are cut inside classes (each class gets a share of the shards proportional to its size), so a shard
    never straddles two labels and a client holds at most ``shards_per_client`` classes."""
    p = parse_params("shards", ShardsParams, params)
    total = num_clients * p.shards_per_client
    check_clients("shards", len(labels), total)
    pools = class_pools(labels, rng)
    if total < len(pools):
        raise DataError(
            f"shards: {num_clients} clients x {p.shards_per_client} shards = {total} shards cannot keep "
            f"{len(pools)} classes apart; use more clients or shards_per_client"
        )
    per_class = shards_of_classes("shards", pools, total, p.shards_per_class)
    pieces = [s for pool, k in zip(pools.values(), per_class, strict=True) for s in np.array_split(pool, k)]
    owner = np.empty(len(labels), np.int64)
    for shard, piece in zip(rng.permutation(total), pieces, strict=True):
        owner[piece] = shard // p.shards_per_client
    return parts_from_owner(owner, num_clients)


def shards_of_classes(name: str, pools: dict[int, np.ndarray], total: int, per_class: int | None) -> np.ndarray:
    """How many shards each class is cut into: proportional to class size, or ``per_class`` for every class."""
    sizes = np.array([len(v) for v in pools.values()])
    if per_class is None:
        return shard_counts(sizes, total)
    if per_class * len(pools) != total:
        raise DataError(
            f"{name}: shards_per_class={per_class} x {len(pools)} classes = {per_class * len(pools)} shards, but "
            f"num_clients x shards_per_client = {total}; make them equal (FedUFO: 10 x 20 = 100 x 2)"
        )
    if per_class > sizes.min():
        raise DataError(f"{name}: shards_per_class={per_class} exceeds the smallest class ({sizes.min()} samples)")
    return np.full(len(pools), per_class)


def shard_counts(class_sizes: np.ndarray, total: int) -> np.ndarray:
    """Shards per class: proportional to class size, at least one and at most the class size each."""
    counts = np.clip(apportion(total - len(class_sizes), class_sizes.astype(float)) + 1, 1, class_sizes)
    while counts.sum() < total:  # only when clipping at a class size took some away
        spare = np.flatnonzero(counts < class_sizes)
        counts[spare[np.argmax(class_sizes[spare] / counts[spare])]] += 1
    return counts


@PARTITIONERS.register("k_classes", "each client holds exactly k classes, split equally among holders", KClassesParams)
def k_classes(labels, num_clients, rng, *, groups=None, **params) -> list[np.ndarray]:
    """Classes are dealt round-robin (in a random order) until every class is held, then each client's remaining
    slots get random classes it does not hold yet; each class is split equally among the clients holding it."""
    p = parse_params("k_classes", KClassesParams, params)
    check_clients("k_classes", len(labels), num_clients)
    pools = class_pools(labels, rng)
    if p.k > len(pools) or num_clients * p.k < len(pools):
        raise DataError(
            f"k_classes: k={p.k} with {num_clients} clients cannot use all {len(pools)} classes; "
            f"need k <= {len(pools)} and num_clients * k >= {len(pools)}"
        )
    held = deal_classes(list(pools), num_clients, p.k, rng)
    owner = np.empty(len(labels), np.int64)
    for c, pool in pools.items():
        holders = [i for i, mine in enumerate(held) if c in mine]
        if len(pool) < len(holders):
            raise DataError(f"k_classes: class {c} has {len(pool)} samples for {len(holders)} clients holding it")
        split_evenly(pool, holders, owner)
    return parts_from_owner(owner, num_clients)


def deal_classes(classes: list[int], num_clients: int, k: int, rng) -> list[set[int]]:
    order = [classes[i] for i in rng.permutation(len(classes))]
    held = [set() for _ in range(num_clients)]
    for slot, c in enumerate(order):  # round-robin over clients, k slots each, until every class is placed
        held[slot // k].add(c)
    for mine in held:
        free = [c for c in classes if c not in mine]
        mine.update(free[i] for i in rng.choice(len(free), k - len(mine), replace=False))
    return held


@PARTITIONERS.register("quantity_lognormal", "IID labels, log-normal client sizes (quantity skew)", QuantityParams)
def quantity_lognormal(labels, num_clients, rng, *, groups=None, **params) -> list[np.ndarray]:
    """Every client gets ``min_size`` samples plus a share of the rest proportional to a LogNormal(0, sigma) draw."""
    p = parse_params("quantity_lognormal", QuantityParams, params)
    n = len(labels)
    check_clients("quantity_lognormal", n, num_clients, p.min_size)
    sizes = p.min_size + apportion(n - num_clients * p.min_size, rng.lognormal(0, p.sigma, num_clients))
    owner = np.empty(n, np.int64)
    owner[rng.permutation(n)] = np.repeat(np.arange(num_clients), sizes)
    return parts_from_owner(owner, num_clients)


@PARTITIONERS.register("power_law", "power-law sizes, about C classes per client (FedBC)", PowerLawParams)
def power_law(labels, num_clients, rng, *, groups=None, **params) -> list[np.ndarray]:
    """Stripelis & Ambite's strictly unbalanced non-IID split, as FedBC's code runs it.

    Target sizes grow as ``exponent**(p+1)``; the rounding remainder goes to the largest first, each taking
    ceil(rest / exponent). Pass 1, smallest client first: take up to ceil(size / C) samples from each class of a
    fresh random class order until full. Pass 2, largest client first: each takes ceil(left / exponent) of every
    class's leftovers. Unlike the original, pass 2 repeats until nothing is left (so every sample is used), samples
    are taken from each class in random order, and clients are returned largest first."""
    p = parse_params("power_law", PowerLawParams, params)
    check_clients("power_law", len(labels), num_clients)
    sizes = power_law_sizes(len(labels), num_clients, p.exponent)
    pools = {c: list(pool) for c, pool in class_pools(labels, rng).items()}
    taken: list[list[int]] = [[] for _ in range(num_clients)]
    for client in range(num_clients):  # sizes ascend, so this is smallest first
        fill_client(taken[client], int(sizes[client]), pools, p.classes_per_client, rng)
    spread_leftovers(taken, pools, p.exponent)
    if min(len(t) for t in taken) == 0:
        raise DataError(
            f"power_law: exponent={p.exponent} leaves some of the {num_clients} clients empty with "
            f"{len(labels)} samples; use a smaller exponent or fewer clients"
        )
    taken.sort(key=len, reverse=True)
    return [np.sort(np.array(t, np.int64)) for t in taken]


def power_law_sizes(n: int, num_clients: int, exponent: float) -> np.ndarray:
    """Ascending target sizes ``floor(unit * s**(p+1))``, remainder handed out from the largest down."""
    factors = exponent ** np.arange(1, num_clients + 1, dtype=float)
    if not np.isfinite(factors.sum()):
        raise DataError(f"power_law: exponent={exponent} ** {num_clients} clients overflows; use fewer clients")
    sizes = np.floor(factors * np.floor(n / factors.sum())).astype(np.int64)
    rest = n - int(sizes.sum())
    for client in range(num_clients - 1, -1, -1):
        extra = math.ceil(rest / exponent)
        sizes[client] += extra
        rest -= extra
    return sizes


def fill_client(mine: list[int], size: int, pools: dict[int, list[int]], per_client: int, rng) -> None:
    per_class = math.ceil(size / per_client)
    classes = list(pools)
    for i in rng.permutation(len(classes)):
        pool = pools[classes[i]]
        take = min(size - len(mine), per_class, len(pool))
        mine += pool[:take]
        del pool[:take]
        if len(mine) >= size:
            return


def spread_leftovers(taken: list[list[int]], pools: dict[int, list[int]], exponent: float) -> None:
    order = sorted(range(len(taken)), key=lambda i: len(taken[i]), reverse=True)
    for pool in pools.values():
        while pool:
            for client in order:
                take = math.ceil(len(pool) / exponent)
                taken[client] += pool[:take]
                del pool[:take]


@PARTITIONERS.register("natural", "the dataset's own users (Shakespeare roles, Synthetic and LEAF users)", NoParams)
def natural(labels, num_clients, rng, *, groups=None, **params) -> list[np.ndarray]:
    """Client i is the i-th group in sorted order. With fewer clients than groups a seeded random subset of the
    groups is kept (sorted) and the samples of the other groups are dropped."""
    parse_params("natural", NoParams, params)
    if groups is None:
        raise DataError("natural partition needs a dataset with natural groups (e.g. shakespeare, synthetic, leaf_*)")
    check_clients("natural", len(labels), num_clients)
    names = np.unique(groups)
    if num_clients > len(names):
        raise DataError(f"natural partition: the dataset has {len(names)} groups, fewer than {num_clients} clients")
    if num_clients < len(names):
        names = np.sort(rng.choice(names, num_clients, replace=False))
    pos = np.clip(np.searchsorted(names, groups), 0, len(names) - 1)
    owner = np.where(names[pos] == groups, pos, -1)
    return parts_from_owner(owner, num_clients)


@PARTITIONERS.register("file", "the clients of a saved partition (fedhet partition --save), checked", FileParams)
def from_file(labels, num_clients, rng, *, groups=None, **params) -> list[np.ndarray]:
    """A partition file's training index sets, after checking that they index these labels (the same count and
    order), that there are ``num_clients`` of them, in range and (unless ``allow_overlap``) disjoint."""
    p = parse_params("file", FileParams, params)
    return partition_file.SavedPartition.load(p.path).client_parts(labels, num_clients, p.allow_overlap)


for _scheme in flwr_partition.SCHEMES:
    PARTITIONERS.register(flwr_partition.PREFIX + _scheme.name, _scheme.summary, _scheme.params)(
        flwr_partition.partitioner(_scheme)
    )

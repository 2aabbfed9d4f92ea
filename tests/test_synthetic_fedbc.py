"""Synthetic(alpha, beta) as the FedBC code draws it (dataset.generator = "fedbc") and each user's own test split
(partition.local_test = "natural")."""

from __future__ import annotations

import random

import numpy as np
import pytest

from fedhet.config import build_config
from fedhet.data.datasets import load_dataset
from fedhet.data.datasets.generated import SyntheticParams, fedbc_splits, synthetic_users
from fedhet.data.partition import natural_test
from fedhet.data.types import DataError
from fedhet.engine.simulation import build_federation
from fedhet.errors import ConfigError


def params(**changes):

    return SyntheticParams(generator="fedbc", **changes)


def test_the_draws_follow_the_legacy_streams_order():
    """FedBC's partition.py seeds numpy's global RandomState: the user sizes come first, then the W and x priors,
    every user's x prior, and then per user its W and b (before its features): user 0's labels are the argmax of its
    rows' logits under the W and b drawn at that point of the stream."""
    p = params(seed=3, num_users=4, dim=5, num_classes=3)
    xs, ys = synthetic_users(p)
    rng = np.random.RandomState(3)
    sizes = rng.lognormal(4, 2, 4).astype(int) + 50
    assert [len(y) for y in ys] == sizes.tolist() and [x.shape for x in xs] == [(n, 5) for n in sizes]
    mean_w, b_prior = rng.normal(0, 0.5, 4), rng.normal(0, 0.5, 4)
    for b in b_prior:
        rng.normal(b, 1, 5)
    w, b = rng.normal(mean_w[0], 1, (5, 3)), rng.normal(mean_w[0], 1, 3)
    assert np.array_equal(ys[0], np.argmax(xs[0] @ w + b, axis=1))


def test_the_split_is_python_random_shuffle_per_user_and_an_int_80_percent_cut():
    sizes = [7, 50, 101]
    py = random.Random(1)
    for (order, cut), n in zip(fedbc_splits(sizes, 1), sizes, strict=True):
        expected = list(range(n))
        py.shuffle(expected)
        assert order.tolist() == expected and cut == int(0.8 * n)


def test_the_dataset_holds_each_users_train_and_test_parts():
    ds = load_dataset("synthetic", generator="fedbc", seed=1, num_users=6)
    xs, ys = synthetic_users(params(seed=1, num_users=6))
    cuts = fedbc_splits([len(y) for y in ys], 1)
    for user, (x, y, (order, cut)) in enumerate(zip(xs, ys, cuts, strict=True)):
        train, test = ds.groups_train == user, ds.groups_test == user
        assert train.sum() == cut and test.sum() == len(y) - cut
        np.testing.assert_array_equal(ds.x_train[train], x[order[:cut]].astype(np.float32))
        np.testing.assert_array_equal(ds.y_test[test], y[order[cut:]])
    default = load_dataset("synthetic", seed=1, num_users=6)
    assert default.groups_test is None and len(default.y_test) == 0  # the default generator is unchanged


def test_natural_test_gives_every_client_its_own_users_test_samples():
    groups_train = np.array([0, 0, 1, 2, 2])
    groups_test = np.array([2, 0, 1, 1, 0])
    parts = [np.array([2]), np.array([0, 1]), np.array([], np.int64), np.array([3, 4])]
    out = natural_test(groups_train, parts, groups_test)
    assert [o.tolist() for o in out] == [[2, 3], [1, 4], [], [0]]
    with pytest.raises(DataError, match="one user's samples"):
        natural_test(groups_train, [np.array([0, 2])], groups_test)


def synthetic_config(tmp_path, **partition):
    return build_config(
        {
            "run": {"out_dir": str(tmp_path)},
            "dataset": {"name": "synthetic", "generator": "fedbc", "seed": 1, "num_users": 8},
            "partition": {"name": "natural", "num_clients": 8, "local_test": "natural", **partition},
            "model": {"name": "logreg"},
        }
    )


def test_a_federation_with_natural_local_tests_is_the_fedbc_protocol(tmp_path):
    fed = build_federation(synthetic_config(tmp_path))
    ds = load_dataset("synthetic", generator="fedbc", seed=1, num_users=8)
    for user, client in enumerate(fed.clients):
        assert len(client.y) == (ds.groups_train == user).sum() and len(client.y_test) == (ds.groups_test == user).sum()
    assert len(fed.y_test) == sum(len(c.y_test) for c in fed.clients)  # the global test set: the users' union


def test_natural_local_tests_need_a_per_user_split_and_the_natural_partition(tmp_path):
    raw = synthetic_config(tmp_path).model_dump()
    raw["dataset"]["generator"] = "default"
    with pytest.raises(ConfigError, match="per-user test split"):
        build_federation(build_config(raw))
    with pytest.raises(ConfigError, match="needs partition.name='natural'"):
        build_config({**raw, "partition": {"name": "iid", "num_clients": 8, "local_test": "natural"}})
    with pytest.raises(ConfigError, match="cannot be combined"):
        build_config({**raw, "partition": {**raw["partition"], "local_test_fraction": 0.2}})

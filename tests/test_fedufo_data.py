"""FedUFO's data and models: per-class shards (each class cut into the same number of shards), local test data
dealt like the training data (reading 12 of notes/fedufo.md), and the 2NN / 64-wide CNN, checked by hand."""

from __future__ import annotations

import numpy as np
import pytest

from fedhet.data.partition import label_counts, match_test, partition
from fedhet.data.types import DataError
from fedhet.engine.simulation import build_federation
from fedhet.errors import ConfigError
from fedhet.models import build_model


def test_every_class_is_cut_into_the_same_number_of_equal_shards():
    # classes of 100, 120, ..., 280 samples: 20 shards each of 5, 6, ..., 14 samples, 2 shards per client
    labels = np.concatenate([np.full(100 + 20 * c, c) for c in range(10)])
    parts = partition("shards", labels, 100, seed=3, shards_per_client=2, shards_per_class=20)
    counts = label_counts(labels, parts, 10)
    shard = (100 + 20 * np.arange(10)) // 20
    for row in counts:
        held = np.flatnonzero(row)
        assert 1 <= len(held) <= 2
        assert row[held].sum() in {shard[held].sum(), 2 * shard[held[0]]}  # two classes, or one class twice
    assert (counts // shard).sum() == 200  # 200 shards dealt, each of its class's shard size
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(len(labels)))


def test_per_class_shards_must_add_up_to_the_clients_shards():
    labels = np.repeat(np.arange(10), 50)
    with pytest.raises(DataError, match=r"shards_per_class=20 x 10 classes = 200 shards.*= 100"):
        partition("shards", labels, 50, seed=0, shards_per_client=2, shards_per_class=20)


def test_test_data_are_dealt_in_proportion_to_the_training_holdings():
    train_counts = np.array([[4, 0], [2, 2], [0, 6]])
    labels_test = np.array([0] * 6 + [1] * 4)
    parts = match_test(labels_test, train_counts, np.random.default_rng(0))
    got = label_counts(labels_test, parts, 2)
    # class 0: 6 samples in the ratio 4:2 -> 4, 2; class 1: 4 samples in the ratio 2:6 -> 1, 3
    assert got.tolist() == [[4, 0], [2, 1], [0, 3]]
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(10))


def test_matched_local_test_data_follow_each_clients_classes(tiny_config):
    cfg = tiny_config(
        partition={
            "name": "shards",
            "num_clients": 10,
            "shards_per_client": 2,
            "shards_per_class": 2,
            "local_test": "matched",
        }
    )
    fed = build_federation(cfg)
    seen = []
    for c in fed.clients:
        assert set(c.y_test.tolist()) <= set(c.y.tolist())
        assert len(c.y_test) > 0
        seen.append(len(c.y_test))
    assert sum(seen) == len(fed.y_test)  # the whole official test set, dealt once; it stays the global test set
    assert fed.test_source == "official"


def test_matched_local_test_data_refuse_a_split_as_well(tiny_config):
    with pytest.raises(ConfigError, match="local_test='matched'"):
        tiny_config(partition={"local_test": "matched", "local_test_fraction": 0.2})


def test_the_2nn_and_the_64_wide_cnn_have_the_papers_sizes():
    two_nn = build_model("mlp", (1, 28, 28), 10)  # McMahan et al.'s 2NN: 784-200-200-10
    assert two_nn.embedding_dim == 200
    assert sum(p.numel() for p in two_nn.parameters()) == 784 * 200 + 200 + 200 * 200 + 200 + 200 * 10 + 10
    cnn = build_model("cnn", (3, 32, 32), 10, hidden=[384, 64])
    assert cnn.embedding_dim == 64
    conv = (3 * 25 * 64 + 64) + (64 * 25 * 64 + 64)
    fc = (64 * 5 * 5 * 384 + 384) + (384 * 64 + 64) + (64 * 10 + 10)
    assert sum(p.numel() for p in cnn.parameters()) == conv + fc
    assert build_model("cnn", (3, 32, 32), 10).embedding_dim == 192  # the default stays FedRoD/FedNH's

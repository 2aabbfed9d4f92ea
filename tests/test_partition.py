import time

import numpy as np
import pytest

from fedhet.data.partition import PARTITIONERS, label_counts, partition, weighted_draw
from fedhet.data.types import DataError
from fedhet.errors import ConfigError

NUM_CLASSES = 10


def make_labels(n=2000, seed=0):
    """Slightly unbalanced labels, as real datasets have."""
    probs = np.linspace(1.0, 2.0, NUM_CLASSES)
    return np.random.default_rng(seed).choice(NUM_CLASSES, n, p=probs / probs.sum())


LABELS = make_labels()
GROUPS = np.random.default_rng(1).integers(0, 40, len(LABELS))

# (partitioner, params) for every partitioner that must cover every sample exactly once.
COVERING = [
    ("iid", {}),
    ("dirichlet", {"alpha": 0.3}),
    ("balanced_dirichlet", {"alpha": 0.1}),
    ("shards", {"shards_per_client": 2}),
    ("k_classes", {"k": 3}),
    ("quantity_lognormal", {"sigma": 1.5}),
    ("power_law", {"exponent": 1.2, "classes_per_client": 2}),
    ("natural", {}),
]


def run(name, params, num_clients=20, seed=0, labels=LABELS, groups=GROUPS):
    return partition(name, labels, num_clients, seed, groups=groups, **params)


def test_every_partitioner_is_tested():
    # Flower Datasets' (flwr.*) are tested against flwr-datasets itself in tests/test_flwr_partition.py, and a saved
    # partition ("file") in tests/test_partition_file.py
    ours = [name for name in PARTITIONERS.names() if not name.startswith("flwr.") and name != "file"]
    assert sorted(name for name, _ in COVERING) == ours


@pytest.mark.parametrize(("name", "params"), COVERING)
def test_covers_every_sample_once_with_sorted_int64_arrays(name, params):
    num_clients = 40 if name == "natural" else 20
    parts = run(name, params, num_clients)
    assert len(parts) == num_clients
    for part in parts:
        assert part.dtype == np.int64
        assert len(part) > 0
        assert np.all(np.diff(part) > 0)
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(len(LABELS)))


@pytest.mark.parametrize(("name", "params"), COVERING)
def test_same_seed_same_split_other_seed_other_split(name, params):
    num_clients = 10  # below the 40 groups, so natural draws a random subset too
    first, again = run(name, params, num_clients, seed=3), run(name, params, num_clients, seed=3)
    other = run(name, params, num_clients, seed=4)
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other, strict=True))


@pytest.mark.parametrize(("name", "params"), COVERING)
def test_unknown_parameter_names_the_valid_ones(name, params):
    with pytest.raises(ConfigError, match=r"unknown key 'partition.bogus' for partitioner") as info:
        run(name, {**params, "bogus": 1})
    for field in PARTITIONERS.get(name).params.model_fields:
        assert field in str(info.value)


@pytest.mark.parametrize(
    ("name", "params", "key"),
    [
        ("dirichlet", {"alpha": 0}, "alpha"),
        ("dirichlet", {"alpha": -1.0}, "alpha"),
        ("dirichlet", {"min_size": 0}, "min_size"),
        ("balanced_dirichlet", {"alpha": 0.0}, "alpha"),
        ("shards", {"shards_per_client": 0}, "shards_per_client"),
        ("k_classes", {"k": 0}, "k"),
        ("quantity_lognormal", {"sigma": -1}, "sigma"),
        ("power_law", {"exponent": 0.5}, "exponent"),
        ("power_law", {"classes_per_client": 0}, "classes_per_client"),
        ("dirichlet", {"alpha": "lots"}, "alpha"),
    ],
)
def test_bad_parameter_values_are_config_errors(name, params, key):
    with pytest.raises(ConfigError, match=rf"partitioner '{name}': {key}:"):
        run(name, params)


@pytest.mark.parametrize(("name", "params"), COVERING)
def test_more_clients_than_samples_is_a_data_error(name, params):
    labels = LABELS[:30]
    with pytest.raises(DataError):
        run(name, params, num_clients=31, labels=labels, groups=GROUPS[:30])


def test_zero_clients_is_a_config_error():
    with pytest.raises(ConfigError, match="at least 1"):
        run("iid", {}, num_clients=0)


def test_unknown_partitioner_lists_choices():
    with pytest.raises(ConfigError, match="dirichlet.*iid"):
        run("nope", {})


def test_labels_must_be_integers():
    with pytest.raises(DataError, match="integer"):
        partition("iid", LABELS.astype(float), 5, 0)


def test_label_counts_matches_bincount():
    parts = run("dirichlet", {"alpha": 0.5}, 5)
    counts = label_counts(LABELS, parts, NUM_CLASSES)
    assert counts.shape == (5, NUM_CLASSES)
    assert counts.dtype == np.int64
    assert np.array_equal(counts.sum(axis=0), np.bincount(LABELS, minlength=NUM_CLASSES))
    assert np.array_equal(counts[2], np.bincount(LABELS[parts[2]], minlength=NUM_CLASSES))


def test_iid_sizes_differ_by_at_most_one():
    sizes = [len(p) for p in run("iid", {}, 7)]
    assert max(sizes) - min(sizes) <= 1


def mean_label_distance(parts, labels=LABELS):
    """Average total-variation distance between each client's label mix and the global one."""
    counts = label_counts(labels, parts, NUM_CLASSES)
    local = counts / counts.sum(axis=1, keepdims=True)
    overall = np.bincount(labels, minlength=NUM_CLASSES) / len(labels)
    return float(np.abs(local - overall).sum(axis=1).mean() / 2)


def test_dirichlet_small_alpha_is_more_skewed_than_large_alpha():
    skewed = mean_label_distance(run("dirichlet", {"alpha": 0.1, "min_size": 1}, 10))
    mild = mean_label_distance(run("dirichlet", {"alpha": 100.0}, 10))
    assert skewed > 0.5
    assert mild < 0.1


def test_dirichlet_honours_min_size():
    parts = run("dirichlet", {"alpha": 0.2, "min_size": 40}, 20)
    assert min(len(p) for p in parts) >= 40


def test_dirichlet_min_size_beyond_the_data_fails_at_once():
    with pytest.raises(DataError, match="20 clients x 200"):
        run("dirichlet", {"min_size": 200}, 20)


def test_dirichlet_unreachable_min_size_fails_quickly_with_advice():
    labels = np.repeat(np.arange(5), 50)
    start = time.perf_counter()
    with pytest.raises(DataError) as info:
        run("dirichlet", {"alpha": 0.001, "min_size": 20}, 10, labels=labels, groups=None)
    assert time.perf_counter() - start < 5
    message = str(info.value)
    for fragment in ("alpha=0.001", "num_clients=10", "min_size=20", "smallest client", "larger alpha"):
        assert fragment in message


def test_balanced_dirichlet_gives_equal_sizes_and_skewed_labels():
    sizes = {len(p) for p in run("balanced_dirichlet", {"alpha": 0.05}, 20)}
    assert sizes == {len(LABELS) // 20}
    uneven = [len(p) for p in run("balanced_dirichlet", {"alpha": 0.05}, 7)]
    assert max(uneven) - min(uneven) == 1
    assert mean_label_distance(run("balanced_dirichlet", {"alpha": 0.05}, 20)) > 0.5


def test_weighted_draw_tops_up_uniformly_when_weights_run_out():
    weights = np.zeros(10)
    weights[[2, 7]] = [0.5, 0.1]
    free = np.ones(10, bool)
    free[[0, 1]] = False
    chosen = weighted_draw(weights, free, 5, np.random.default_rng(0))
    assert len(set(chosen.tolist())) == 5
    assert {2, 7} <= set(chosen.tolist())
    assert not {0, 1} & set(chosen.tolist())


def test_weighted_draw_prefers_heavy_weights():
    weights = np.array([100.0] * 5 + [0.001] * 95)
    chosen = weighted_draw(weights, np.ones(100, bool), 5, np.random.default_rng(0))
    assert set(chosen.tolist()) == set(range(5))


@pytest.mark.parametrize("per_client", [1, 2, 3])
def test_shards_give_each_client_at_most_its_shard_count_of_classes(per_client):
    parts = run("shards", {"shards_per_client": per_client}, 20)
    classes = (label_counts(LABELS, parts, NUM_CLASSES) > 0).sum(axis=1)
    assert classes.max() <= per_client
    assert classes.min() >= 1


def test_shards_need_at_least_one_shard_per_class():
    with pytest.raises(DataError, match="cannot keep 10 classes apart"):
        run("shards", {"shards_per_client": 2}, 4)


@pytest.mark.parametrize("k", [1, 2, 5])
def test_k_classes_gives_exactly_k_classes_and_uses_every_class(k):
    parts = run("k_classes", {"k": k}, 20)
    counts = label_counts(LABELS, parts, NUM_CLASSES)
    assert np.all((counts > 0).sum(axis=1) == k)
    assert np.all(counts.sum(axis=0) > 0)


def test_k_classes_rejects_k_that_cannot_cover_all_classes():
    with pytest.raises(DataError, match="k=2 with 4 clients"):
        run("k_classes", {"k": 2}, 4)
    with pytest.raises(DataError, match="k <= 10"):
        run("k_classes", {"k": 11}, 4)


def test_quantity_lognormal_skews_sizes_not_labels():
    parts = run("quantity_lognormal", {"sigma": 1.0, "min_size": 15}, 20)
    sizes = np.array([len(p) for p in parts])
    assert sizes.min() >= 15
    assert sizes.std() / sizes.mean() > 0.3
    flat = run("quantity_lognormal", {"sigma": 0.01}, 20)
    assert np.ptp([len(p) for p in flat]) <= 0.05 * len(LABELS) / 20
    big = [p for p in parts if len(p) >= 100]
    assert mean_label_distance(big) < 0.2


def test_power_law_sizes_fall_geometrically_and_most_clients_have_c_classes():
    labels = np.repeat(np.arange(NUM_CLASSES), 600)
    parts = run("power_law", {"exponent": 1.2, "classes_per_client": 2}, 20, labels=labels, groups=None)
    sizes = np.array([len(p) for p in parts])
    assert np.all(np.diff(sizes) <= 0)
    ratios = sizes[1:-1] / sizes[2:]  # the largest client also takes most of the leftovers
    assert np.allclose(ratios, 1.2, atol=0.06)
    classes = (label_counts(labels, parts, NUM_CLASSES) > 0).sum(axis=1)
    assert np.bincount(classes).argmax() == 2
    assert np.mean(classes == 2) >= 0.5


def test_power_law_with_exponent_one_gives_equal_targets():
    labels = np.repeat(np.arange(NUM_CLASSES), 100)
    params = {"exponent": 1.0, "classes_per_client": 1}
    sizes = [len(p) for p in run("power_law", params, 10, labels=labels, groups=None)]
    assert sizes == [100] * 10


def test_natural_follows_groups():
    parts = run("natural", {}, 40)
    for client, part in enumerate(parts):
        assert np.all(GROUPS[part] == client)
        assert np.array_equal(part, np.flatnonzero(client == GROUPS))


def test_natural_subset_keeps_whole_groups_in_sorted_order():
    parts = run("natural", {}, 5, seed=7)
    chosen = [int(GROUPS[p[0]]) for p in parts]
    assert chosen == sorted(chosen)
    for group, part in zip(chosen, parts, strict=True):
        assert np.array_equal(part, np.flatnonzero(group == GROUPS))


def test_natural_needs_groups_and_enough_of_them():
    with pytest.raises(DataError, match="natural groups"):
        run("natural", {}, 5, groups=None)
    with pytest.raises(DataError, match="40 groups, fewer than 41"):
        run("natural", {}, 41)


def test_groups_must_match_labels():
    with pytest.raises(DataError, match="groups of shape"):
        run("natural", {}, 5, groups=GROUPS[:10])

"""Feature-distribution skew (data/features.py): NIID-Bench's noise, transformed domains, natural domains; their
per-domain metrics; and a run of every algorithm on skewed features."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedhet.algorithms import ALGORITHMS
from fedhet.data.features import assign_domains, blur, contrast, feature_skew, hue, invert, rotate
from fedhet.data.federated import federate
from fedhet.data.types import ArrayDataset, DataError
from fedhet.engine.simulation import Simulation
from fedhet.errors import ConfigError
from fedhet.results.store import read_metrics
from fedhet.toolkit.evaluate import domain_acc


def images(n_train=40, n_test=12, channels=1, size=6, seed=0, **extra) -> ArrayDataset:
    rng = np.random.default_rng(seed)
    return ArrayDataset(
        name="toy",
        x_train=rng.random((n_train, channels, size, size), dtype=np.float32),
        y_train=rng.integers(0, 3, n_train),
        x_test=rng.random((n_test, channels, size, size), dtype=np.float32),
        y_test=rng.integers(0, 3, n_test),
        num_classes=3,
        input_shape=(channels, size, size),
        **extra,
    )


def table(n_train=400, dim=5) -> ArrayDataset:
    rng = np.random.default_rng(1)
    x = np.zeros((n_train, dim), np.float32)  # zero inputs: what a client holds is its noise alone
    return ArrayDataset("tab", x, rng.integers(0, 2, n_train), x[:10], np.zeros(10, np.int64), 2, (dim,), "tabular")


def split(n: int, clients: int) -> list[np.ndarray]:
    return [np.arange(n)[i::clients] for i in range(clients)]


# ----------------------------------------------------------------------------------------------------------
# noise


def test_noise_std_grows_with_the_client_index_and_is_fixed_per_sample():
    ds, n = table(n_train=4000), 4
    skew = feature_skew("noise", ds, n, sigma=0.8)
    fed = federate(ds, split(4000, n), local_test_fraction=0.25, seed=3, skew=skew)
    for i, client in enumerate(fed.clients):
        expected = 0.8 * (i + 1) / n  # NIID-Bench: party i of N (1-based) gets std sigma * i / N
        assert float(client.x.std()) == pytest.approx(expected, rel=0.05)
        assert float(client.x_test.std()) == pytest.approx(expected, rel=0.1)
        assert not torch.equal(client.x[: len(client.x_test)], client.x_test)  # its own draw for the test split
    again = federate(ds, split(4000, n), local_test_fraction=0.25, seed=3, skew=skew)
    assert all(
        torch.equal(a.x, b.x) and torch.equal(a.x_test, b.x_test)
        for a, b in zip(fed.clients, again.clients, strict=True)
    )
    other = federate(ds, split(4000, n), local_test_fraction=0.25, seed=4, skew=skew)
    assert not torch.equal(fed.clients[0].x, other.clients[0].x)
    assert fed.test_domains is None and fed.domain_names == ()


def test_noise_leaves_the_official_test_set_clean():
    ds = images(channels=1)
    fed = federate(ds, split(40, 4), seed=0, skew=feature_skew("noise", ds, 4))
    plain = federate(ds, split(40, 4), seed=0)
    assert torch.equal(fed.x_test, plain.x_test)
    assert not torch.equal(fed.clients[3].x, plain.clients[3].x)


@pytest.mark.parametrize("merged", [False, True])
def test_noise_reaches_the_global_test_set_when_it_is_the_union_of_local_splits(merged):
    """docs/non-iid.md: clean only as the dataset's own test set. Without one, or merged into the training data,
    the global test set is the clients' local test splits, each with its own client's noise."""
    ds = table(n_train=4000)  # zero inputs: what a sample holds is its noise alone
    if not merged:  # the same data without a test set
        ds = ArrayDataset("tab", ds.x_train, ds.y_train, ds.x_train[:0], ds.y_train[:0], 2, (5,), "tabular")
    parts = split(len(ds.y_train) + (len(ds.y_test) if merged else 0), 4)
    fed = federate(ds, parts, local_test_fraction=0.25, merged=merged, seed=0, skew=feature_skew("noise", ds, 4))
    assert fed.test_source == "local-union"
    assert torch.equal(fed.x_test, torch.cat([c.x_test for c in fed.clients]))
    last = fed.x_test[-len(fed.clients[-1].y_test) :]  # the last client's share: std sigma = 0.1, not 0
    assert float(last.std()) == pytest.approx(0.1, rel=0.1)


# ----------------------------------------------------------------------------------------------------------
# domains


def test_domains_are_assigned_in_blocks_or_round_robin():
    assert assign_domains(10, 4, "blocks") == (0, 0, 0, 1, 1, 2, 2, 2, 3, 3)
    assert assign_domains(6, 4, "round_robin") == (0, 1, 2, 3, 0, 1)


def test_rotated_domains_transform_clients_and_score_the_test_set_once_per_domain():
    ds = images(n_train=40, n_test=12)
    skew = feature_skew("rotation", ds, 4, domains=4)
    fed = federate(ds, split(40, 4), local_test_fraction=0.25, seed=0, skew=skew)
    plain = federate(ds, split(40, 4), local_test_fraction=0.25, seed=0)
    for i, (client, base) in enumerate(zip(fed.clients, plain.clients, strict=True)):
        # client i is in domain i (blocks of one): its images turned by i quarter turns
        # normalisation is per channel, so it commutes with a quarter turn
        assert torch.equal(client.x, torch.rot90(base.x, i, dims=(-2, -1)))
        assert torch.equal(client.y, base.y)
    assert fed.client_domains == (0, 1, 2, 3) and fed.domain_names == ("0", "1", "2", "3")
    assert len(fed.y_test) == 4 * 12 and fed.test_domains.tolist() == [k for k in range(4) for _ in range(12)]
    assert torch.equal(fed.x_test[:12], plain.x_test)
    assert torch.equal(fed.x_test[12:24], torch.rot90(plain.x_test, 1, dims=(-2, -1)))


def test_a_client_in_domain_k_holds_its_samples_turned_k_quarters():
    ds = images(n_train=8, n_test=4, size=5)
    parts = [np.arange(4), np.arange(4, 8)]
    fed = federate(ds, parts, seed=0, skew=feature_skew("rotation", ds, 2, domains=2))  # half turns
    plain = federate(ds, parts, seed=0)
    assert torch.equal(fed.clients[1].x, torch.rot90(plain.clients[1].x, 2, dims=(-2, -1)))


@pytest.mark.parametrize("name", ["rotation", "contrast", "blur", "colour"])
def test_more_domains_than_clients_is_one_line_giving_the_bound(name):
    ds = images(channels=3)
    with pytest.raises(ConfigError) as err:
        feature_skew(name, ds, 4, domains=5)
    assert str(err.value) == (
        "features.domains=5 is more than the 4 clients (partition.num_clients): every domain is some client's; "
        "use at most 4 domains"
    )


def test_a_million_domains_is_refused_before_the_test_set_is_copied(tiny_config):
    with pytest.raises(ConfigError, match=r"features.domains=1000000 is more than the 6 clients"):
        Simulation(tiny_config(features={"name": "rotation", "domains": 1_000_000}))


def test_domain_transforms_by_hand():
    x = torch.tensor([[[[0.0, 1.0], [0.5, 0.5]]]])  # mean 0.5
    torch.testing.assert_close(contrast(x, 1, 2, {"min_contrast": 0.2}), torch.tensor([[[[0.4, 0.6], [0.5, 0.5]]]]))
    torch.testing.assert_close(contrast(x, 2, 5, {"min_contrast": 0.2}), 0.5 + 0.6 * (x - 0.5))  # f = 1 - 2 * 0.8 / 4
    torch.testing.assert_close(invert(x, 1, 2, {}), torch.tensor([[[[1.0, 0.0], [0.5, 0.5]]]]))
    flat = torch.full((1, 2, 7, 7), 0.3)
    torch.testing.assert_close(blur(flat, 3, 4, {"max_sigma": 2.0}), flat)  # a blur keeps a constant image
    point = torch.zeros(1, 1, 9, 9)
    point[0, 0, 4, 4] = 1.0
    out = blur(point, 1, 2, {"max_sigma": 1.0})[0, 0]
    g = [math.exp(-0.5 * t * t) for t in range(-3, 4)]
    expected = torch.tensor(g) / sum(g)  # radius ceil(3 sigma) = 3, the separable kernel's outer product
    torch.testing.assert_close(out[4, 1:8], expected * expected[3])
    torch.testing.assert_close(out.sum(), torch.tensor(1.0))
    rgb = torch.rand(2, 3, 4, 4)
    torch.testing.assert_close(hue(rgb, 0, 3, {}), rgb)
    # a third of a turn about the grey axis carries red to green, green to blue, blue to red
    torch.testing.assert_close(hue(rgb, 1, 3, {}), rgb[:, [2, 0, 1]], atol=1e-6, rtol=0)


def test_rotation_by_other_angles_is_rigid_and_keeps_the_centre():
    x = torch.zeros(1, 1, 7, 9)
    x[0, 0, 3, 4] = 1.0  # the centre pixel of a non-square image stays where it is under any rotation
    out = rotate(x, 1, 8, {})  # 45 degrees
    assert float(out[0, 0, 3, 4]) == pytest.approx(1.0)
    ring = torch.zeros(1, 1, 9, 9)
    ring[0, 0, 4, 6] = 1.0  # two pixels right of the centre of a square image
    assert torch.equal(rotate(ring, 1, 4, {}), torch.rot90(ring, 1, dims=(-2, -1)))
    eighth = rotate(ring, 1, 8, {})  # 45 degrees the same way as the quarter turn: up and right of the centre
    assert float(eighth[0, 0, :4, 5:].sum()) > 0.9


def test_per_domain_accuracy_and_the_worst_domain():
    ds = images(n_train=40, n_test=4)
    fed = federate(ds, split(40, 4), seed=0, skew=feature_skew("invert", ds, 4))
    hits = np.array([1, 1, 1, 0, 1, 0, 0, 0], bool)  # 4 test samples in each of the two domains
    assert domain_acc(hits, fed) == {
        "test_acc/domain/0": 0.75,
        "test_acc/domain/1": 0.25,
        "test_acc/domain/worst": 0.25,
    }
    plain = federate(ds, split(40, 4), seed=0)
    assert domain_acc(hits[:4], plain) == {}


def test_domains_on_a_dataset_without_a_test_set_score_the_union_of_local_splits():
    ds = images(n_train=40, n_test=0)
    fed = federate(ds, split(40, 4), local_test_fraction=0.25, seed=0, skew=feature_skew("invert", ds, 4))
    assert fed.test_source == "local-union"
    assert torch.equal(fed.x_test, torch.cat([c.x_test for c in fed.clients]))
    assert fed.test_domains.tolist() == [0] * 4 + [1] * 4  # 2 test samples each; clients 0-1 in domain 0


def test_natural_domains_come_from_the_dataset():
    ds = images(
        n_train=40,
        n_test=6,
        domains_train=np.arange(40) % 2,
        domains_test=np.array([0, 0, 1, 1, 1, 1]),
        domain_names=["paris", "lyon"],
    )
    skew = feature_skew("natural", ds, 4)
    fed = federate(ds, split(40, 4), seed=0, skew=skew)
    plain = federate(ds, split(40, 4), seed=0)
    assert torch.equal(fed.x_test, plain.x_test) and torch.equal(fed.clients[1].x, plain.clients[1].x)
    hits = np.array([1, 0, 1, 1, 1, 0], bool)
    assert domain_acc(hits, fed) == {
        "test_acc/domain/paris": 0.5,
        "test_acc/domain/lyon": 0.75,
        "test_acc/domain/worst": 0.5,
    }
    # train_subset keeps each kept sample's domain
    sub = ds.train_subset(0.5)
    assert len(sub.domains_train) == len(sub.y_train)


@pytest.mark.parametrize(
    ("name", "ds", "words"),
    [
        ("rotation", table(), "transforms images, and dataset 'tab' holds tabular inputs; for them use none, noise"),
        ("colour", images(channels=1), "needs 3-channel (RGB) images, and dataset 'toy' has 1"),
        ("natural", images(), "needs a dataset with a domain per sample, and 'toy' has none"),
    ],
)
def test_a_skew_that_does_not_fit_the_data_is_one_line(name, ds, words):
    with pytest.raises(DataError, match="features.name=") as err:
        feature_skew(name, ds, 4)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_domain_ids_are_checked_against_their_names():
    with pytest.raises(DataError, match=r"train domain ids outside \[0, 1\)"):
        images(domains_train=np.ones(40, np.int64), domains_test=np.zeros(12, np.int64), domain_names=["a"])
    with pytest.raises(DataError, match="domains need domains_train, domains_test and domain_names"):
        images(domains_train=np.zeros(40, np.int64))


def test_bad_settings_are_config_errors(tiny_config):
    with pytest.raises(ConfigError, match="did you mean 'rotation'"):
        Simulation(tiny_config(features={"name": "rotaton"}))
    with pytest.raises(ConfigError, match=r"feature skew 'rotation': domains: must be greater than or equal to 2"):
        Simulation(tiny_config(features={"name": "rotation", "domains": 1}))
    with pytest.raises(ConfigError, match=r"unknown key 'features.sigma' for feature skew 'rotation'"):
        Simulation(tiny_config(features={"name": "rotation", "sigma": 0.1}))


# ----------------------------------------------------------------------------------------------------------
# runs


def test_a_skewed_run_logs_per_domain_accuracy_and_resumes_bit_exact(tiny_config, kill_and_resume):
    def make(name):
        return tiny_config(
            run={"name": name, "rounds": 4, "checkpoint_every": 1},
            features={"name": "rotation", "domains": 3, "assign": "round_robin"},
            partition={"local_test_fraction": 0.2},
        )

    full, resumed = kill_and_resume(make)
    assert torch.equal(full.algo.global_params, resumed.algo.global_params)
    last = read_metrics(full.run_dir / "metrics.jsonl")[-1]
    domains = [last[f"test_acc/domain/{k}"] for k in range(3)]
    assert last["test_acc/domain/worst"] == min(domains)
    assert last["test_acc"] == pytest.approx(np.mean(domains))  # equal-sized copies of the test set


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ALGORITHMS.names())
@pytest.mark.parametrize("features", [{"name": "noise", "sigma": 0.2}, {"name": "rotation", "domains": 2}])
def test_every_algorithm_trains_on_skewed_features(tiny_config, algorithm, features):
    sim = Simulation(
        tiny_config(
            run={"rounds": 2},
            algorithm={"name": algorithm},
            features=features,
            partition={"local_test_fraction": 0.2},
        )
    )
    sim.run()
    last = read_metrics(sim.run_dir / "metrics.jsonl")[-1]
    assert last["round"] == 2 and math.isfinite(last["test_loss"])
    if features["name"] == "rotation":
        assert {"test_acc/domain/0", "test_acc/domain/1", "test_acc/domain/worst"} <= set(last)
    else:
        assert not any(key.startswith("test_acc/domain/") for key in last)

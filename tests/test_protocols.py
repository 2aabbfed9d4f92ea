"""FedACD's evaluation protocols, available to every algorithm (notes/fedacd.md 4.4-4.7): sampled client test sets
(Table 2), the local models' risk over all clients' distributions (Table 3) and their KL(P^m || Q) (Table 9)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from rich.console import Console
from sklearn.datasets import load_digits
from test_results import make_run

import fedhet
from fedhet.data.types import ArrayDataset, DataError
from fedhet.engine.batched import choose_executor
from fedhet.engine.simulation import Simulation, build_training
from fedhet.engine.training import build_federation
from fedhet.errors import ConfigError
from fedhet.results.report import group_runs, load_runs, print_table, summary_table, to_markdown
from fedhet.results.store import read_metrics
from fedhet.toolkit.confusion import probability_matrix, soft_confusion, template, template_kl
from fedhet.toolkit.evaluate import client_test_samples, local_risk, sampled_distribution_acc


class Identity(torch.nn.Module):
    """Inputs are the logits: probabilities are known by hand."""

    def forward(self, x):
        return x


def test_soft_confusion_is_the_mean_softmax_per_true_class():
    log = math.log
    # class 0: softmax (0.5, 0.25, 0.25) and (0.7, 0.2, 0.1); class 1: (0.1, 0.6, 0.3); class 2: no sample
    x = torch.tensor([[log(0.5), log(0.25), log(0.25)], [log(0.7), log(0.2), log(0.1)], [log(0.1), log(0.6), log(0.3)]])
    y = torch.tensor([0, 0, 1])
    sums, counts = soft_confusion(Identity(), x, y, 3, batch_size=2)
    p = probability_matrix(sums, counts)
    torch.testing.assert_close(p[0], torch.tensor([0.6, 0.225, 0.175], dtype=torch.float64))
    torch.testing.assert_close(p[1], torch.tensor([0.1, 0.6, 0.3], dtype=torch.float64))
    assert torch.isnan(p[2]).all() and counts.tolist() == [2.0, 1.0, 0.0]


def test_template_kl_by_hand():
    q = template(3, 0.9)
    torch.testing.assert_close(q.sum(1), torch.ones(3, dtype=torch.float64))
    assert q[0, 0] == 0.9 and q[0, 1] == pytest.approx(0.05)
    p = torch.tensor([[0.6, 0.3, 0.1], [0.0, 1.0, 0.0], [math.nan] * 3], dtype=torch.float64)
    row0 = 0.6 * log_ratio(0.6, 0.9) + 0.3 * log_ratio(0.3, 0.05) + 0.1 * log_ratio(0.1, 0.05)
    row1 = 1.0 * log_ratio(1.0, 0.9)  # zero entries add nothing (p log p -> 0)
    assert template_kl(p, 0.9) == pytest.approx((row0 + row1) / 2)  # the absent class's row is left out
    assert template_kl(p, 0.9, "sum") == pytest.approx(row0 + row1)
    assert math.isnan(template_kl(torch.full((2, 2), math.nan, dtype=torch.float64), 0.9))


def log_ratio(a: float, b: float) -> float:
    return math.log(a / b)


def test_local_risk_weights_each_client_equally():
    per_class_acc = np.array([0.9, 0.5, np.nan])  # class 2 is not in the test set
    label_dist = np.array([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])  # mean: (0.75, 0.25, 0)
    assert local_risk(per_class_acc, label_dist) == pytest.approx(0.1 * 0.75 + 0.5 * 0.25)
    # a client holding a class the test set lacks: the known classes' weights are renormalised
    assert local_risk(np.array([0.9, np.nan]), np.array([[0.5, 0.5]])) == pytest.approx(0.1)


def test_sampled_client_test_sets_follow_the_client_label_proportions():
    y_test = np.array([0] * 100 + [1] * 100 + [2] * 5)  # class 3 has no test sample
    label_dist = np.array([[1.0, 0, 0, 0], [0.5, 0.5, 0, 0], [0, 0, 0.5, 0.5], [0, 0, 0, 1.0]])
    sizes = np.array([50, 4000, 20, 10])
    samples = client_test_samples(y_test, label_dist, sizes, np.random.default_rng(0))
    assert len(samples[0]) == 50 and len(set(samples[0])) == 50 and (y_test[samples[0]] == 0).all()
    share = (y_test[samples[1]] == 0).mean()
    assert len(samples[1]) == 4000 and abs(share - 0.5) < 0.05  # 4000 > 200: drawn with replacement
    assert len(samples[2]) == 20 and (y_test[samples[2]] == 2).all()  # class 3's share goes to class 2
    assert len(samples[3]) == 0  # nothing of its classes to test on: left out of the mean
    again = client_test_samples(y_test, label_dist, sizes, np.random.default_rng(0))
    assert all(np.array_equal(a, b) for a, b in zip(samples, again, strict=True))
    hits = np.array([True, False, True, True])
    assert sampled_distribution_acc(hits, [np.array([0, 1]), np.array([2, 3]), np.array([], int)]) == 0.75


def test_one_client_local_model_is_the_global_model(tiny_config):
    """With one client and plain averaging the local model is the new global model, so its risk over the (single)
    client distribution is 1 - client_dist_acc, and its KL is the global model's on the client's data."""
    cfg = tiny_config(
        run={"rounds": 2, "eval_local_models": True, "client_dist_sampled": True},
        partition={"name": "iid", "num_clients": 1},
        train={"participation": 1.0},
    )
    sim = Simulation(cfg)
    sim.run()
    last = read_metrics(sim.run_dir / "metrics.jsonl")[-1]
    assert last["local_risk"] == pytest.approx(1 - last["client_dist_acc"], abs=1e-9)
    client = sim.fed.clients[0]
    sums, counts = soft_confusion(sim.model, client.x, client.y, client.num_classes, 1024)
    assert last["local_kl"] == pytest.approx(template_kl(probability_matrix(sums, counts), 1 - 1e-5), rel=1e-6)
    assert 0 < last["client_dist_acc_sampled"] <= 1


def test_local_model_diagnostics_change_no_result(tiny_config):
    plain = tiny_config(algorithm={"name": "scaffold"})
    watched = tiny_config(
        algorithm={"name": "scaffold"}, run={"name": "watched", "eval_local_models": True, "client_dist_sampled": True}
    )
    a, b = Simulation(plain), Simulation(watched)
    a.run(), b.run()
    ra, rb = read_metrics(a.run_dir / "metrics.jsonl"), read_metrics(b.run_dir / "metrics.jsonl")
    assert [r["test_acc"] for r in ra] == [r["test_acc"] for r in rb]
    assert torch.equal(a.algo.global_params, b.algo.global_params)
    assert all({"local_risk", "local_kl", "client_dist_acc_sampled"} <= set(r) for r in rb)
    assert not any("local_risk" in r for r in ra)
    assert 0 < rb[-1]["local_risk"] < 1 and rb[-1]["local_kl"] > 0


def test_local_model_diagnostics_keep_clients_sequential(tiny_config):
    cfg = tiny_config(run={"eval_local_models": True, "executor": "batched"})
    kind, why = choose_executor(cfg, build_training(cfg, Simulation(cfg).fed).runner)
    assert kind == "sequential" and "eval_local_models" in why


def test_train_fraction_is_a_stratified_subset_shared_by_every_seed():
    y = np.repeat(np.arange(3), [100, 50, 3])
    ds = ArrayDataset("toy", np.arange(153, dtype=np.float32)[:, None], y, y[:0, None] * 0.0, y[:0], 3, (1,))
    sub = ds.train_subset(0.1)
    assert np.bincount(sub.y_train).tolist() == [10, 5, 1]  # every class keeps at least one sample
    assert np.array_equal(sub.x_train, ds.train_subset(0.1).x_train)
    assert sub.provenance()["train_fraction"] == 0.1 and ds.train_subset(1.0) is ds


def test_dataset_classes_keep_those_classes_relabelled_in_the_order_given():
    y = np.array([0, 1, 2, 3, 2, 1, 3])
    yt = np.array([3, 0, 2, 1])
    x, xt = np.arange(7, dtype=np.float32)[:, None], 10 + np.arange(4, dtype=np.float32)[:, None]
    ds = ArrayDataset("toy", x, y, xt, yt, 4, (1,), class_names=["a", "b", "c", "d"], groups_train=y * 10)
    sub = ds.class_subset([3, 1])
    assert sub.x_train[:, 0].tolist() == [1, 3, 5, 6] and sub.y_train.tolist() == [1, 0, 1, 0]  # 3 -> 0, 1 -> 1
    assert sub.x_test[:, 0].tolist() == [10, 13] and sub.y_test.tolist() == [0, 1]
    assert sub.num_classes == 2 and sub.class_names == ["d", "b"] and sub.groups_train.tolist() == [10, 30, 10, 30]
    assert sub.provenance()["classes"] == [3, 1] and sub.content_hash == ds.content_hash  # the files read
    assert ds.class_subset(None) is ds
    with pytest.raises(DataError, match=r"^dataset.classes \[3, 4\]: 'toy' has classes 0-3, not 4$"):
        ds.class_subset([3, 4])


def test_a_run_on_some_classes_trains_and_tests_on_those_only(tmp_path):
    cfg = fedhet.make_config(
        None,
        {"dataset.name": "digits", "dataset.classes": [7, 2, 5], "partition.num_clients": 3, "run.rounds": 1},
        out=str(tmp_path),
    )
    fed = build_federation(cfg)
    digits = load_digits()
    kept = np.isin(digits.target, [7, 2, 5])
    assert fed.num_classes == 3 and sum(len(c.y) for c in fed.clients) + len(fed.y_test) == kept.sum()
    assert set(fed.y_test.tolist()) == {0, 1, 2}
    for bad, message in (([1], "two or more distinct"), ([2, 2], "two or more distinct"), ([-1, 3], "0 or more")):
        with pytest.raises(ConfigError, match=message):
            fedhet.make_config(None, {"dataset.classes": bad})
    summary = fedhet.run(cfg).summary
    assert summary["rounds_done"] == 1


def test_report_shows_the_protocol_columns_with_std(tmp_path):
    for seed, risk in enumerate([0.30, 0.34]):
        make_run(tmp_path, f"s{seed}", {"name": "fedacd"}, seed, [0.5, 0.6], local_risk=[0.5, risk], local_kl=[2, 1])
    [row] = summary_table(group_runs(load_runs([tmp_path])))
    markdown = to_markdown([row])
    assert "local-model risk" in markdown and "0.32 ± 0.02828" in markdown and "local KL(P||Q)" in markdown
    [risk_row] = summary_table(group_runs(load_runs([tmp_path])), metric="local_risk")
    assert risk_row.best_mean == pytest.approx(0.32)  # lower is better
    console = Console(record=True, width=250)
    print_table([row], console)
    assert "local-model risk" in console.export_text()

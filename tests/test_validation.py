"""Validation data (partition.validation_fraction): held out of each client's training share, deterministic from the
partition seed, disjoint from training and local test data; scored at every evaluation as val_* metrics."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from fedhet.data.federated import federate
from fedhet.data.types import ArrayDataset
from fedhet.errors import ConfigError
from fedhet.results.store import read_metrics
from fedhet.toolkit.evaluate import fairness, per_client_scores, validation_metrics


def indexed_dataset(n: int = 400) -> ArrayDataset:
    """Tabular data whose one feature is the sample's index, so a client's tensors say which samples it holds."""
    x = np.arange(n, dtype=np.float32)[:, None]
    y = np.arange(n) % 4
    return ArrayDataset("idx", x, y, x[:8], y[:8], 4, (1,), task="tabular")


def held(tensor: torch.Tensor | None) -> set[int]:
    return set() if tensor is None else {int(v) for v in tensor[:, 0].tolist()}


def split(validation: float, local_test: float = 0.2, seed: int = 3) -> list:
    parts = [np.arange(i, 400, 5) for i in range(5)]
    fed = federate(indexed_dataset(), parts, local_test_fraction=local_test, validation_fraction=validation, seed=seed)
    return fed.clients


def test_validation_is_held_out_of_training_and_leaves_the_local_test_split_as_it_was():
    before, after = split(0.0), split(0.25)
    for old, new in zip(before, after, strict=True):
        train, test, val = held(new.x), held(new.x_test), held(new.x_val)
        assert old.x_val is None and len(val) == round(0.25 * len(held(old.x)))
        assert held(new.x_test) == held(old.x_test)  # the local test split does not move
        assert train | val == held(old.x) and not train & val and not val & test
        assert torch.equal(new.y_val, new.x_val[:, 0].long() % 4)  # labels travel with their samples


def test_validation_split_follows_the_partition_seed():
    assert [held(c.x_val) for c in split(0.2)] == [held(c.x_val) for c in split(0.2)]
    assert [held(c.x_val) for c in split(0.2)] != [held(c.x_val) for c in split(0.2, seed=4)]


def test_validation_without_a_local_test_split():
    for client in split(0.1, local_test=0.0):
        assert client.x_test is None and len(held(client.x_val)) == 8


def test_validation_fraction_is_checked_by_the_config(tiny_config):
    assert tiny_config().partition.validation_fraction == 0.0
    with pytest.raises(ConfigError, match=r"partition.validation_fraction: must be less than 1"):
        tiny_config(partition={"validation_fraction": 1.0})


class Halves(torch.nn.Module):
    """Predicts class 0 for inputs below 200, else class 1."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([(x < 200).float(), (x >= 200).float(), torch.zeros(len(x), 2)], dim=1) * 5


def test_validation_metrics_aggregate_the_clients_scores_by_size():
    parts = [np.arange(0, 100), np.arange(100, 400)]
    fed = federate(indexed_dataset(), parts, validation_fraction=0.5, seed=0)
    model = Halves()
    out = validation_metrics(model, fed, batch_size=7)
    accs = [float(((c.x_val[:, 0] >= 200).long() == c.y_val).float().mean()) for c in fed.clients]
    sizes = np.array([len(c.y_val) for c in fed.clients])
    assert out["val_acc"] == pytest.approx(float(np.dot(accs, sizes) / sizes.sum()))
    logits = torch.cat([model(c.x_val) for c in fed.clients])
    labels = torch.cat([c.y_val for c in fed.clients])
    assert out["val_loss"] == pytest.approx(float(torch.nn.functional.cross_entropy(logits, labels)))
    spread = fairness(np.array(accs), fed.sizes)
    assert {k: out[f"val_{k}"] for k in spread} == pytest.approx(spread)
    assert validation_metrics(model, replace(fed, x_test=None, y_test=None), 7) == out  # no test data is read


def test_transductive_models_score_each_client_alone():
    data = [(torch.arange(6.0)[:, None] * 70, torch.tensor([0, 0, 0, 1, 1, 1])), (torch.zeros(0, 1), torch.zeros(0))]
    plain = per_client_scores(Halves(), data, 4, with_loss=True)
    model = Halves()
    model.transductive_batch = 4
    fixed = per_client_scores(model, data, 4, with_loss=True)
    for a, b in zip(plain, fixed, strict=True):
        assert a == pytest.approx(b)


def test_a_run_logs_validation_metrics_at_every_evaluation(tiny_config):
    from fedhet.engine.runs import build_simulation

    cfg = tiny_config(run={"rounds": 2, "eval_every": 1}, partition={"validation_fraction": 0.2})
    sim = build_simulation(cfg)
    sim.run()
    records = read_metrics(sim.run_dir / "metrics.jsonl")
    assert len(records) == 2
    for record in records:
        for key in ("val_acc", "val_loss", "val_client_acc_mean", "val_client_acc_min", "val_client_acc_worst10"):
            assert np.isfinite(record[key]), key
        assert list(record).index("val_acc") > list(record).index("test_acc")
    train = sum(len(c.y) for c in sim.fed.clients)
    val = sum(len(c.y_val) for c in sim.eval_fed.clients)
    assert val > 0 and sim.fed.sizes.sum() == train  # the aggregation weights count training samples only


def test_no_validation_keys_without_validation(tiny_config):
    from fedhet.engine.runs import build_simulation

    sim = build_simulation(tiny_config(run={"rounds": 1}))
    sim.run()
    assert not [k for k in read_metrics(sim.run_dir / "metrics.jsonl")[0] if k.startswith("val_")]

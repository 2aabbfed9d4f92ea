"""The tuner's objective (fedhet.results.objective): validation metrics only, never the test set."""

from __future__ import annotations

import math

import pytest
import torch

from fedhet.errors import ConfigError
from fedhet.results import direction, objective
from fedhet.results.store import MetricsLog, read_metrics


def write_log(folder, *records):
    log = MetricsLog(folder / "metrics.jsonl")
    for rnd, record in enumerate(records, start=1):
        log.append({"round": rnd, **record})
    return folder


@pytest.mark.parametrize("metric", ["test_acc", "test_loss", "client_acc_mean", "personal_acc_micro", "acc"])
def test_anything_but_a_validation_metric_is_refused(tmp_path, metric):
    write_log(tmp_path, {"test_acc": 0.9, "val_acc": 0.5})
    with pytest.raises(ConfigError, match=r"^tuning reads validation metrics only .*not '" + metric + "'"):
        objective(tmp_path, metric)


def test_last_and_best_with_the_metric_s_direction(tmp_path):
    write_log(
        tmp_path,
        {"val_acc": 0.4, "val_loss": 2.0},
        {"val_acc": 0.7, "val_loss": 0.9},
        {"val_acc": 0.6, "val_loss": 1.1},
    )
    assert objective(tmp_path) == 0.6
    assert objective(tmp_path, reduce="best") == 0.7
    assert objective(tmp_path, "val_loss", "best") == 0.9
    assert objective(tmp_path, reduce="last2") == pytest.approx(0.65)  # the mean of the last two evaluations
    assert objective(tmp_path, reduce="last5") == pytest.approx(1.7 / 3)  # all three where there are fewer
    assert (direction("val_acc"), direction("val_loss")) == ("maximize", "minimize")


def test_a_diverged_run_scores_nan_last_and_its_finite_best(tmp_path):
    write_log(tmp_path, {"val_loss": 1.5}, {"val_loss": float("nan")})  # stored as null
    assert math.isnan(objective(tmp_path, "val_loss"))
    assert objective(tmp_path, "val_loss", "best") == 1.5
    assert math.isnan(objective(tmp_path, "val_loss", "last2"))  # a diverged run's mean is NaN too


def test_a_run_without_validation_metrics_names_the_setting(tmp_path):
    write_log(tmp_path, {"test_acc": 0.9})
    with pytest.raises(ConfigError, match="partition.validation_fraction > 0"):
        objective(tmp_path)
    for bad in ("mean", "last1", "last0", "lastx"):
        with pytest.raises(ConfigError, match=rf"unknown reduce '{bad}'; choose 'last', 'best' or 'last<K>'"):
            objective(tmp_path, reduce=bad)


def test_the_objective_never_reads_the_test_set(tiny_config):
    """Two runs that differ only in their test set (the second one's is noise with wrong labels) get the same
    objective, while their test accuracies differ: the objective is blind to test data."""
    from fedhet.engine.runs import build_simulation
    from fedhet.engine.training import build_federation

    def run(name, poison):
        cfg = tiny_config(run={"rounds": 2, "name": name}, partition={"validation_fraction": 0.2})
        fed = build_federation(cfg)
        if poison:
            gen = torch.Generator().manual_seed(1)
            fed.x_test = torch.randn(fed.x_test.shape, generator=gen)
            fed.y_test = (fed.y_test + 1) % fed.num_classes
        sim = build_simulation(cfg, fed=fed)
        sim.run()
        return sim.run_dir

    clean, poisoned = run("clean", False), run("poisoned", True)
    for metric in ("val_acc", "val_loss", "val_client_acc_worst10"):
        for reduce in ("last", "best"):
            assert objective(clean, metric, reduce) == objective(poisoned, metric, reduce)
    accs = [read_metrics(folder / "metrics.jsonl")[-1]["test_acc"] for folder in (clean, poisoned)]
    assert accs[0] != accs[1] and accs[0] > 0.5


def test_personalised_models_are_scored_on_the_clients_validation_data_too(tiny_config):
    """SphereFed personalises to the global model itself, so with every client trained its clients' own models on
    their own validation data score what the global model scores there: val_personal_acc_micro == val_acc. FedRoD's
    personal heads score differently; both log the test-split numbers as before."""
    import fedhet

    everyone = {"participation": 1.0, "local_epochs": 1, "batch_size": 16, "lr": 0.1}
    splits = {"validation_fraction": 0.2, "local_test_fraction": 0.2}
    cfg = tiny_config(algorithm={"name": "spherefed"}, partition=splits, train=everyone, run={"rounds": 2})
    last = fedhet.run(cfg).records[-1]
    assert last["val_personal_acc_micro"] == pytest.approx(last["val_acc"], abs=1e-12)
    assert last["val_personal_acc_macro"] == pytest.approx(last["val_client_acc_mean"], abs=1e-12)
    assert "personal_acc_micro" in last and last["personal_clients"] == 6
    cfg = tiny_config(algorithm={"name": "fedrod"}, partition=splits, train=everyone, run={"rounds": 2})
    result = fedhet.run(cfg)
    last = result.records[-1]
    assert 0 <= last["val_personal_acc_micro"] <= 1
    assert last["val_personal_acc_macro"] != pytest.approx(last["val_client_acc_mean"], abs=1e-6)  # its own heads
    assert objective(result.run_dir, "val_personal_acc_micro") == last["val_personal_acc_micro"]
    no_val = tiny_config(algorithm={"name": "fedrod"}, partition={"local_test_fraction": 0.2}, train=everyone)
    assert not any(k.startswith("val_") for k in fedhet.run(no_val).records[-1])

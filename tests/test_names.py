"""Issue 27: default run folder names differ whenever the resolved configs differ, stay readable for the all-default
case, and a folder named the old way that holds exactly this config is still found (fedhet run --resume)."""

from __future__ import annotations

import json

import fedhet
from fedhet.api import run_dir_of


def name(**kw):
    return run_dir_of(fedhet.make_config(None, **kw)).name


def test_all_defaults_keep_the_readable_name():
    assert name(algorithm="scaffold") == "scaffold-fmnist-dirichlet-s0"


def test_server_optimiser_and_algorithm_parameters_change_the_name():
    plain = name(algorithm="scaffold")
    adam = name(algorithm="scaffold", server="fedadam")
    assert adam != plain and adam.startswith("scaffold-fmnist-dirichlet-s0-")
    mu = name(algorithm="fedprox", overrides={"algorithm.mu": 0.1})
    assert mu != name(algorithm="fedprox") and mu != name(algorithm="fedprox", overrides={"algorithm.mu": 0.5})
    assert name(overrides={"train.lr": 0.05}) != name()


def test_equal_resolved_configs_share_a_name():
    # a parameter set to its default is the same config; what a resume may change is not part of the name
    assert name(algorithm="fedprox", overrides={"algorithm.mu": 0.01}) == name(algorithm="fedprox")
    assert name(rounds=50) == name(rounds=20)
    assert name(overrides={"run.progress": False, "run.workers": 1}) == name()


def test_readme_run_then_run_both_work(tmp_path):
    """README: `run -a scaffold --server fedadam` then `run -a scaffold` no longer land in one folder."""
    setting = {
        "dataset": {"name": "digits"},
        "model": {"name": "mlp", "hidden": [8]},
        "partition": {"num_clients": 4},
        "run": {"rounds": 1, "out_dir": str(tmp_path), "progress": False},
    }
    first = fedhet.run(setting, algorithm="fedavg", server="fedadam")
    second = fedhet.run(setting, algorithm="fedavg")
    assert first.run_dir != second.run_dir


def test_an_old_folder_with_this_config_is_found(tmp_path):
    cfg = fedhet.make_config(None, algorithm="scaffold", server="fedadam", out=str(tmp_path))
    old = tmp_path / cfg.legacy_name()
    old.mkdir()
    from fedhet.engine.simulation import resolve_config

    (old / "config.json").write_text(json.dumps(resolve_config(cfg)))
    assert run_dir_of(cfg) == old  # fedhet run --resume continues it
    other = fedhet.make_config(None, algorithm="scaffold", out=str(tmp_path))
    # the plain config has no hash, so it names the old folder too; the engine refuses it as a different config
    assert run_dir_of(other) == old
    yogi = fedhet.make_config(None, algorithm="scaffold", server="fedyogi", out=str(tmp_path))
    assert run_dir_of(yogi) != old and run_dir_of(yogi).name.startswith(cfg.legacy_name() + "-")


def test_the_model_chosen_for_the_dataset_is_not_a_setting():
    """`-d digits` gets the MLP because the CNN cannot take 8x8 inputs: that default is no reason for a hash."""
    assert name(dataset="digits") == "fedavg-digits-dirichlet-s0"
    assert name(dataset="shakespeare") == "fedavg-shakespeare-dirichlet-s0"
    assert name(dataset="digits", model="mlp") == name(dataset="digits")  # the same config, named or not
    assert name(model="mlp").startswith("fedavg-fmnist-dirichlet-s0-")  # not fmnist's default: a setting
    lr = name(dataset="digits", overrides={"train.lr": 0.05})
    assert lr.startswith("fedavg-digits-dirichlet-s0-") and lr != "fedavg-digits-dirichlet-s0-e4bfbee6"


def _saved_run(folder, cfg):
    from fedhet.engine.simulation import resolve_config

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(resolve_config(cfg)))


def test_a_folder_whose_hash_counted_the_datasets_model_is_still_found(tmp_path):
    """Runs named while the model chosen for the dataset still counted as a setting resume under their names."""
    plain = fedhet.make_config(None, dataset="digits", out=str(tmp_path))
    _saved_run(tmp_path / "fedavg-digits-dirichlet-s0-7907eb87", plain)  # the hash of {"model.name": "mlp"}
    assert run_dir_of(plain).name == "fedavg-digits-dirichlet-s0-7907eb87"
    lr = fedhet.make_config(None, {"train.lr": 0.05}, dataset="digits", out=str(tmp_path))
    assert run_dir_of(lr).name != "fedavg-digits-dirichlet-s0-e4bfbee6"
    _saved_run(tmp_path / "fedavg-digits-dirichlet-s0-e4bfbee6", lr)
    assert run_dir_of(lr).name == "fedavg-digits-dirichlet-s0-e4bfbee6"
    # a folder of that old name holding another config is not this run's, and a run under the new name wins
    other = fedhet.make_config(None, {"train.lr": 0.05}, dataset="digits", seed=0, out=str(tmp_path / "b"))
    (tmp_path / "b").mkdir()
    _saved_run(tmp_path / "b" / "fedavg-digits-dirichlet-s0-e4bfbee6", plain)
    assert run_dir_of(other).name != "fedavg-digits-dirichlet-s0-e4bfbee6"
    _saved_run(tmp_path / "fedavg-digits-dirichlet-s0", plain)
    assert run_dir_of(plain).name == "fedavg-digits-dirichlet-s0"

"""Config validation: every bad input is one ConfigError line, and accepted nonsense is refused (issue 10)."""

from __future__ import annotations

import math
import types
import typing
from pathlib import Path

import pytest
import torch

from fedhet.algorithms import ALGORITHMS, SERVER_OPTIMIZERS
from fedhet.comparison import variant_raw
from fedhet.config import Config, build_config, load_config
from fedhet.data.datasets import DATASETS
from fedhet.data.partition import PARTITIONERS
from fedhet.engine.simulation import resolve_config
from fedhet.errors import ConfigError
from fedhet.models import MODELS

ROOT = Path(__file__).resolve().parents[1]
CONFIG_FILES = sorted([*ROOT.glob("src/fedhet/configs/*.toml"), *ROOT.glob("benchmarks/reproduce/**/*.toml")])
SECTIONS = {"dataset": DATASETS, "partition": PARTITIONERS, "model": MODELS, "algorithm": ALGORITHMS}
SECTIONS["server"] = SERVER_OPTIMIZERS


def check(raw: dict) -> dict:
    """What the CLI does before loading data: build the config, then validate every component's parameters."""
    return resolve_config(build_config(raw))


def refused(raw: dict, *needles: str) -> str:
    with pytest.raises(ConfigError) as info:
        check(raw)
    message = str(info.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message
    return message


def scalar_types(annotation) -> set[type]:
    """The scalar types an annotation admits (``float | None`` -> {float, NoneType}); containers are left out."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return scalar_types(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return set().union(*(scalar_types(a) for a in typing.get_args(annotation)))
    return {annotation} if isinstance(annotation, type) else set()


def fields_of(kind: type) -> list[tuple[str, dict, str]]:
    """(section, base raw config, key) for every field of that type: the fixed sections' own fields and every
    registered component's parameters."""
    out = []
    for section in ("run", "train", "partition", "dataset", "server"):
        for key, field in Config.model_fields[section].annotation.model_fields.items():
            if kind in scalar_types(field.annotation):
                out.append((section, {}, key))
    for section, registry in SECTIONS.items():
        for entry in registry.entries():
            for key, field in (entry.params.model_fields if entry.params else {}).items():
                if kind in scalar_types(field.annotation):
                    out.append((section, {"name": entry.name}, key))
    return out


FLOAT_FIELDS = fields_of(float)
INT_FIELDS = fields_of(int)


def ident(case):
    section, base, key = case
    return f"{section}.{base.get('name', '')}.{key}".replace("..", ".")


def test_the_field_lists_cover_every_kind_of_section():
    assert {s for s, _, _ in FLOAT_FIELDS} == {"run", "train", "partition", "dataset", "model", "algorithm", "server"}
    assert {s for s, _, _ in INT_FIELDS} >= {"run", "train", "partition", "dataset", "model", "algorithm"}


# ----------------------------------------------------------------------------------------------- non-finite floats


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, "inf", "nan"])
@pytest.mark.parametrize("case", FLOAT_FIELDS, ids=ident)
def test_every_float_field_refuses_infinity_and_nan(case, value):
    section, base, key = case
    refused({section: {**base, key: value}}, key)


def test_infinity_from_an_override_is_refused():
    with pytest.raises(ConfigError, match="train.lr: must be a finite number"):
        load_config(None, ["train.lr=1e999"])


def test_none_on_the_command_line_is_null_or_the_choice_named_none():
    cfg = load_config(None, ["train.augment=crop", "train.augment=none", "partition.seed=none"])
    assert cfg.train.augment == "none" and cfg.partition.seed is None
    resolved = resolve_config(load_config(None, ["algorithm.name=feddyn", "algorithm.alpha_scaling=none"]))
    assert resolved["algorithm"]["alpha_scaling"] == "none"


def test_toml_inf_and_nan_are_refused(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[train]\nweight_decay = inf\n")
    with pytest.raises(ConfigError, match="train.weight_decay: must be a finite number"):
        load_config(path)
    path.write_text("[algorithm]\nname = 'fedprox'\nmu = nan\n")
    with pytest.raises(ConfigError, match="algorithm 'fedprox': mu: must be a finite number"):
        resolve_config(load_config(path))


# -------------------------------------------------------------------------------------------- booleans as numbers


@pytest.mark.parametrize("value", [True, False])
@pytest.mark.parametrize("case", INT_FIELDS + FLOAT_FIELDS, ids=ident)
def test_a_boolean_is_not_a_number(case, value):
    section, base, key = case
    refused({section: {**base, key: value}}, key, "not a boolean", f"(got {value!r})")


@pytest.mark.parametrize(
    ("section", "values", "key"),
    [
        ("model", {"name": "mlp", "hidden": [32, True]}, "hidden"),
        ("model", {"name": "convnet", "channels": [True, 8]}, "channels"),
    ],
)
def test_a_boolean_inside_a_list_of_numbers_is_refused(section, values, key):
    refused({section: values}, key, "must be a list of integers, not booleans")


def test_rounds_true_from_the_command_line_is_refused():
    with pytest.raises(ConfigError, match=r"run.rounds: must be an integer, not a boolean \(got True\)"):
        load_config(None, ["run.rounds=true"])


def test_numbers_still_convert_where_they_should():
    resolved = check(
        {
            "train": {"lr": 1, "weight_decay": 0, "local_epochs": 2},  # ints for floats
            "model": {"name": "convnet", "channels": [8, 16]},  # a TOML array for a tuple
            "algorithm": {"name": "fedbc", "lambda_max": 2, "warm_start": True},
            "run": {"progress": False, "rounds": 3},
        }
    )
    assert resolved["train"]["lr"] == 1.0 and isinstance(resolved["train"]["lr"], float)
    assert resolved["model"]["channels"] == [8, 16]
    assert resolved["algorithm"]["lambda_max"] == 2.0 and resolved["algorithm"]["warm_start"] is True
    cfg = load_config(None, ["train.lr=1", "train.nesterov=false", "run.progress=true", "model.name=convnet"])
    assert cfg.train.lr == 1.0


# ------------------------------------------------------------------------------------------------------ seeds


@pytest.mark.parametrize("key", ["run.seed", "partition.seed"])
def test_negative_seeds_are_config_errors(key):
    with pytest.raises(ConfigError, match=rf"{key}: must be greater than or equal to 0 \(got -1\)"):
        load_config(None, [f"{key}=-1"])


def test_huge_seeds_are_fine():
    assert load_config(None, [f"run.seed={2**80}"]).run.seed == 2**80


# ----------------------------------------------------------------------------------------------------- device


def test_cpu_is_always_a_device():
    assert load_config(None, ["run.device=cpu"]).run.device == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_a_config_error_naming_the_choices():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["run.device=cuda"])
    assert str(info.value) == "run.device: not available on this machine; available here: cpu (got 'cuda')"


@pytest.mark.parametrize("device", ["tpu9", "CUDA", "gpu", "cuda:x", "meta", "cpu:1", ""])
def test_unknown_devices_are_config_errors(device):
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"run.device={device!r}"])
    assert str(info.value).startswith("run.device: ")
    assert "available here: cpu" in str(info.value)


def test_cuda_devices_are_checked_against_the_gpus_present(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert load_config(None, ["run.device=cuda"]).run.device == "cuda"
    assert load_config(None, ["run.device=cuda:1"]).run.device == "cuda:1"
    with pytest.raises(ConfigError, match=r"not available on this machine; available here: cpu, cuda, cuda:0, cuda:1 "):
        load_config(None, ["run.device=cuda:2"])


def test_a_config_for_another_machine_checks_the_device_name_only():
    """A Flower app folder is written here and run elsewhere: its device is checked where it runs."""
    assert load_config(None, ["run.device=cuda:3"], runs_here=False).run.device == "cuda:3"
    with pytest.raises(ConfigError, match="run.device"):
        load_config(None, ["run.device=tpu9"], runs_here=False)


# ----------------------------------------------------------------------------------------------- config files


def test_a_non_utf8_file_is_a_config_error(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes('[run]\nname = "caf\xe9"\n'.encode("latin-1"))
    with pytest.raises(ConfigError, match=r"is not UTF-8 text"):
        load_config(path)


def test_a_folder_is_not_a_config_file(tmp_path):
    with pytest.raises(ConfigError, match="is a folder, not a TOML file"):
        load_config(tmp_path)


def test_an_unreadable_file_is_a_config_error(tmp_path, monkeypatch):
    path = tmp_path / "c.toml"
    path.write_text("[run]\n")

    def denied(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "open", denied)
    monkeypatch.setattr(Path, "read_bytes", denied)
    with pytest.raises(ConfigError, match="cannot be read: Permission denied"):
        load_config(path)


def test_a_utf8_bom_is_accepted(tmp_path):
    path = tmp_path / "bom.toml"
    path.write_bytes(b"\xef\xbb\xbf[train]\nlr = 0.5\n")
    assert load_config(path).train.lr == 0.5


# ----------------------------------------------------------------------------------------------- names, paths


@pytest.mark.parametrize("name", ["", ".", "..", "../up", "a/b", "a\\b", "x\x00y", "tab\there", "[/]", "[bold]x"])
def test_a_run_name_must_be_a_plain_folder_name(name):
    """run.name is a folder under run.out_dir that --overwrite deletes: '' or '..' would delete far more."""
    refused({"run": {"name": name}}, "run.name: must be a plain folder name")


@pytest.mark.parametrize("name", ["a", "fedavg_fedadam-s0", "lr=0.1,mu=0.01", "résumé run"])
def test_ordinary_run_names_are_fine(name):
    assert check({"run": {"name": name}})["run"]["name"] == name


@pytest.mark.parametrize(("section", "key"), [("run", "out_dir"), ("dataset", "data_dir")])
def test_paths_with_a_nul_byte_are_refused(section, key):
    refused({section: {key: "runs\x00x"}}, f"{section}.{key}: must not contain a NUL character")


@pytest.mark.parametrize("dataset", ["synthetic", "shakespeare"])
def test_negative_dataset_seeds_are_config_errors(dataset):
    refused({"dataset": {"name": dataset, "seed": -1}}, "seed: must be greater than or equal to 0 (got -1)")


def test_a_component_must_build_on_the_shared_parameter_base():
    from pydantic import BaseModel

    from fedhet.registry import Registry

    class Loose(BaseModel):
        x: float = 1.0

    with pytest.raises(TypeError, match="must derive from fedhet.params.Params"):
        Registry("thing").register("loose", "parameters that would accept inf", Loose)


# ------------------------------------------------------------------------------------------------------ train


def test_nesterov_needs_momentum():
    with pytest.raises(ConfigError, match=r"train.nesterov=true needs train.momentum > 0 \(got momentum 0.0\)"):
        load_config(None, ["train.nesterov=true"])
    assert load_config(None, ["train.nesterov=true", "train.momentum=0.9"]).train.nesterov


# ---------------------------------------------------------------------------------------------- error messages


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["run.foo=1"], "unknown key 'run.foo'; valid keys in [run]: name, seed, rounds,"),
        (["run.foo.bar=1"], "unknown key 'run.foo'; valid keys in [run]: name, seed,"),
        (["foo.bar=1"], "unknown section 'foo'; valid sections: run, dataset, partition, features, model, train,"),
        (["run.seed.x=1"], "run.seed: must be an integer (got {'x': 1})"),
        (
            ["model.foo=1"],
            "unknown key 'model.foo' for model 'cnn'; valid keys in [model]: name, init, replace_head, freeze, "
            "lora_rank, lora_alpha, lora_dropout, lora_targets, lora_ranks, lora_ranks_by, head_bias",
        ),
        (["dataset.foo=1"], "unknown key 'dataset.foo' for dataset 'fmnist'; valid keys in [dataset]: name, data_dir,"),
        (
            ["partition.num_client=5"],
            "unknown key 'partition.num_client' for partitioner 'dirichlet'; valid keys in [partition]: name, "
            "num_clients, seed, local_test_fraction, validation_fraction, local_test, merge_test, alpha, min_size, "
            "max_tries",
        ),
        (["algorithm.foo=1"], "unknown key 'algorithm.foo' for algorithm 'fedavg'; valid keys in [algorithm]: name,"),
        (
            ["server.foo=1"],
            "unknown key 'server.foo' for server optimiser 'sgd'; valid keys in [server]: name, aggregation, "
            "gne_solver, gne_normalize, gne_jitter, trim_fraction, byzantine, multikrum_m, geomed_iters, geomed_eps, "
            "norm_bound, mode, buffer_size, concurrency, staleness, staleness_exponent, lora_aggregation, lr",
        ),
        (["dataset.name=tinyimagenet", "dataset.foo=1"], "unknown key 'dataset.foo' for dataset 'tinyimagenet'"),
    ],
)
def test_unknown_keys_name_their_section(overrides, expected):
    with pytest.raises(ConfigError) as info:
        resolve_config(load_config(None, overrides))
    assert expected in str(info.value)
    assert "valid keys in :" not in str(info.value) and "valid keys in []" not in str(info.value)


def test_unknown_keys_in_two_sections_list_both_sections():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["run.foo=1", "train.bar=2"])
    message = str(info.value)
    assert "unknown key 'run.foo'" in message and "unknown key 'train.bar'" in message
    assert "valid keys in [run]: name," in message and "valid keys in [train]: participation," in message


@pytest.mark.parametrize("override", ["run..x=1", ".x=1", "run.=1", " . =1"])
def test_override_keys_with_empty_parts_are_refused(override):
    with pytest.raises(ConfigError, match="has an empty part"):
        load_config(None, [override])


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (
            {"algorithm": {"name": "fedbc", "lambda_max": 0.1, "lambda_min": 1}},
            "algorithm 'fedbc': lambda_max=0.1 is below lambda_min=1.0",
        ),
        ({"model": {"name": "resnet18", "width": 3}}, "model 'resnet18': width 3 must be a multiple of groups 2"),
        ({"train": {"clients_per_round": 100}}, "train.clients_per_round=100 exceeds partition.num_clients=20"),
        ({"run": 5}, "run: must be a table of keys (got 5)"),
    ],
)
def test_messages_carry_no_validator_prefixes(raw, expected):
    message = refused(raw)
    assert message == expected or message.startswith(expected), message
    for prefix in ("Value error", "Assertion failed", "Input should", ": :"):
        assert prefix not in message


def test_messages_stay_short_for_huge_inputs():
    message = refused({"run": {"name": list(range(10_000))}})
    assert len(message) < 300


# ----------------------------------------------------------------------------------------- shipped config files


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shipped_config_and_variant_validates(path):
    from fedhet.config import load_raw

    resolve_config(load_config(path))
    raw = load_raw(path)
    spec = raw.pop("compare", {})
    for variant in spec.get("variants", []):
        for seed in spec.get("seeds", [0]):
            resolve_config(build_config(variant_raw(raw, variant, seed, spec)[0]))


def test_there_are_shipped_configs():
    assert len(CONFIG_FILES) >= 7

"""Search spaces (fedhet.tuning.space): declared next to each component's parameters, parsed into validated objects,
every bad range refused with one line, turned into Optuna suggest calls."""

from __future__ import annotations

import math

import pytest
from typer.testing import CliRunner

from fedhet.algorithms import ALGORITHMS, SERVER_OPTIMIZERS
from fedhet.cli import app
from fedhet.config import TrainSection, load_config
from fedhet.engine.training import resolve_config
from fedhet.errors import ConfigError
from fedhet.tuning import (
    Choice,
    IntRange,
    LogUniform,
    Uniform,
    build_space,
    configured,
    default_space,
    overrides,
    parse_distribution,
    tunable_parameters,
)


def declared() -> list[tuple[str, str, type]]:
    """(section, component name, parameter model) of every component that may declare tunable parameters."""
    out = [("algorithm", e.name, e.params) for e in ALGORITHMS.entries() if e.params is not None]
    out += [("server", e.name, e.params) for e in SERVER_OPTIMIZERS.entries() if e.params is not None]
    return [*out, ("train", "", TrainSection)]


@pytest.mark.parametrize(("section", "name", "model"), declared(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_declared_range_names_a_parameter_and_is_valid_for_it(section, name, model):
    assert set(model.tunable) <= set(model.model_fields), f"{name}: tunable names no parameter"
    cfg = load_config(None, [f"{section}.name={name}"] if name else [])
    space = build_space(cfg, [f"{section}.{key}" for key in model.tunable], defaults=False)
    assert space.keys() == [f"{section}.{key}" for key in model.tunable]


def test_the_five_seed_methods_and_the_proximal_baselines_declare_spaces():
    for name in ("fedrcl", "fedbc", "fedacd", "fedufo", "fedrane", "fedprox", "moon", "feddyn", "scaffold"):
        cfg = load_config(None, [f"algorithm.name={name}"])
        assert default_space(cfg).keys() == [f"algorithm.{k}" for k in ALGORITHMS.get(name).params.tunable]
    assert default_space(load_config(None, ["algorithm.name=fedprox"])).describe() == "algorithm.mu=log:1e-3:1"
    assert default_space(load_config(None, [])).dims == ()  # fedavg: nothing of its own to tune


def test_shared_settings_join_only_when_named():
    cfg = load_config(None, ["algorithm.name=fedprox", "server.name=fedadam"])
    own = {k for k, (_, mine) in tunable_parameters(cfg).items() if mine}
    assert own == {"algorithm.mu"}
    space = build_space(cfg, ["train.lr", "server.lr=log:1e-2:1", "algorithm.mu=choice:0.01,0.1"])
    assert space.describe() == "algorithm.mu=choice:0.01,0.1 train.lr=log:1e-3:0.3 server.lr=log:1e-2:1"


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("log:1e-3:1", LogUniform(low=1e-3, high=1)),
        ("uniform:0:1", Uniform(low=0, high=1)),
        ("int:1:5", IntRange(low=1, high=5)),
        ("int:1:64:log", IntRange(low=1, high=64, log=True)),
        ("choice:0.1,0.5,1", Choice(values=(0.1, 0.5, 1))),
        ("choice:official,paper", Choice(values=("official", "paper"))),
        (" LOG : 0.01 : 0.1 ", LogUniform(low=0.01, high=0.1)),
    ],
)
def test_grammar(spec, expected):
    assert parse_distribution(spec) == expected


@pytest.mark.parametrize(
    ("specs", "message"),
    [
        (
            ["algorithm.foo=log:1e-3:1"],
            "unknown parameter 'algorithm.foo' of algorithm 'fedprox'; tunable: algorithm.mu",
        ),
        (["algorithm.weighting=choice:samples,uniform"], "algorithm.weighting is not tunable"),
        (["train.batch_size=int:8:64"], "train.batch_size is not tunable"),
        (["run.rounds=int:1:5"], "cannot tune 'run.rounds': tuned settings are algorithm.*, train.* or server.*"),
        (["algorithm.mu=log:1:1"], "the range 1:1 is empty"),
        (["algorithm.mu=uniform:1:0.5"], "the range 1:0.5 is reversed"),
        (["algorithm.mu=log:0:1"], "a log range needs bounds > 0 (got 0:1)"),
        (["algorithm.mu=log:-1:1"], "a log range needs bounds > 0"),
        (["train.local_epochs=int:0:3:log"], "a log range needs bounds > 0"),
        (["algorithm.mu=choice:0.1"], "a choice needs two or more values (got 1)"),
        (["algorithm.mu=choice:0.1,0.1"], "a choice lists a value twice"),
        (
            ["train.lr=uniform:0:0.3"],
            "train.lr=uniform:0:0.3 reaches a value the setting refuses: train.lr: must be greater than 0 (got 0.0)",
        ),
        (["algorithm.mu=uniform:-1:1"], "mu: must be greater than or equal to 0 (got -1.0)"),
        (["train.momentum=uniform:0:1"], "train.momentum: must be less than 1"),
        (["algorithm.mu=gauss:0:1"], "is not one of log:LOW:HIGH, uniform:LOW:HIGH, int:LOW:HIGH[:log], choice:A,B,"),
        (["algorithm.mu=log:a:1"], "'a' is not a finite number"),
        (["algorithm.mu=log:1e-3:inf"], "'inf' is not a finite number"),
        (["train.local_steps=uniform:1:5"], "train.local_steps is an integer; use int:LOW:HIGH or choice:A,B,..."),
    ],
)
def test_bad_spaces_are_one_line_errors(specs, message):
    cfg = load_config(None, ["algorithm.name=fedprox"])
    with pytest.raises(ConfigError) as info:
        build_space(cfg, specs)
    text = str(info.value)
    assert message in text and "\n" not in text


def test_a_setting_refused_with_another_one_is_refused_in_the_space():
    cfg = load_config(None, ["train.optimizer=adam"])
    with pytest.raises(ConfigError, match="train.momentum is sgd's"):
        build_space(cfg, ["train.momentum"])


class RecordingTrial:
    """The part of optuna.Trial a space calls: returns each range's low end, and records the calls."""

    def __init__(self):
        self.calls = []

    def suggest_float(self, name, low, high, *, log=False):
        self.calls.append(("float", name, low, high, log))
        return low

    def suggest_int(self, name, low, high, *, log=False):
        self.calls.append(("int", name, low, high, log))
        return low

    def suggest_categorical(self, name, choices):
        self.calls.append(("categorical", name, choices))
        return choices[-1]


def test_a_space_becomes_suggest_calls_and_a_valid_config():
    cfg = load_config(None, ["algorithm.name=fedrcl"])
    space = build_space(cfg, ["train.lr", "train.local_epochs=int:1:5:log", "train.momentum=uniform:0:0.9"])
    trial = RecordingTrial()
    values = space.suggest(trial)
    assert trial.calls == [
        ("categorical", "algorithm.beta", [0, 0.1, 0.2, 0.5, 1, 2, 5]),
        ("float", "algorithm.tau", 0.01, 0.5, True),
        ("float", "algorithm.threshold", 0.5, 0.9, False),
        ("float", "train.lr", 1e-3, 0.3, True),
        ("int", "train.local_epochs", 1, 5, True),
        ("float", "train.momentum", 0.0, 0.9, False),
    ]
    tuned = configured(cfg, values)
    assert (tuned.algorithm.params()["beta"], tuned.train.lr, tuned.train.local_epochs) == (5, 1e-3, 1)
    resolve_config(tuned)
    assert load_config(None, ["algorithm.name=fedrcl", *overrides(values)]) == tuned


def test_optuna_drives_a_space():
    optuna = pytest.importorskip("optuna")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    cfg = load_config(None, ["algorithm.name=moon"])
    space = build_space(cfg, ["train.lr", "train.local_epochs=int:1:3"])
    seen = []

    def objective(trial):
        values = space.suggest(trial)
        seen.append(values)
        resolve_config(configured(cfg, values))
        return values["algorithm.mu"]

    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    study.optimize(objective, n_trials=5)
    for values in seen:
        assert 0.1 <= values["algorithm.mu"] <= 10 and 0.1 <= values["algorithm.temperature"] <= 1
        assert 1e-3 <= values["train.lr"] <= 0.3 and values["train.local_epochs"] in (1, 2, 3)
    assert set(study.best_params) == set(space.keys()) and not math.isnan(study.best_value)


def test_list_algorithms_shows_each_search_space():
    result = CliRunner().invoke(app, ["list", "algorithms"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    assert "mu=log:1e-3:1" in result.output and "tunable (default range)" in result.output
    assert "opt-in with -t: train.lr=log:1e-3:0.3" in result.output
    servers = CliRunner().invoke(app, ["list", "servers"], env={"COLUMNS": "250"})
    assert "lr=log:1e-3:1, tau=log:1e-5:1e-1" in servers.output


def test_the_docs_print_the_declared_ranges():
    from pathlib import Path

    from fedhet.tuning.space import spaces_markdown

    page = (Path(__file__).parents[1] / "docs" / "tuning.md").read_text()
    assert spaces_markdown() in page, "docs/tuning.md: paste fedhet.tuning.space.spaces_markdown() under its table"


def test_a_best_value_in_the_outer_twentieth_of_its_range_is_at_its_edge():
    """On the range's own scale (log for log ranges): the study's FedProx chose lr 0.00103 on log:1e-3:0.3."""
    lr = LogUniform(low=1e-3, high=0.3)
    assert lr.edge(0.00103) == lr.edge(1e-3) == "lower" and lr.edge(0.28) == lr.edge(0.3) == "upper"
    assert lr.edge(0.0013) == "lower"  # ln 1.3 / ln 300 = 4.6 % of the log range
    assert lr.edge(0.002) is None and lr.edge(0.01) is None  # 12 %, 40 %
    assert Uniform(low=0.5, high=2.0).edge(0.55) == "lower" and Uniform(low=0.5, high=2.0).edge(1.2) is None
    assert IntRange(low=1, high=10).edge(10) == "upper" and IntRange(low=1, high=10).edge(5) is None
    assert Choice(values=(0.1, 0.5, 1.0)).edge(0.1) is None  # a choice has no order
    from fedhet.tuning.space import Dimension, SearchSpace

    dims = [Dimension(key=k, spec=v, dist=parse_distribution(v)) for k, v in (("algorithm.mu", "log:1e-3:1"),
            ("train.lr", "log:1e-3:0.3"))]  # fmt: skip
    space = SearchSpace(dims=tuple(dims))
    assert space.edges({"algorithm.mu": 0.0145, "train.lr": 0.00103}) == {"train.lr": "lower"}

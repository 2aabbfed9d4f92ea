"""Property: whatever config a user writes, fedhet either accepts it or refuses it with one clean line (issue 10).

Generated configs mix valid and invalid keys and values in every section: wrong types, booleans, None, NaN and
infinities, negative and huge numbers, unknown names, nested junk, unicode, and files that are not TOML or not
UTF-8. They go through what the CLI runs before loading any data, ``load_config(path, overrides)`` then
``resolve_config(cfg)``; a subset goes through the real command line, ``fedhet run``, on a tiny setting, where a
config that validates trains one round.
"""

from __future__ import annotations

import io
import math
import sys
from contextlib import redirect_stderr, redirect_stdout
from typing import Any

import pytest
import tomli_w
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fedhet import cli
from fedhet.algorithms import ALGORITHMS, SERVER_OPTIMIZERS
from fedhet.config import Config, load_config
from fedhet.data.datasets import DATASETS
from fedhet.data.features import FEATURE_SKEWS
from fedhet.data.partition import PARTITIONERS
from fedhet.engine.simulation import resolve_config
from fedhet.errors import FedhetError
from fedhet.models import MODELS

REGISTRIES = {"dataset": DATASETS, "partition": PARTITIONERS, "features": FEATURE_SKEWS, "model": MODELS}
REGISTRIES |= {"algorithm": ALGORITHMS, "server": SERVER_OPTIMIZERS}
SECTIONS = list(Config.model_fields)
JUNK_NAMES = ["", " ", "x", "FEDAVG", "fed avg", "ключ", "名前", "🚀", "a.b", "[run]", "[/]", "'", '"', "\\", "\t"]


def keys_of(section: str) -> list[str]:
    """The section's own keys and every parameter of every component that can be named in it."""
    keys = list(Config.model_fields[section].annotation.model_fields)
    for entry in REGISTRIES[section].entries() if section in REGISTRIES else []:
        keys += [k for k in (entry.params.model_fields if entry.params else {}) if k not in keys]
    return keys


KEYS = {section: keys_of(section) for section in SECTIONS}
NAMES = {section: REGISTRIES[section].names() for section in REGISTRIES}

# ------------------------------------------------------------------------------------------------- strategies

numbers = st.one_of(
    st.integers(-3, 5),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 0.5, 1.0, 1e-300, 1e300, math.inf, -math.inf, math.nan]),
)
words = st.one_of(
    st.sampled_from(JUNK_NAMES + ["cpu", "cuda", "cuda:0", "mps", "tpu9", "auto", "disk", "group", "samples"]),
    st.sampled_from(sorted({n for names in NAMES.values() for n in names})),
    st.text(max_size=12),
)
scalars = st.one_of(st.booleans(), numbers, words)
toml_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(words, inner, max_size=3)),
    max_leaves=8,
)


@st.composite
def sections(draw, section: str) -> Any:
    if draw(st.integers(0, 19)) == 0:  # a section that is not a table
        return draw(scalars)
    keys = st.one_of(st.sampled_from(KEYS[section]), words) if KEYS[section] else words
    table = draw(st.dictionaries(keys, toml_values, max_size=4))
    if section in NAMES and draw(st.booleans()):
        table["name"] = draw(st.one_of(st.sampled_from(NAMES[section]), words))
    return table


def fields_for(section: str, name: str | None) -> dict[str, Any]:
    """The fields a section holds when its component is ``name``: the section's own, then the component's."""
    fields = dict(Config.model_fields[section].annotation.model_fields)
    if name is not None:
        entry = REGISTRIES[section].get(name)
        fields |= entry.params.model_fields if entry.params else {}
    return fields


def near(value: Any) -> st.SearchStrategy:
    """Values a user might plausibly write for a field whose default is ``value``: mostly fine, sometimes not."""
    if isinstance(value, bool):
        return st.booleans()
    if isinstance(value, int):
        return st.sampled_from([value, value + 1, max(value - 1, 0), 2 * value, 1])
    if isinstance(value, float):
        return st.sampled_from([value, value / 2, 0.9 * value + 0.05])
    if isinstance(value, list | tuple):
        return st.just(list(value))
    return st.just(value)


@st.composite
def plausible_sections(draw, section: str) -> dict[str, Any]:
    """A section as a user would write it: a real component and some of its fields near their defaults."""
    name = draw(st.sampled_from(NAMES[section])) if section in NAMES else None
    fields = fields_for(section, name)
    chosen = draw(st.lists(st.sampled_from(sorted(fields)), max_size=3, unique=True)) if fields else []
    table = {} if name is None else {"name": name}
    for key in chosen:
        if fields[key].is_required():  # no default to be near (the hf dataset's path): a word instead
            table[key] = draw(words)
            continue
        default = fields[key].get_default(call_default_factory=True)
        if key != "name" and default is not None and key not in ("out_dir", "device"):
            table[key] = draw(near(default))
    return table


@st.composite
def toml_configs(draw) -> dict[str, Any]:
    names = draw(st.lists(st.one_of(st.sampled_from([*SECTIONS, "compare"]), words), max_size=5, unique=True))
    if draw(st.booleans()):  # near-valid: real sections, values near their defaults, now and then one wrong value
        raw = {name: draw(plausible_sections(name)) for name in draw(st.permutations(SECTIONS))[:4]}
        if draw(st.booleans()):
            section = draw(st.sampled_from(sorted(raw)))
            raw[section][draw(st.one_of(st.sampled_from(KEYS[section]), words))] = draw(toml_values)
        return raw
    return {name: draw(sections(name)) if name in KEYS else draw(toml_values) for name in names}


def value_text(value: Any) -> str:
    """How a user would type the value after ``-s key=``."""
    if isinstance(value, str):
        return value
    if value is None or isinstance(value, bool):
        return {None: "none", True: "true", False: "false"}[value]
    return repr(value)


@st.composite
def overrides(draw) -> str:
    kind = draw(st.integers(0, 9))
    if kind == 0:  # anything at all
        return draw(st.text(max_size=30))
    section = draw(st.one_of(st.sampled_from(SECTIONS), words))
    key = draw(st.one_of(st.sampled_from(KEYS.get(section) or ["x"]), words))
    if kind == 1:  # a deeper key
        key = f"{key}.{draw(words)}"
    if kind < 6 and section in KEYS:  # a plausible one, as in plausible_sections
        table = draw(plausible_sections(section))
        if table:
            key = draw(st.sampled_from(sorted(table)))
            return f"{section}.{key}={value_text(table[key])}"
    value = draw(st.one_of(st.none(), toml_values, st.text(max_size=20)))
    return f"{section}.{key}={value_text(value)}"


file_contents = st.one_of(
    toml_configs().map(lambda raw: tomli_w.dumps(raw).encode()),
    st.binary(max_size=60),  # mostly not UTF-8, sometimes not TOML
    st.text(max_size=60).map(str.encode),
)


def assert_clean(err: FedhetError) -> None:
    message = str(err)
    assert message and "\n" not in message and "\r" not in message, repr(message)
    for phrase in ("Value error,", "Assertion failed,", "Input should", "valid keys in :", "Traceback"):
        assert phrase not in message, message


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("property")


# ------------------------------------------------------------------------------------- validation, no data loaded


@pytest.mark.slow
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(content=st.one_of(st.none(), file_contents), sets=st.lists(overrides(), max_size=4))
def test_any_config_validates_or_fails_with_one_clean_line(workdir, content, sets):
    path = None
    if content is not None:
        path = workdir / "config.toml"
        path.write_bytes(content)
    try:
        resolve_config(load_config(path, sets))
        event("valid")
    except FedhetError as err:
        assert_clean(err)
        event("refused")


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=toml_configs())
def test_toml_tables_validate_or_fail_with_one_clean_line(workdir, raw):
    path = workdir / "tables.toml"
    path.write_text(tomli_w.dumps(raw))
    try:
        resolved = resolve_config(load_config(path))
    except FedhetError as err:
        assert_clean(err)
        event("refused")
    else:
        event("valid")  # what validated is what runs: every float finite, no boolean where a number is wanted
        for section, values in resolved.items():
            fields = fields_for(section, values["name"] if section in NAMES else None)
            for key, value in values.items():
                assert not (isinstance(value, float) and not math.isfinite(value)), f"{section}.{key}={value}"
                assert not isinstance(value, bool) or "bool" in str(fields[key].annotation), f"{section}.{key}"


# ----------------------------------------------------------------------------------------- the real command line

TINY = {
    "run": {"rounds": 1, "progress": False, "name": "prop", "eval_batch_size": 512},
    "dataset": {"name": "digits"},
    "partition": {"name": "dirichlet", "num_clients": 3, "min_size": 20},
    "model": {"name": "mlp", "hidden": [8]},
    "train": {"local_steps": 1, "batch_size": 16},
}
# Keys a mutation leaves alone, so that a config that validates stays a one-round run in the test's folder:
# where runs are written or data read from, downloads, and sizes that could make a valid run long.
FIXED = {"out_dir", "data_dir", "download", "rounds", "local_steps", "local_epochs", "num_users", "dim", "width"}
SMALL = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-2, 4),
    st.sampled_from([0.0, 0.3, 0.99, 1.5, -1.0, math.inf, -math.inf, math.nan, 1e300]),
    st.sampled_from(JUNK_NAMES + ["cuda", "tpu9", "disk", "uniform", "official", "batch"]),
    st.lists(st.integers(-1, 4) | st.booleans(), max_size=3),
    st.dictionaries(st.sampled_from(["x", "name"]), st.integers(0, 2), max_size=2),
)
CHEAP = {"dataset": ["digits", "synthetic"], "model": ["mlp", "logreg", "convnet", "lstm"]}


@st.composite
def mutations(draw) -> str:
    """One ``-s section.key=value`` on the tiny config: mostly a key its components take, with a value near the
    default or a wrong one; sometimes a key of another component, or an unknown one."""
    section = draw(st.sampled_from(SECTIONS))
    component = None
    if section in NAMES:
        component = TINY.get(section, {}).get("name") or Config.model_fields[section].default.name
    fields = fields_for(section, component)
    own = sorted(k for k in fields if k not in FIXED)
    others = [k for k in KEYS[section] if k not in FIXED] + ["x", "é"]
    key = draw(st.sampled_from(own)) if own and draw(st.integers(0, 4)) else draw(st.sampled_from(others))
    default = fields[key].get_default(call_default_factory=True) if key in fields else None
    if key == "name" and section in NAMES:
        value = draw(st.sampled_from(CHEAP.get(section, NAMES[section]) + ["nope"]))
    elif default is not None and key != "device" and draw(st.booleans()):
        value = draw(near(default))
    else:
        value = draw(SMALL)
    return f"{section}.{key}={value_text(value)}"


def run_cli(args: list[str]) -> tuple[int, str]:
    """``fedhet ARGS`` as the installed script runs it (``cli.main``), in this process: exit code and stderr."""
    err, argv = io.StringIO(), sys.argv
    sys.argv = ["fedhet", *args]
    try:
        with redirect_stderr(err), redirect_stdout(io.StringIO()):
            cli.main()
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    finally:
        sys.argv = argv
    return code, err.getvalue()


@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(changes=st.lists(mutations(), min_size=1, max_size=2))
def test_the_command_line_runs_or_prints_one_error_line(workdir, changes):
    path = workdir / "tiny.toml"
    path.write_text(tomli_w.dumps(TINY))
    code, stderr = run_cli(
        ["run", "-c", str(path), "-o", str(workdir / "runs"), "--overwrite", *sum((["-s", c] for c in changes), [])]
    )
    assert "Traceback" not in stderr
    event(f"exit {code}")
    if code == 0:
        return
    lines = stderr.strip().splitlines()
    if code == 1:  # a valid setting the run cannot survive (server.lr=1e300: the model turns non-finite)
        assert len(lines) == 1 and lines[0].startswith("failed: "), stderr
        return
    assert code == 2, stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    for phrase in ("Value error,", "Assertion failed,", "Input should", "valid keys in :"):
        assert phrase not in lines[0]


def tiny_with(section: str, **values: Any) -> bytes:
    """The tiny config with some values changed, so that were it accepted it would still be a one-round run."""
    return tomli_w.dumps({**TINY, section: {**TINY.get(section, {}), **values}}).encode()


@pytest.mark.parametrize(
    "content",
    [
        b"\xff\xfe" + tiny_with("run"),
        tiny_with("run", rounds=True),
        tiny_with("train", lr=math.nan),
        tiny_with("run", seed=-1),
        tiny_with("algorithm", name="fedprox", mu=math.inf),
    ],
)
def test_examples_of_bad_files_through_the_command_line(workdir, content):
    path = workdir / "bad.toml"
    path.write_bytes(content)
    code, stderr = run_cli(["run", "-c", str(path), "-o", str(workdir / "runs"), "--overwrite"])
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), stderr

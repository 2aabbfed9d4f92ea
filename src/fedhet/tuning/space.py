"""Search spaces: which settings a tuner varies and over what ranges, parsed and checked before any run starts.

Grammar of one dimension (``-t KEY=SPEC``, or ``-t KEY`` for the range the parameter declares):

* ``log:LOW:HIGH``: a float, log-uniform on [LOW, HIGH] (0 < LOW < HIGH)
* ``uniform:LOW:HIGH``: a float, uniform on [LOW, HIGH] (LOW < HIGH)
* ``int:LOW:HIGH`` (``int:LOW:HIGH:log``): an integer in [LOW, HIGH], uniform (log-uniform)
* ``choice:A,B,C``: one of two or more distinct values (numbers, true/false, names)

KEY is ``algorithm.<p>``, ``train.<p>`` or ``server.<p>``. Each parameter model says which of its parameters may be
tuned and their default ranges (``Params.tunable``, next to the parameters, with the source of each range): an
algorithm's own make its default space; the shared ones (``train.lr``, ``train.momentum``, ``train.local_epochs``,
``train.local_steps``, ``train.weight_decay``, the server optimiser's ``server.lr`` ...) join only when named. Every
bound and choice is validated as the setting itself would be (a range of ``train.lr`` that reaches 0 is refused), so a
trial never fails on its config. ``suggest`` turns a space into Optuna ``trial.suggest_*`` calls; Optuna is imported
by the caller only (``pip install fedhet[tune]``), never here.
"""

from __future__ import annotations

import math
import typing
from typing import Any, Literal

from pydantic import ValidationError, model_validator

from fedhet.components import component_registries
from fedhet.config import Config, build_config, parse_value, set_dotted
from fedhet.errors import ConfigError, suggestion
from fedhet.params import Params, problem, shown

TUNABLE_SECTIONS = ("algorithm", "train", "server")


class LogUniform(Params):
    kind: Literal["log"] = "log"
    low: float
    high: float

    @model_validator(mode="after")
    def _ordered(self) -> LogUniform:
        if self.low <= 0 or self.high <= 0:
            raise ValueError(f"a log range needs bounds > 0 (got {self.low:g}:{self.high:g}); use uniform:LOW:HIGH")
        _check_order(self.low, self.high)
        return self

    def probes(self) -> list[Any]:
        return [self.low, self.high]

    def suggest(self, trial: Any, name: str) -> float:
        return trial.suggest_float(name, self.low, self.high, log=True)

    def edge(self, value: Any) -> str | None:
        return _edge(math.log(value), math.log(self.low), math.log(self.high))


class Uniform(Params):
    kind: Literal["uniform"] = "uniform"
    low: float
    high: float

    @model_validator(mode="after")
    def _ordered(self) -> Uniform:
        _check_order(self.low, self.high)
        return self

    def probes(self) -> list[Any]:
        return [self.low, self.high]

    def suggest(self, trial: Any, name: str) -> float:
        return trial.suggest_float(name, self.low, self.high)

    def edge(self, value: Any) -> str | None:
        return _edge(value, self.low, self.high)


class IntRange(Params):
    kind: Literal["int"] = "int"
    low: int
    high: int
    log: bool = False

    @model_validator(mode="after")
    def _ordered(self) -> IntRange:
        if self.log and self.low <= 0:
            raise ValueError(f"a log range needs bounds > 0 (got {self.low}:{self.high})")
        _check_order(self.low, self.high)
        return self

    def probes(self) -> list[Any]:
        return [self.low, self.high]

    def suggest(self, trial: Any, name: str) -> int:
        return trial.suggest_int(name, self.low, self.high, log=self.log)

    def edge(self, value: Any) -> str | None:
        scale = math.log if self.log else float
        return _edge(scale(value), scale(self.low), scale(self.high))


class Choice(Params):
    kind: Literal["choice"] = "choice"
    values: tuple[bool | int | float | str | None, ...]

    @model_validator(mode="after")
    def _several(self) -> Choice:
        if len(self.values) < 2:
            raise ValueError(f"a choice needs two or more values (got {len(self.values)}); a fixed value is -s KEY=V")
        if len(set(map(repr, self.values))) < len(self.values):
            raise ValueError(f"a choice lists a value twice ({', '.join(map(repr, self.values))})")
        return self

    def probes(self) -> list[Any]:
        return list(self.values)

    def suggest(self, trial: Any, name: str) -> Any:
        return trial.suggest_categorical(name, list(self.values))

    def edge(self, value: Any) -> str | None:
        return None  # a choice has no order to be at the end of


# told apart by ``kind`` (a discriminated union would clash with Params' field validators; the literal suffices)
Distribution = LogUniform | Uniform | IntRange | Choice


EDGE = 0.05  # a best value in the outer 5 % of its range (on the range's scale) is "at the edge"
EDGE_MARKS = {"lower": "⇤", "upper": "⇥"}  # how tables mark a value at the lower / upper edge


def edges_of(space: str, values: dict[str, Any]) -> dict[str, str]:
    """``SearchSpace.edges`` from a space as ``describe`` writes it (a tune.json's "space")."""
    found = {}
    for item in space.split():
        key, _, spec = item.partition("=")
        side = None if values.get(key) is None else parse_distribution(spec).edge(values[key])
        if side is not None:
            found[key] = side
    return found


def _edge(value: float, low: float, high: float) -> str | None:
    """ "lower" or "upper" where ``value`` lies in the outer ``EDGE`` of [low, high] or on a bound, else None."""
    position = (value - low) / (high - low)
    if value <= low or position <= EDGE:
        return "lower"
    if value >= high or position >= 1 - EDGE:
        return "upper"
    return None


def _check_order(low: float, high: float) -> None:
    if low == high:
        raise ValueError(f"the range {low:g}:{high:g} is empty (LOW must be below HIGH); a fixed value is -s KEY=V")
    if low > high:
        raise ValueError(f"the range {low:g}:{high:g} is reversed (LOW must be below HIGH)")


class Dimension(Params):
    key: str  # "algorithm.mu"
    spec: str  # as written, "log:1e-3:1"
    dist: Distribution

    def suggest(self, trial: Any) -> Any:
        return self.dist.suggest(trial, self.key)


class SearchSpace(Params):
    """What a tuner varies: one dimension per setting, in the order given."""

    dims: tuple[Dimension, ...] = ()

    def keys(self) -> list[str]:
        return [d.key for d in self.dims]

    def suggest(self, trial: Any) -> dict[str, Any]:
        """One point of the space from an Optuna ``trial``: ``{"algorithm.mu": 0.013, "train.lr": 0.05}``."""
        return {d.key: d.suggest(trial) for d in self.dims}

    def describe(self) -> str:
        """``algorithm.mu=log:1e-3:1 train.lr=log:1e-3:0.3`` (what ``-t`` takes back)."""
        return " ".join(f"{d.key}={d.spec}" for d in self.dims)

    def edges(self, values: dict[str, Any]) -> dict[str, str]:
        """The settings of ``values`` (a best trial's) that lie at an edge of their range, "lower" or "upper": the
        best may lie outside the range searched, which a wider range would tell."""
        found = {d.key: d.dist.edge(values[d.key]) for d in self.dims if values.get(d.key) is not None}
        return {key: side for key, side in found.items() if side is not None}


# ----------------------------------------------------------------------------------------------------- parsing
def parse_distribution(spec: str) -> Distribution:
    """``log:1e-3:1`` -> LogUniform(1e-3, 1); a malformed or invalid spec is one ConfigError."""
    kind, _, rest = spec.strip().partition(":")
    kind = kind.strip().lower()
    parts = [p.strip() for p in rest.split(":")] if rest else []
    if kind == "choice":
        raw: dict[str, Any] = {"kind": kind, "values": [parse_value(v) for v in rest.split(",")] if rest else []}
    elif kind in ("log", "uniform") and len(parts) == 2:
        raw = {"kind": kind, "low": _number(parts[0], spec), "high": _number(parts[1], spec)}
    elif kind == "int" and len(parts) in (2, 3) and parts[2:] in ([], ["log"]):
        raw = {"kind": kind, "low": _number(parts[0], spec), "high": _number(parts[1], spec), "log": len(parts) == 3}
    else:
        raise ConfigError(
            f"search range {shown(spec)} is not one of log:LOW:HIGH, uniform:LOW:HIGH, int:LOW:HIGH[:log], "
            "choice:A,B,..."
        )
    try:
        return _MODELS[kind].model_validate(raw)
    except ValidationError as err:
        raise ConfigError(f"search range {shown(spec)}: {problem(err.errors()[0])}") from None


_MODELS: dict[str, type[Params]] = {"log": LogUniform, "uniform": Uniform, "int": IntRange, "choice": Choice}


def _number(text: str, spec: str) -> float | int:
    value = parse_value(text)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"search range {shown(spec)}: {shown(text)} is not a finite number")
    return value


def tunable_parameters(cfg: Config) -> dict[str, tuple[str, bool]]:
    """Every setting a tuner may vary in a run of ``cfg``: ``"section.key" -> (default range, the algorithm's own)``.
    The algorithm's own come first; the shared ones (train, server optimiser) join a space only when named."""
    models = section_models(cfg)
    out = {f"algorithm.{k}": (v, True) for k, v in models["algorithm"].tunable.items()}
    for section in ("train", "server"):
        out.update({f"{section}.{k}": (v, False) for k, v in models[section].tunable.items()})
    return out


def section_models(cfg: Config) -> dict[str, type[Params]]:
    """The parameter model behind each tunable section of ``cfg``: the algorithm's and server optimiser's own
    (from their registries), and the train section."""
    registries = dict(component_registries())
    out: dict[str, type[Params]] = {"train": type(cfg.train)}
    for section in ("algorithm", "server"):
        entry = registries[section].get(getattr(cfg, section).name)
        out[section] = entry.params if entry.params is not None else Params
    return out


def default_space(cfg: Config) -> SearchSpace:
    """The algorithm's own declared space (empty for one with nothing to tune, FedAvg)."""
    return build_space(cfg, [])


def build_space(cfg: Config, specs: list[str], *, defaults: bool = True) -> SearchSpace:
    """The space a tuner searches for ``cfg``: the algorithm's declared space (unless ``defaults=False``), then each
    ``KEY=SPEC`` of ``specs`` added or replacing (``KEY`` alone: its declared range). One ConfigError for an unknown
    or untunable key, a malformed or empty range, or a bound or choice the setting itself refuses."""
    tunable = tunable_parameters(cfg)
    chosen: dict[str, str] = {k: v for k, (v, own) in tunable.items() if own} if defaults else {}
    for item in specs:
        key, sep, spec = item.partition("=")
        key = key.strip()
        check_key(cfg, key, tunable)
        chosen[key] = spec.strip() if sep else tunable[key][0]
    dims = []
    for key, spec in chosen.items():
        try:
            dist = parse_distribution(spec)
        except ConfigError as err:
            raise ConfigError(f"{key}: {err}") from None
        check_kind(cfg, key, dist, spec)
        check_values(cfg, key, dist, spec)
        dims.append(Dimension(key=key, spec=spec, dist=dist))
    return SearchSpace(dims=tuple(dims))


def check_key(cfg: Config, key: str, tunable: dict[str, tuple[str, bool]]) -> None:
    """Refuse a key that is not a parameter of the run's components, or one that is but is not tunable."""
    if key in tunable:
        return
    section, _, name = key.partition(".")
    valid = ", ".join(tunable) or "none"
    if section not in TUNABLE_SECTIONS or not name:
        what = "tuned settings are algorithm.*, train.* or server.*"
        raise ConfigError(f"cannot tune {shown(key)}: {what}; tunable: {valid}")
    owner = {"algorithm": f"algorithm {cfg.algorithm.name!r}", "server": f"server optimiser {cfg.server.name!r}"}
    known = name in section_models(cfg)[section].model_fields or (
        section == "server" and name in type(cfg.server).model_fields
    )
    if not known:
        whose = owner.get(section, "[train]")
        raise ConfigError(f"unknown parameter {shown(key)} of {whose}; tunable: {valid}{suggestion(key, tunable)}")
    raise ConfigError(f"{key} is not tunable (a choice of method or a fixed setting); tunable: {valid}")


def check_kind(cfg: Config, key: str, dist: Distribution, spec: str) -> None:
    """A float range for an integer setting would suggest 2.7 epochs of an int: refuse it up front."""
    section, _, name = key.partition(".")
    field = section_models(cfg)[section].model_fields[name]
    members = _members(field.annotation)
    if isinstance(dist, LogUniform | Uniform) and int in members and float not in members:
        raise ConfigError(f"{key}={spec}: {key} is an integer; use int:LOW:HIGH or choice:A,B,...")


def _members(tp: Any) -> set[Any]:
    args = typing.get_args(tp)
    return {m for a in args for m in _members(a)} if args and typing.get_origin(tp) is not Literal else {tp}


def check_values(cfg: Config, key: str, dist: Distribution, spec: str) -> None:
    """Each bound (or choice) set on ``cfg`` must make a valid config, checked as ``fedhet run`` checks one."""
    from fedhet.engine.training import resolve_config

    for value in dist.probes():
        try:
            resolve_config(configured(cfg, {key: value}))
        except ConfigError as err:
            raise ConfigError(f"{key}={spec} reaches a value the setting refuses: {err}") from None


def configured(cfg: Config, values: dict[str, Any]) -> Config:
    """``cfg`` with a trial's values set (``{"algorithm.mu": 0.01}``), validated like any config."""
    raw = cfg.to_dict()
    for key, value in values.items():
        set_dotted(raw, key, value)
    return build_config(raw)


def overrides(values: dict[str, Any]) -> list[str]:
    """A trial's values as ``-s`` overrides (``["algorithm.mu=0.01"]``), e.g. for the command a trial ran."""
    return [f"{key}={value!r}" for key, value in values.items()]


def spaces_markdown() -> str:
    """The declared ranges as docs/tuning.md prints them: each algorithm's default space, then the opt-in shared
    ones (tests/test_search_space.py checks the page against this)."""
    registries = dict(component_registries())
    lines = ["| algorithm | tuned by default (`algorithm.<p>`) |", "|---|---|"]
    for e in registries["algorithm"].entries():
        space = e.params.tunable if e.params is not None else {}
        lines.append(f"| `{e.name}` | {_ranges(space) or '(none)'} |")
    lines += ["", "| opt-in (named with `-t`) | default range |", "|---|---|"]
    lines += [f"| `train.{k}` | `{v}` |" for k, v in Config.model_fields["train"].annotation.tunable.items()]
    for e in registries["server"].entries():
        space = e.params.tunable if e.params is not None else {}
        lines.append(f'| `server.<p>` with `server.name = "{e.name}"` | {_ranges(space) or "(none)"} |')
    return "\n".join(lines) + "\n"


def _ranges(space: dict[str, str]) -> str:
    return ", ".join(f"`{k}={v}`" for k, v in space.items())

"""Name -> factory registries for datasets, partitioners, models and algorithms.

Every entry carries a one-line summary and, optionally, a pydantic model of its parameters (a subclass of
``fedhet.params.Params``, so unknown keys, non-finite floats and booleans for numbers are refused alike), so
`fedhet list` can show what exists and configuration errors can name the valid choices.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from fedhet.errors import ConfigError, suggestion, unknown_choice
from fedhet.params import Params, problem, shown

# registry kind -> the config section whose `name` picks one of its entries ("partitioner" -> "partition")
_SECTION_OF: dict[str, str] = {}
# config section -> its own keys ("partition" -> name, num_clients, seed, ...), given by fedhet/config.py when it loads
# (section_keys): the config sits above the components it validates, so the registries never import it
_SECTION_KEYS: dict[str, tuple[str, ...]] = {}


def section_keys(keys: dict[str, Iterable[str]]) -> None:
    """Record each config section's own keys, which an unknown key's message lists before the component's."""
    _SECTION_KEYS.update({section: tuple(names) for section, names in keys.items()})


def unknown_keys(kind: str, name: str, keys: list[str], params: list[str]) -> str:
    """``unknown key 'partition.bogus' for partitioner 'dirichlet'; valid keys in [partition]: name, ..., alpha``:
    the section's own keys, then the parameters of the component it names."""
    section = _SECTION_OF.get(kind)
    if section is None:  # a registry outside the config
        hint = "".join(suggestion(key, params) for key in keys)
        return (
            f"unknown key {', '.join(map(shown, keys))} for {kind} {name!r}; valid: {', '.join(params) or 'none'}{hint}"
        )
    own = list(_SECTION_KEYS.get(section, ("name",)))  # ("name",): a registry used before any config was loaded
    unknown = "; ".join(f"unknown key {shown(f'{section}.{key}')}" for key in keys)
    valid = own + params
    hint = "".join(suggestion(key, valid, f"{section}.") for key in keys)
    return f"{unknown} for {kind} {name!r}; valid keys in [{section}]: {', '.join(valid)}{hint}"


def parse_params(kind: str, name: str, model: type[BaseModel], params: dict[str, Any]) -> BaseModel:
    """Validate a component's parameters; pydantic's report becomes one line naming the problem and the valid keys.

    ``unknown key 'algorithm.mu' for algorithm 'fedavg'; valid keys in [algorithm]: name, weighting`` or
    ``partitioner 'dirichlet': alpha: must be greater than 0 (got 0)``.
    """
    try:
        return model.model_validate(params)
    except ValidationError as exc:
        errors = exc.errors()
        problems = [f"{kind} {name!r}: {problem(e)}" for e in errors if e["type"] != "extra_forbidden"]
        unknown = [".".join(str(part) for part in e["loc"]) for e in errors if e["type"] == "extra_forbidden"]
        if unknown:
            problems.append(unknown_keys(kind, name, unknown, list(model.model_fields)))
        raise ConfigError("; ".join(problems)) from None


@dataclass(frozen=True)
class Entry:
    name: str
    obj: Any
    summary: str
    params: type[BaseModel] | None = None


class Registry:
    def __init__(self, kind: str, section: str | None = None) -> None:
        """``kind`` names an entry in messages ("partitioner"); ``section`` is the config section that picks one."""
        self.kind = kind
        self._entries: dict[str, Entry] = {}
        if section is not None:
            _SECTION_OF[kind] = section

    def register(self, name: str, summary: str, params: type[BaseModel] | None = None) -> Callable[[Any], Any]:
        """A decorator that adds the class or function it decorates as ``name``, with its one-line ``summary`` (what
        ``fedhet list`` shows) and ``params``, the ``Params`` model its config keys are validated against."""
        if params is not None and not issubclass(params, Params):
            raise TypeError(
                f"{self.kind} {name!r}: its parameters {params.__name__} must derive from fedhet.params.Params"
            )

        def deco(obj: Any) -> Any:
            if name in self._entries:
                raise RuntimeError(f"{self.kind} {name!r} registered twice")
            self._entries[name] = Entry(name, obj, summary, params)
            return obj

        return deco

    def get(self, name: str) -> Entry:
        key = name.lower()
        if key not in self._entries:
            # a config section names it: it may come from a plug-in not loaded
            note = " (one from outside fedhet needs its plug-in: --plugin FILE.py or run.plugins)"
            raise unknown_choice(self.kind, name, self._entries, note if self.kind in _SECTION_OF else "")
        return self._entries[key]

    def parse(self, name: str, params: dict[str, Any]) -> tuple[Entry, BaseModel | None]:
        """The entry called ``name`` and its validated parameters (None for an entry that takes none)."""
        entry = self.get(name)
        if entry.params is None:
            if params:
                raise ConfigError(unknown_keys(self.kind, entry.name, list(params), []))
            return entry, None
        return entry, parse_params(self.kind, entry.name, entry.params, params)

    def names(self) -> list[str]:
        return sorted(self._entries)

    def entries(self) -> list[Entry]:
        return [self._entries[n] for n in self.names()]

    def __contains__(self, name: str) -> bool:
        return name.lower() in self._entries

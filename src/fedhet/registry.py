"""Name -> factory registries for datasets, partitioners, models and algorithms.

Every entry carries a one-line summary and, optionally, a pydantic model of its parameters, so `fedhet list` can show
what exists and configuration errors can name the valid choices.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from fedhet.errors import ConfigError, unknown_choice


def parse_params(kind: str, name: str, model: type[BaseModel], params: dict[str, Any]) -> BaseModel:
    """Validate a component's parameters; pydantic's report becomes one line naming the problem and the valid keys.

    ``unknown parameter 'mu' for algorithm 'fedavg'; valid: weighting`` or
    ``partitioner 'dirichlet': alpha: Input should be greater than 0 (got 0)``.
    """
    try:
        return model.model_validate(params)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            key = ".".join(str(part) for part in err["loc"])
            if err["type"] == "extra_forbidden":
                valid = ", ".join(model.model_fields) or "none"
                problems.append(f"unknown parameter {key!r} for {kind} {name!r}; valid: {valid}")
            else:
                problems.append(f"{kind} {name!r}: {key}: {err['msg']} (got {err.get('input')!r})")
        raise ConfigError("; ".join(problems)) from None


@dataclass(frozen=True)
class Entry:
    name: str
    obj: Any
    summary: str
    params: type[BaseModel] | None = None


class Registry:
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, Entry] = {}

    def register(self, name: str, summary: str, params: type[BaseModel] | None = None) -> Callable[[Any], Any]:
        def deco(obj: Any) -> Any:
            if name in self._entries:
                raise RuntimeError(f"{self.kind} {name!r} registered twice")
            self._entries[name] = Entry(name, obj, summary, params)
            return obj

        return deco

    def get(self, name: str) -> Entry:
        key = name.lower()
        if key not in self._entries:
            raise unknown_choice(self.kind, name, self._entries)
        return self._entries[key]

    def parse(self, name: str, params: dict[str, Any]) -> tuple[Entry, BaseModel | None]:
        """The entry called ``name`` and its validated parameters (None for an entry that takes none)."""
        entry = self.get(name)
        if entry.params is None:
            if params:
                raise ConfigError(f"{self.kind} {entry.name!r} takes no parameters; got {', '.join(params)}")
            return entry, None
        return entry, parse_params(self.kind, entry.name, entry.params, params)

    def names(self) -> list[str]:
        return sorted(self._entries)

    def entries(self) -> list[Entry]:
        return [self._entries[n] for n in self.names()]

    def __contains__(self, name: str) -> bool:
        return name.lower() in self._entries

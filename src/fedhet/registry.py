"""Name -> factory registries for datasets, partitioners, models and algorithms.

Every entry carries a one-line summary and, optionally, a pydantic model of its parameters, so `fedhet list` can show
what exists and configuration errors can name the valid choices.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from fedhet.errors import unknown_choice


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

    def names(self) -> list[str]:
        return sorted(self._entries)

    def entries(self) -> list[Entry]:
        return [self._entries[n] for n in self.names()]

    def __contains__(self, name: str) -> bool:
        return name.lower() in self._entries

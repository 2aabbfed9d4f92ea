"""Durable run files: an append-only metrics log and atomically replaced JSON documents.

A run can be killed at any moment (OOM, pre-emption, Ctrl-C). Each metrics record is flushed and fsynced on
append, so at most the line being written is lost; that torn line is skipped with a warning when read, and cut
off before the next append so it never glues onto a good record. JSON files are written to a temporary file in
the same folder and renamed over the old one, so readers see the old or the new document, never half of one.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedhet.errors import CorruptFile
from fedhet.paths import replace_atomic

# Where a torn line is reported: one line of text (a run's own warning line), else a Python warning
Warn = Callable[[str], None] | None


def _warn(text: str, warn: Warn) -> None:
    if warn is None:
        warnings.warn(text, stacklevel=3)
    else:
        warn(text)


class MetricsLog:
    """Appends one JSON object per evaluation to a `metrics.jsonl` file."""

    def __init__(self, path: str | Path, warn: Warn = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if _has_torn_tail(self.path):
            _warn(f"{self.path}: dropping a torn last line left by a crash", warn)
            _rewrite_lines(self.path, read_metrics(self.path, lambda _: None))  # said once, just above

    def append(self, record: dict) -> str:
        """Write ``record`` as one line; returns the line."""
        return self.extend([record])

    def extend(self, records: list[dict]) -> str:
        """Write each record as a line, with one fsync for all (client_metrics.jsonl: a line per client); returns
        the lines."""
        if any("round" not in record for record in records):
            raise ValueError("a metrics record needs a 'round'")
        text = "".join(to_json(record) + "\n" for record in records)
        if not text:
            return text
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        return text


def read_metrics(path: str | Path, warn: Warn = None) -> list[dict]:
    """All records of a metrics file ([] if it does not exist); a torn last line is skipped with a warning (``warn``,
    else a Python warning)."""
    path = Path(path)
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if number < len(lines):
                raise CorruptFile(f"{path}:{number}: corrupt metrics record ({exc.msg})") from None
            _warn(f"{path}: skipping a torn last line (a crash mid-write?)", warn)
    return records


def truncate_after(path: str | Path, round: int, warn: Warn = None) -> int:
    """Atomically keep only the records with `round <= round` (used on resume; a torn last line goes, with a
    warning as ``read_metrics`` gives it); returns how many were kept."""
    path = Path(path)
    if not path.exists():
        return 0
    kept = [r for r in read_metrics(path, warn) if r["round"] <= round]
    _rewrite_lines(path, kept)
    return len(kept)


def write_json_atomic(path: str | Path, obj: Any) -> None:
    path = Path(path)
    text = to_json(obj, indent=2) + "\n"
    replace_atomic(path, text)


def write_text_atomic(path: str | Path, text: str) -> None:
    replace_atomic(Path(path), text)


def read_json(path: str | Path, kind: type | None = None) -> Any:
    """A JSON document; one that cannot be read or parsed (or is not a ``kind``) raises ``CorruptFile`` naming the
    file, never a decoder traceback."""
    path = Path(path)
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CorruptFile(f"{path}: unreadable ({err})") from None
    if kind is not None and not isinstance(value, kind):
        raise CorruptFile(f"{path}: expected a JSON {'object' if kind is dict else kind.__name__}")
    return value


def _rewrite_lines(path: Path, records: list[dict]) -> None:
    replace_atomic(path, "".join(to_json(r) + "\n" for r in records))


def _has_torn_tail(path: Path) -> bool:
    if not path.exists() or path.stat().st_size == 0:
        return False
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"


def to_json(obj: Any, indent: int | None = None) -> str:
    """Strict JSON: NaN and infinities (a diverged loss, say) become null, which every JSON reader accepts."""
    return json.dumps(_finite(obj), indent=indent, default=_plain, allow_nan=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    if hasattr(value, "tolist"):  # numpy and torch scalars and arrays
        return _finite(value.tolist())
    return value


def _plain(value: Any) -> Any:
    """JSON fallback for numpy and torch scalars/arrays that end up in records."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot store {type(value).__name__} in a JSON record")

"""The prepared arrays of Hugging Face datasets: ``<cache>/fedhet-prepared/<key>.npz``, written atomically, checked on
every read, listed and removed by ``fedhet cache list`` and ``fedhet cache clean``.

A file holds the arrays and ``meta`` (JSON): the dataset's own metadata (task, class names, ...), what it was
prepared from (``about``: the source, the settings, when) and the sha256 of the arrays (names, dtypes, shapes,
bytes). zip's CRC-32 catches most damage, but numpy reads a member's header before its CRC is checked, and a bit
flip in the header (a shape, a dtype) is caught by no CRC at all: the sha256 is checked on every read, so a file
that is truncated, emptied, bit-flipped or lacks a member is prepared again and replaced, never trusted.

A file is written to ``.<key>.npz.<pid>.tmp`` and renamed over the old one (``os.replace``), so a reader sees the
old file or the new one. A write killed midway leaves its temporary file behind: the next load removes those whose
process has ended. Only names of these two forms are ever read, listed or removed in the folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import time
from pathlib import Path
from typing import Any

import numpy as np

CACHE_VERSION = 2  # bump when the prepared arrays of the same settings change (2: the sha256 and "about" in meta)
PREPARED = re.compile(r"[0-9a-f]{32}\.npz")
TEMPORARY = re.compile(r"\.([0-9a-f]{32})\.npz\.(\d+)\.tmp")
ARRAYS = ("x_train", "y_train", "x_test", "y_test")


def digest(arrays: dict[str, np.ndarray]) -> str:
    """The sha256 of the arrays: each one's name, dtype and shape, then its bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(json.dumps([name, a.dtype.str, list(a.shape)]).encode())
        h.update(a.reshape(-1).view(np.uint8))
    return h.hexdigest()


def read(path: Path) -> tuple[dict | None, str | None]:
    """``({"arrays", "meta"}, None)``, or ``(None, why it cannot be used)``: why is None for a file not there."""
    if not path.exists():
        return None, None
    try:
        with np.load(path, allow_pickle=False) as data:
            stored = json.loads(bytes(data["meta"]).decode())
            arrays = {k: data[k] for k in data.files if k != "meta"}
    except Exception as exc:  # a damaged zip raises anything (BadZipFile, EOFError, ValueError, ...)
        return None, " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
    missing = [k for k in ARRAYS if k not in arrays]
    if not isinstance(stored, dict) or stored.get("version") != CACHE_VERSION or "dataset" not in stored:
        return None, "it was written by another version of fedhet"
    if missing:
        return None, f"it lacks {', '.join(missing)}"
    if stored.get("sha256") != digest(arrays):
        return None, "its arrays do not match their recorded sha256"
    with contextlib.suppress(OSError):
        os.utime(path)  # its modification time is when it was last used: what `fedhet cache clean` goes by
    return {"arrays": arrays, "meta": stored["dataset"]}, None


def write(path: Path, prepared: dict, about: dict[str, Any]) -> None:
    """Atomically (a temporary file renamed); a cache that cannot be written only costs the next run time."""
    arrays = prepared["arrays"]
    stored = {"version": CACHE_VERSION, "sha256": digest(arrays), "about": about, "dataset": prepared["meta"]}
    meta = np.frombuffer(json.dumps(stored).encode(), np.uint8)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            np.savez(f, meta=meta, **arrays)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()


def alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return pid > 0  # another user's process (alive), or not a pid at all
    return True


def leftover_temporaries(folder: Path) -> list[Path]:
    """The temporary files of writes whose process has ended (killed midway)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    found = []
    for name in names:
        match = TEMPORARY.fullmatch(name)
        if match and not alive(int(match.group(2))):
            found.append(folder / name)
    return found


def remove_leftovers(folder: Path) -> None:
    for path in leftover_temporaries(folder):
        with contextlib.suppress(OSError):
            path.unlink()


# ----------------------------------------------------------------------------------------------------------
# Listing and cleaning (fedhet cache list | clean)


def about_of(path: Path) -> dict | None:
    """What a prepared file was prepared from (its ``about``), read without its arrays; None when it is
    unreadable or from another version of fedhet."""
    try:
        with np.load(path, allow_pickle=False) as data:
            stored = json.loads(bytes(data["meta"]).decode())
    except Exception:  # damaged: listed as such
        return None
    if not isinstance(stored, dict) or stored.get("version") != CACHE_VERSION:
        return None
    return stored.get("about") if isinstance(stored.get("about"), dict) else None


def entries(folder: Path) -> list[dict[str, Any]]:
    """Every file of fedhet's in ``folder``, oldest use first: ``path``, ``size``, ``used`` (a time),
    ``about`` (None: damaged or another version's) and ``temporary`` (a killed write's leftover)."""
    out = []
    leftovers = set(leftover_temporaries(folder))
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    for name in names:
        path = folder / name
        temporary = path in leftovers
        if not (PREPARED.fullmatch(name) or temporary):
            continue
        try:
            st = path.stat()
        except OSError:
            continue
        about = None if temporary else about_of(path)
        out.append({"path": path, "size": st.st_size, "used": st.st_mtime, "about": about, "temporary": temporary})
    return sorted(out, key=lambda e: e["used"])


def describe(entry: dict[str, Any]) -> tuple[str, str]:
    """(the dataset, a summary of its settings) of an entry, in words."""
    if entry["temporary"]:
        return "(left by a killed write)", ""
    about = entry["about"]
    if about is None:
        return "(damaged, or written by another version of fedhet)", ""
    source = about.get("source", "?")
    hub = [f"{k}={about[k]}" for k in ("subset", "revision") if about.get(k)]
    settings = ", ".join(f"{k}={v}" for k, v in sorted(about.get("settings", {}).items()))
    return source + (f" ({', '.join(hub)})" if hub else ""), settings or "(defaults)"


def days_unused(entry: dict[str, Any], now: float | None = None) -> float:
    return ((now or time.time()) - entry["used"]) / 86400


def stale(entry: dict[str, Any], content_hash) -> bool:
    """Whether no current dataset can use the file: a killed write's leftover, a damaged file or another version's,
    or one of a local copy that is gone or whose files changed (``content_hash(path)`` gives their hash now).
    A hub dataset's file is kept: telling whether the hub's copy changed needs the network."""
    about = entry["about"]
    if entry["temporary"] or about is None:
        return True
    if about.get("kind") != "local":
        return False
    return content_hash(about["source"]) != about.get("content_hash")

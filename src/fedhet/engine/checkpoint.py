"""Checkpoint files a run can trust: sealed with a hash, loaded without running code, with a fallback.

A *sealed* file is a header (``MAGIC`` for a checkpoint, ``STATE_MAGIC`` for a client's state), the SHA-256 of the
payload in hex, a newline, then the payload (``torch.save`` of plain data: dicts, lists, strings, numbers and
tensors). Reading checks the hash before anything is unpickled and unpickles with ``weights_only=True``, so a
truncated, bit-flipped or foreign file is refused with its reason, naming it, and a file from someone else cannot
run code. Checkpoints and every persisted client state (``fedhet.engine.state``'s disk store and its snapshots, a
Flower node's state folder) use this one format. A file without the header, such as a client state written by a
fedhet from before they were sealed, cannot be checked and is refused like a corrupt one.

A folder keeps two checkpoints: ``last.pt`` and ``prev.pt`` (an older one). A write puts the new checkpoint in a
temporary file, gives the old ``last.pt`` a second, temporary name (a hard link), renames the new file over
``last.pt``, then the temporary name over ``prev.pt``. A kill at any point therefore leaves ``last.pt`` complete (the
old or the new checkpoint) and ``prev.pt`` a complete, *distinct* file: the one before ``last.pt``, or, killed
between the last two renames, the one before that. What a kill left behind (a hidden ``.ckpt-*.tmp``) is removed by
the next write and by a resume; a ``prev.pt`` that is a second name of ``last.pt`` (left by fedhet before this
order) is replaced by the next write, which never leaves a temporary behind.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fedhet.errors import ConfigError, FedhetError, RunFailed
from fedhet.paths import fsync_dir

MAGIC = b"FEDHET-CHECKPOINT-1\n"
STATE_MAGIC = b"FEDHET-STATE-1\n"
LAST, PREV = "last.pt", "prev.pt"
TMP_PREFIX = ".ckpt-"  # write_checkpoint's temporaries: hidden, ending in .tmp (see remove_temporaries)
_ZIP = b"PK\x03\x04"  # how a bare torch.save file begins


class CheckpointError(FedhetError):
    """A checkpoint cannot be used: unreadable, corrupt, or referring to state that is gone."""


class StateFileError(CheckpointError, RunFailed):
    """A persisted client state that cannot be trusted: unreadable, truncated, modified, unsealed, or not the file
    its checkpoint recorded; the message names the file.

    At resume it makes the checkpoint naming it unusable (``load_latest`` falls back to ``prev.pt`` or refuses); read
    while training it stops the run (a ``RunFailed``: summary.json records it, the last checkpoint stays) instead of
    dropping the client as a client failure."""


@dataclass
class Loaded:
    path: Path
    state: dict[str, Any]


# ------------------------------------------------------------------ sealed files (checkpoints and client states)
def seal(obj: Any, magic: bytes = MAGIC) -> bytes:
    """``obj`` as the bytes of a sealed file: ``magic``, the payload's SHA-256 in hex, a newline, the payload."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    payload = buffer.getvalue()
    return magic + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload


def write_sealed(path: Path, obj: Any, magic: bytes, prefix: str = "tmp", fsync: bool = False) -> None:
    """Seal ``obj`` into ``path`` atomically: a temporary file (``prefix``...``.tmp``) in the same folder, renamed over
    ``path``; nothing is left behind if it fails."""
    tmp = _write_temporary(path, seal(obj, magic), prefix, fsync)
    try:
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def sealed_payload(path: Path, magic: bytes, what: str, error: type[CheckpointError] = CheckpointError) -> bytes:
    """The payload of the sealed file ``path`` once its hash matched; ``error`` (naming ``path``) says why not."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise error(f"{path}: cannot be read ({err.strerror or err})") from None
    if not data.startswith(magic):
        if data.startswith(_ZIP):
            raise error(
                f"{path}: a {what} with no SHA-256 header (written by an older fedhet, or by something else): it "
                "cannot be checked, so it is not used"
            )
        raise error(f"{path}: not a {what} (no header; truncated, or another kind of file)")
    digest, _, payload = data[len(magic) :].partition(b"\n")
    if hashlib.sha256(payload).hexdigest().encode() != digest:
        raise error(f"{path}: corrupt (its content does not match its SHA-256; truncated or modified)")
    return payload


def read_sealed(
    path: Path,
    magic: bytes,
    what: str,
    error: type[CheckpointError] = CheckpointError,
    map_location: str | torch.device | None = "cpu",
) -> Any:
    """What the sealed file ``path`` holds, unpickled with ``weights_only=True`` after its hash matched."""
    payload = sealed_payload(path, magic, what, error)
    try:
        return torch.load(io.BytesIO(payload), weights_only=True, map_location=map_location)
    except Exception as err:  # a sealed payload that still does not load: refuse, never execute it
        raise error(f"{path}: unreadable payload ({type(err).__name__}: {_first_line(err)})") from None


def sealed_digest(path: Path, magic: bytes) -> str | None:
    """The SHA-256 that the sealed file ``path`` records in its header (not checked here), or None without one."""
    with open(path, "rb") as f:
        head = f.read(len(magic) + 65)
    if not head.startswith(magic) or len(head) < len(magic) + 65 or head[-1:] != b"\n":
        return None
    return head[len(magic) : -1].decode("ascii", "replace")


# ------------------------------------------------------------------ checkpoints
def write_checkpoint(folder: Path, state: dict[str, Any], rotate: bool = True) -> Path:
    """Seal ``state`` into ``folder/last.pt``; the previous ``last.pt`` becomes ``prev.pt`` when ``rotate``.

    Temporaries a killed earlier write left in ``folder`` are removed first (the run folder has one writer)."""
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob(f"{TMP_PREFIX}*.tmp"):
        old.unlink(missing_ok=True)
    last, prev = folder / LAST, folder / PREV
    new = _write_temporary(last, seal(state, MAGIC), TMP_PREFIX, fsync=True)
    old = None
    try:
        if rotate and last.exists():
            old = _second_name(last)  # the old last.pt under a temporary name: never a moment without it
        os.replace(new, last)
        if old is not None:
            _rename(old, prev)
    except BaseException:
        for tmp in (new, old):
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(folder)
    return last


def read_checkpoint(path: Path) -> dict[str, Any]:
    """The state sealed in ``path``; a ``CheckpointError`` says why it cannot be trusted."""
    state = read_sealed(path, MAGIC, "fedhet checkpoint")
    if not isinstance(state, dict) or "round" not in state:
        raise CheckpointError(f"{path}: holds no fedhet run state")
    return state


def load_latest(folder: Path, use=None, check=None, verify=None) -> tuple[Loaded | None, list[str]]:
    """The newest usable checkpoint in ``folder`` (``last.pt``, else ``prev.pt``) and why others were skipped.

    ``check(state)`` (optional, changing nothing) raises ``ConfigError`` for a checkpoint this run cannot continue
    (another config, more rounds than asked, another trace file, other data). ``use(state)`` takes a checkpoint up; it
    may raise ``CheckpointError``, having changed nothing, for one that reads fine but cannot be used (client states
    it names are gone or damaged: the disk store verifies every file's SHA-256 first), and the next candidate is tried
    then. ``verify(state)`` raises what ``use`` would, changing nothing.

    The problems returned (each naming its file) are what a resume warns about: a corrupt or unusable ``last.pt``,
    or a missing one while ``prev.pt`` exists. A ``ConfigError`` is not skipped over: a ``last.pt`` this run cannot
    continue is refused, naming it; when ``prev.pt`` passes ``check`` and ``verify`` (every test that a resume from
    it would meet) the message says so and that deleting a ``last.pt`` copied from another run resumes from it.
    (Falling back silently could throw away a run's real ``last.pt`` when the user, not the file, is wrong: that is
    the user's call.)"""
    problems = []
    last, prev = folder / LAST, folder / PREV
    if not last.exists() and prev.exists():
        problems.append(f"{last} is missing")
    for path in (last, prev):
        if not path.exists():
            continue
        try:
            state = read_checkpoint(path)
        except CheckpointError as err:
            problems.append(str(err))
            continue
        try:
            if check is not None:
                check(state)
            if use is not None:
                use(state)
            return Loaded(path, state), problems
        except CheckpointError as err:
            problems.append(f"{path}: {err}")
        except ConfigError as err:
            tests = [t for t in (check, verify) if t is not None] if path == last and check is not None else []
            raise _refused(path, err, problems, prev, tests) from None
    return None, problems


def _refused(path: Path, err: ConfigError, problems: list[str], prev: Path, tests: list) -> ConfigError:
    """The error for a checkpoint ``check`` refused, naming it and the problems before it; ``prev`` is named as the
    way on only when every one of ``tests`` (``check`` and ``verify``; none: no advice) passes on it, so that
    following the advice never costs ``last.pt`` for a ``prev.pt`` that would be refused too."""
    message = f"{path}: {err}"
    if problems:
        message = f"{'; '.join(problems)}; {message}"
    if tests and prev.exists():
        try:
            state = read_checkpoint(prev)
            for test in tests:
                test(state)
        except (CheckpointError, ConfigError):
            pass
        else:
            message += (
                f"; {prev} (round {state['round']}) can be resumed with this config: if {path.name} was copied here "
                f"from another run, delete {path} and resume again to continue from {prev.name}"
            )
    return ConfigError(message)


def remove_temporaries(folder: Path) -> None:
    """Temporary files a killed write left in ``folder``: fedhet's own, hidden and ending in ``.tmp``."""
    for tmp in folder.glob(".*.tmp") if folder.is_dir() else []:
        tmp.unlink(missing_ok=True)


def _write_temporary(path: Path, data: bytes, prefix: str, fsync: bool) -> str:
    """``data`` in a new temporary file next to ``path``; its name. A failed write leaves nothing and reports
    ``path`` (the file meant) in the ``OSError``, e.g. of a full disk."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=prefix, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(err, OSError) and err.filename is None and err.errno is not None:
            raise OSError(err.errno, err.strerror, str(path)) from None
        raise
    return tmp


def _second_name(src: Path) -> str:
    """A new temporary name (a hard link, or a copy where links are not supported) for ``src``."""
    fd, tmp = tempfile.mkstemp(dir=src.parent, prefix=TMP_PREFIX, suffix=".tmp")
    os.close(fd)
    os.unlink(tmp)
    try:
        try:
            os.link(src, tmp)
        except OSError:
            shutil.copy2(src, tmp)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return tmp


def _rename(src: str, dst: Path) -> None:
    """Rename ``src`` over ``dst``. Where both already name one file, rename does nothing and reports success
    (POSIX): ``src`` is then an extra name, removed here so that no temporary is left."""
    os.replace(src, dst)
    Path(src).unlink(missing_ok=True)


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else ""

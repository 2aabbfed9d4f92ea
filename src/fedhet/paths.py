"""Checks of the paths a user gives: config file, data folder, plug-ins, output folders and files, tracker folders.

Every path-valued setting goes through one of three checks before anything is read or written, so an odd path (a
name longer than the file system allows, a FIFO, a device file, a folder where a file belongs or the other way
round, a dangling symbolic link, no permission) is one ``ConfigError`` line that names the setting, the path and the
problem, never a traceback, a hang or a half-written folder:

* ``check_input_file(path, what)``: a regular file to read (optionally at most ``max_bytes``);
* ``check_output_file(path, what)``: a file to write (absent, or a regular writable file; its folder can be made);
* ``check_folder(path, what, ...)``: a folder to read from, or to write into (``writable``), which may be made
  (``creatable``).

Nothing here creates or opens anything; permission checks (``os.access``) pass for root.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path

from fedhet.errors import ConfigError
from fedhet.params import shown

# where os.pathconf cannot tell (Windows, a file system that does not say): the common POSIX limits
NAME_MAX = 255
PATH_MAX = 4096

PathLike = str | os.PathLike


class PathError(ConfigError):
    """A path-valued setting that cannot be used; the message names the setting, the path and the problem."""

    def __init__(
        self, what: str, path: PathLike, problem: str, role: str | None = None, setting: str | None = None
    ) -> None:
        self.what, self.path, self.problem, self.role = what, os.fspath(path), problem, role
        where = f"{what} {quoted(path)}" + (f" ({setting})" if setting else "")
        super().__init__(f"{where} cannot be used as {role}: it {problem}" if role else f"{where} {problem}")


def quoted(path: PathLike) -> str:
    """The path as messages show it: quoted, and cut short if huge."""
    return shown(os.fspath(path), 160)


def nearest_existing(path: PathLike) -> Path:
    """The nearest folder at or above ``path`` that exists (the working directory's file system for a relative one)."""
    p = Path(os.path.abspath(os.fspath(path)))
    for candidate in (p, *p.parents):
        if os.path.isdir(candidate):  # False, not an error, for names too long or unreachable
            return candidate
    return Path(p.anchor or "/")


def limits(path: PathLike, here: bool = True) -> tuple[int, int]:
    """(longest name, longest path) in bytes of the file system ``path`` is on (or would be made on).

    ``here=False`` for a path used on another machine: the common limits, 255 and 4096."""
    if not here:
        return NAME_MAX, PATH_MAX
    base = nearest_existing(path)
    out = []
    for key, fallback in (("PC_NAME_MAX", NAME_MAX), ("PC_PATH_MAX", PATH_MAX)):
        try:
            value = os.pathconf(base, key)
        except (AttributeError, OSError, ValueError):  # no pathconf (Windows), or the file system does not say
            value = -1
        out.append(value if value and value > 0 else fallback)
    return out[0], out[1]


def name_problem(path: PathLike, here: bool = True, reserve: int = 0) -> str | None:
    """What is wrong with ``path`` as a name, before the file system is asked: a NUL byte, a part longer than the
    file system's name limit (PC_NAME_MAX), or a whole longer than its path limit (PC_PATH_MAX, less ``reserve``
    bytes kept for files inside it); None when it is fine."""
    text = os.fspath(path)
    if "\x00" in text:
        return "contains a NUL character"
    try:
        parts = [os.fsencode(part) for part in Path(text).parts]
        whole = os.fsencode(os.path.abspath(text))
    except UnicodeError:
        return "cannot be encoded as a file name on this system"
    name_max, path_max = limits(text, here)
    for part in parts:
        if len(part) > name_max:
            name = shown(os.fsdecode(part), 40)
            return (
                f"has a name of {len(part)} bytes ({name}); the file system allows at most {name_max} bytes per "
                "file or folder name (PC_NAME_MAX)"
            )
    if len(whole) + reserve >= path_max:
        room = f" with room for the files inside it ({reserve} bytes)" if reserve else ""
        return f"is {len(whole)} bytes long{room}; the file system allows at most {path_max - 1} bytes per path"
    return None


def kind(mode: int) -> str:
    """'a file', 'a folder', 'a FIFO (named pipe)', ... for a stat mode."""
    if stat.S_ISREG(mode):
        return "a file"
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a special file"


def _stat(path: Path, fail) -> os.stat_result | None:
    """``os.stat`` of ``path`` (following links), None if nothing is there; every other outcome is ``fail(problem)``:
    a dangling link, a link loop, a file on the way, no permission to reach it."""
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as err:
        fail(_reach_problem(path, err))
    if not stat.S_ISLNK(found.st_mode):
        return found
    try:
        return os.stat(path)
    except FileNotFoundError:
        fail(f"is a symbolic link to {quoted(os.readlink(path))}, which does not exist (a dangling link)")
    except OSError as err:
        if err.errno == errno.ELOOP:
            fail("is a loop of symbolic links")
        fail(_reach_problem(path, err))
    raise AssertionError("unreachable")  # pragma: no cover


def _reach_problem(path: Path, err: OSError) -> str:
    if err.errno == errno.ENOTDIR:
        blocker = next((p for p in path.parents if os.path.lexists(p) and not os.path.isdir(p)), None)
        if blocker is not None:
            return f"lies under {quoted(blocker)}, which is {kind(os.stat(blocker).st_mode)}, not a folder"
        return "lies under a file, not a folder"
    if err.errno in (errno.EACCES, errno.EPERM):
        return "cannot be reached (permission denied on a folder above it)"
    if err.errno == errno.ELOOP:
        return "lies under a loop of symbolic links"
    if err.errno == errno.ENAMETOOLONG:
        return "is longer than the file system allows"
    return f"cannot be reached ({err.strerror or err})"


def _creatable_problem(path: Path) -> str | None:
    """Why a file or folder at ``path`` (absent) could not be made, with the folders above it: the nearest existing
    one must be a folder this process may write in."""
    for parent in path.parents:
        if not os.path.lexists(parent):
            continue
        if os.path.islink(parent) and not os.path.exists(parent):
            return (
                f"lies under {quoted(parent)}, a symbolic link to {quoted(os.readlink(parent))}, which does not exist"
            )
        if not os.path.isdir(parent):
            return f"lies under {quoted(parent)}, which is {kind(os.stat(parent).st_mode)}, not a folder"
        if not os.access(parent, os.W_OK | os.X_OK):
            return f"cannot be created in {quoted(parent)} (permission denied)"
        return None
    return None


def _raiser(what: str, path: PathLike, role: str | None, setting: str | None):
    def fail(problem: str):
        raise PathError(what, path, problem, role, setting)

    return fail


def check_input_file(
    path: PathLike,
    what: str,
    *,
    max_bytes: int | None = None,
    noun: str = "file",
    role: str | None = None,
    setting: str | None = None,
) -> Path:
    """``path`` as a regular file this process may read, of at most ``max_bytes``; else a ``PathError``."""
    fail = _raiser(what, path, role, setting)
    problem = name_problem(path)
    if problem:
        fail(problem)
    p = Path(path)
    found = _stat(p, fail)
    if found is None:
        fail("does not exist")
    if stat.S_ISDIR(found.st_mode):
        fail(f"is a folder, not a {noun}")
    if not stat.S_ISREG(found.st_mode):
        fail(f"is {kind(found.st_mode)}, not a regular file")
    if max_bytes is not None and found.st_size > max_bytes:
        fail(f"is {size_text(found.st_size)}; a {noun} may be at most {size_text(max_bytes)}")
    if not os.access(p, os.R_OK):
        fail("cannot be read (permission denied)")
    return p


def check_output_file(path: PathLike, what: str, *, role: str | None = None, setting: str | None = None) -> Path:
    """``path`` as a file this process may write: absent (its folder existing or creatable) or a regular writable
    file, which writing replaces; else a ``PathError``. A FIFO or device file is refused: writing to it would hang
    or throw the output away."""
    fail = _raiser(what, path, role, setting)
    problem = name_problem(path)
    if problem:
        fail(problem)
    p = Path(path)
    found = _stat(p, fail)
    if found is None:
        problem = _creatable_problem(Path(os.path.abspath(p)))
        if problem:
            fail(problem)
        return p
    if stat.S_ISDIR(found.st_mode):
        fail("is a folder, not a file")
    if not stat.S_ISREG(found.st_mode):
        fail(f"is {kind(found.st_mode)}, not a regular file")
    if not os.access(p, os.W_OK):
        fail("cannot be written (permission denied)")
    return p


def check_folder(
    path: PathLike,
    what: str,
    *,
    writable: bool = False,
    creatable: bool = False,
    must_exist: bool = False,
    reserve: int = 0,
    role: str | None = None,
    setting: str | None = None,
) -> Path:
    """``path`` as a folder: existing (or, with ``creatable``, one that can be made; without ``must_exist``, absent
    is fine) that this process may list and read (``writable``: also write in); else a ``PathError``. ``reserve``
    bytes of path length are kept for the files to be written inside it."""
    fail = _raiser(what, path, role, setting)
    problem = name_problem(path, reserve=reserve)
    if problem:
        fail(problem)
    p = Path(path)
    found = _stat(p, fail)
    if found is None:
        if must_exist:
            fail("does not exist")
        if creatable:
            problem = _creatable_problem(Path(os.path.abspath(p)))
            if problem:
                fail(problem)
        return p
    if not stat.S_ISDIR(found.st_mode):
        fail(f"is {kind(found.st_mode)}, not a folder")
    if not os.access(p, os.R_OK | os.X_OK):
        fail("cannot be read (permission denied)")
    if (writable or creatable) and not os.access(p, os.W_OK):
        fail("cannot be written (permission denied)")
    return p


def size_text(n: int) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} bytes"


MLFLOW_DB = "mlflow.db"  # the default MLflow store, in run.out_dir (results/trackers.py)
MLFLOW_ARTIFACTS = "mlartifacts"  # the artifacts of the runs in a SQLite store: beside the database


def sqlite_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI; None for any other store."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///") :].split("?", 1)[0]
    return None if path in ("", ":memory:") else Path(path)


def mlflow_paths(uri: str | None, out_dir: PathLike) -> list[tuple[Path, str]]:
    """The local paths an MLflow tracking URI writes, each as (path, what it is; "MLflow database" is a file): for
    the default store (``sqlite:///<out_dir>/mlflow.db``, results/trackers.py) and any ``sqlite:///`` URI the
    database file and the ``mlartifacts`` folder beside it; for a file store (``file:`` URI or a plain path) its
    folder; none for a server or another database."""
    from urllib.parse import unquote, urlparse

    database = Path(out_dir) / MLFLOW_DB if uri is None else sqlite_path(uri)
    if database is not None:
        return [(database, "MLflow database"), (database.parent / MLFLOW_ARTIFACTS, "MLflow artifacts folder")]
    if uri is None or uri.startswith("sqlite:"):  # sqlite:// in memory
        return []
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        return [(Path(unquote(parsed.path)), "MLflow store")]
    if not parsed.scheme or len(parsed.scheme) == 1:  # a plain path (a Windows drive letter looks like a scheme)
        return [(Path(uri), "MLflow store")]
    return []


def replace_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that a reader sees the old file or the whole new one: a temporary file in the
    same folder, synced, renamed over it, and the rename synced."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(folder: Path) -> None:
    # Makes the rename itself durable on POSIX; directories cannot be opened this way on Windows.
    if not hasattr(os, "O_DIRECTORY"):
        return
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

"""Finding dataset files on disk (and downloading them when allowed), and reading them.

Files are looked up in one place only: the ``data_dir`` argument (CLI ``--data-dir``, config ``dataset.data_dir``)
if given, else ``$FEDHET_DATA/<name>`` and then ``$FEDHET_DATA`` if that is set, else ``/usr/share/datasets/<name>``
(where Debian's dataset packages install); each also under the usual sub-folder names (``fashion-mnist/``,
``FashionMNIST/raw/``). ``data_dir`` and ``$FEDHET_DATA`` are explicit: if the data is not there (missing folder, a
file, some files missing), that is an error naming the location and the expected files, never a silent fall back
to another copy; ``download=True`` downloads into the explicit location (``$FEDHET_DATA/<name>`` for the variable).
"""

from __future__ import annotations

import gzip
import hashlib
import os
import shutil
import tarfile
import threading
import urllib.request
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

from fedhet.data.types import DataError

ENV_VAR = "FEDHET_DATA"
SYSTEM_DATA_DIR = Path("/usr/share/datasets")


# ----------------------------------------------------------------------------------------------------------
# Finding and fetching files


@dataclass(frozen=True)
class Source:
    """Where a dataset may live on disk and how a user gets it."""

    name: str
    subdirs: tuple[str, ...]
    how_to_get: str
    urls: tuple[str, ...] = ()


@dataclass(frozen=True)
class Entry:
    """One file (or folder) a dataset folder must hold: its name in messages and its accepted relative paths."""

    label: str
    names: tuple[str, ...]
    folder: bool = False

    def find(self, directory: Path) -> Path | None:
        """The first accepted path of the right kind, else the first that exists at all (so that its reader says
        what is wrong with it instead of the folder being skipped), else None."""
        paths = [directory / n for n in self.names]
        right_kind = os.path.isdir if self.folder else os.path.isfile
        return next((p for p in paths if right_kind(p)), None) or next((p for p in paths if os.path.lexists(p)), None)


@dataclass(frozen=True)
class Location:
    """A place the user named explicitly: the ``data_dir`` argument or ``$FEDHET_DATA``."""

    root: Path
    via: str  # "data_dir" or "FEDHET_DATA"

    def __str__(self) -> str:
        return f"data_dir {self.root}" if self.via == "data_dir" else f"{ENV_VAR}={self.root}"


def explicit_location(data_dir: str | Path | None) -> Location | None:
    """The location the user gave, if any: ``data_dir`` wins over ``$FEDHET_DATA`` (an empty value counts as unset)."""
    if data_dir:
        return Location(Path(data_dir).expanduser(), "data_dir")
    if os.environ.get(ENV_VAR):
        return Location(Path(os.environ[ENV_VAR]).expanduser(), ENV_VAR)
    return None


def candidate_dirs(source: Source, data_dir: str | Path | None) -> list[Path]:
    """Every directory searched for ``source``, in search order.

    An explicit location (``data_dir``, else ``$FEDHET_DATA``) is searched alone, its dataset sub-folders first and
    then the folder itself; fedhet never falls back from it to another copy, so a run cannot silently read data
    other than the data the user pointed at. Only when neither is given is the system folder searched."""
    location = explicit_location(data_dir)
    if location is None:
        return system_dirs(source)
    return list(dict.fromkeys([*(location.root / s for s in source.subdirs), location.root]))


def system_dirs(source: Source) -> list[Path]:
    """Where Debian's dataset packages install ``source``."""
    return [SYSTEM_DATA_DIR / s for s in source.subdirs]


def find_dir(source: Source, data_dir, entries: list[Entry], download: bool = False) -> tuple[Path, list[Path]]:
    """The first candidate directory that holds every entry, with the path of each; downloads if allowed and needed."""
    dirs = candidate_dirs(source, data_dir)
    for d in dirs:
        if os.path.isdir(d):
            paths = [e.find(d) for e in entries]
            if all(paths):
                return d, paths
    if download:
        fetch(source, download_dir(source, data_dir))
        return find_dir(source, data_dir, entries)
    raise missing_error(source, data_dir, dirs, entries)


def folder_problem(path: Path) -> str | None:
    """Why ``path`` cannot be searched as a folder (does not exist, is a file, unreadable), or None if it can."""
    try:
        os.listdir(path)
    except OSError as exc:
        return os_problem(exc)
    return None


def what_is_missing(dirs: list[Path], entries: list[Entry]) -> str:
    """The folder of ``dirs`` closest to complete and what it lacks, or that none holds any of the files."""
    found = {d: [e for e in entries if e.find(d)] for d in dirs if folder_problem(d) is None}
    best = max(found, key=lambda d: len(found[d]), default=None)
    if best is None or not found[best]:
        return ""
    missing = [e.label for e in entries if e not in found[best]]
    return f"{best} has only some of the files: missing {', '.join(missing)}"


def missing_error(source: Source, data_dir, dirs: list[Path], entries: list[Entry]) -> DataError:
    name, expected = source.name, ", ".join(e.label for e in entries)
    location = explicit_location(data_dir)
    if location is None:
        download = " or allow a download with download=True (CLI: -s dataset.download=true)" if source.urls else ""
        partial = what_is_missing(dirs, entries)
        return DataError(
            f"dataset {name!r} not found; looked in: {', '.join(map(str, dirs))}"
            f"{f' ({partial})' if partial else ''}; it needs {expected}. {source.how_to_get}. "
            f"Then point fedhet at it with --data-dir DIR or {ENV_VAR}=DIR{download}."
        )
    problem = folder_problem(location.root)
    if problem is None:
        partial = what_is_missing(dirs, entries)
        problem = f"is incomplete: {partial}" if partial else "holds none of the files (nor do its sub-folders)"
    subdirs = ", ".join(f"{s}/" for s in source.subdirs)
    system = next((d for d in system_dirs(source) if all(e.find(d) for e in entries)), None)
    if location.via == "data_dir":
        fix = (
            "an explicit data_dir (--data-dir, dataset.data_dir) is never replaced by another copy: point it at the "
            f"folder that holds the files{f', or drop it to use the system copy at {system}' if system else ''}"
        )
        target = location.root
    else:
        target = location.root / name
        fix = (
            f"{ENV_VAR} is an explicit location, so fedhet does not fall back to "
            f"{f'the system copy at {system}' if system else SYSTEM_DATA_DIR}: put the files in {target}"
            f"{f' (e.g. ln -s {system} {target})' if system else ''}, pass --data-dir DIR, or unset {ENV_VAR}"
        )
    download = f"; or download them into {target} with download=True (CLI: -s dataset.download=true)"
    return DataError(
        f"dataset {name!r}: {location} {problem}; expected {expected} in it or in one of its sub-folders {subdirs}. "
        f"Fix: {fix}{download if source.urls else ''}. {source.how_to_get}."
    )


def download_dir(source: Source, data_dir) -> Path:
    location = explicit_location(data_dir)
    if location is None:
        raise DataError(f"download=True needs a place for {source.name!r}: pass --data-dir DIR or set {ENV_VAR}")
    target = location.root if location.via == "data_dir" else location.root / source.name
    if os.path.exists(target) and not os.path.isdir(target):
        raise DataError(f"dataset {source.name!r}: cannot download into {location}: {target} is a file, not a folder")
    return target


def fetch(source: Source, target: Path) -> None:
    """Download every URL of ``source`` into ``target`` and unpack archives there."""
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(f"cannot create the download folder {target}: {exc.strerror or exc}") from None
    for url in source.urls:
        path = target / url.rsplit("/", 1)[-1]
        tmp = path.with_name(path.name + ".part")
        try:
            with urllib.request.urlopen(url, timeout=60) as response, open(tmp, "wb") as out:
                shutil.copyfileobj(response, out)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise DataError(f"could not download {url}: {exc}") from None
        tmp.replace(path)
        unpack(path, target)


def unpack(path: Path, target: Path) -> None:
    try:
        if path.name.endswith((".tar.gz", ".tgz")):
            with tarfile.open(path) as tar:
                safe_extract(tar, target)
        elif path.suffix == ".zip":
            with zipfile.ZipFile(path) as archive:
                archive.extractall(target)
        else:
            return
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError, zlib.error) as exc:
        raise DataError(f"{path}: corrupt archive, could not unpack it ({exc}); delete it and download again") from None
    path.unlink()


def safe_extract(tar: tarfile.TarFile, target: Path) -> None:
    if hasattr(tarfile, "data_filter"):
        # The "data" filter refuses absolute paths, links out of target and device files.
        tar.extractall(target, filter="data")
        return
    root = target.resolve()
    for member in tar.getmembers():
        if not (target / member.name).resolve().is_relative_to(root) or member.issym() or member.islnk():
            raise DataError(f"refusing to extract {member.name!r}: it would land outside {target}")
    tar.extractall(target)


# ----------------------------------------------------------------------------------------------------------
# Reading files: every problem is a one-line DataError that names the file


def os_problem(exc: OSError) -> str:
    """What an OS error means for a data path, in words."""
    if isinstance(exc, IsADirectoryError):
        return "is a folder, not a file"
    if isinstance(exc, NotADirectoryError):
        return "is a file, not a folder"
    if isinstance(exc, FileNotFoundError):
        return "does not exist"
    if isinstance(exc, PermissionError):
        return "cannot be read (permission denied)"
    return f"cannot be read ({exc.strerror or exc})"


class Manifest:
    """The files a loader read under ``root``, with the sha256 of each: the provenance fields of ArrayDataset."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.hashes: dict[str, str] = {}
        self.lock = threading.Lock()  # loaders read files from several threads

    def record(self, path: Path, data: bytes) -> None:
        try:
            name = Path(path).relative_to(self.root).as_posix()
        except ValueError:
            name = str(path)
        digest = hashlib.sha256(data).hexdigest()  # releases the GIL, so threads hash in parallel
        with self.lock:
            self.hashes[name] = digest

    def fields(self) -> dict:
        """``source_dir``, ``source_files`` (sorted) and ``content_hash``: the sha256 of the ``sha256sum`` listing."""
        names = sorted(self.hashes)
        listing = "".join(f"{self.hashes[n]}  {n}\n" for n in names)
        return {
            "source_dir": os.path.abspath(self.root),
            "source_files": tuple(names),
            "content_hash": hashlib.sha256(listing.encode()).hexdigest(),
        }


def read_file(path: Path, manifest: Manifest | None = None) -> bytes:
    """Every byte of ``path`` (recorded in ``manifest``); an unreadable or empty file is a DataError naming it."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise DataError(f"{path}: {os_problem(exc)}") from None
    if not data:
        raise DataError(f"{path}: empty file (0 bytes)")
    if manifest is not None:
        manifest.record(path, data)
    return data


def read_text(path: Path, manifest: Manifest | None = None) -> str:
    data = read_file(path, manifest)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def gunzip(path: Path, data: bytes) -> bytes:
    if data[:2] != b"\x1f\x8b":
        raise DataError(f"{path}: not a gzip file, although its name ends in .gz (it starts with {data[:4].hex()})")
    # zlib reads one gzip member faster than the gzip module; anything unusual goes to the gzip module.
    stream = zlib.decompressobj(zlib.MAX_WBITS | 16)
    try:
        out = stream.decompress(data)
        if stream.eof and not stream.unused_data:
            return out
    except zlib.error:
        pass
    try:
        return gzip.decompress(data)
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError(f"{path}: truncated or corrupt gzip file ({exc})") from None

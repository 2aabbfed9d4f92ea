"""The package on its own: an sdist built from the sources, a wheel built from that sdist, installed into a fresh
virtual environment, and `fedhet` run from an empty folder there, away from this checkout.

Two environments get the wheel:

* ``test-env``: no network. The new environment sees the test environment's installed packages through a ``.pth``
  line (a plain path: the ``.pth`` files inside it, such as an editable fedhet's, are not read), and its own
  site-packages comes first, so ``import fedhet`` finds the installed wheel (checked).
* ``index``: a bare install as a user makes it: the CPU build of the test environment's torch, then the wheel with
  the dependencies pip resolves today from the package index (the newest that fedhet's bounds allow), none of the
  test environment's. Skipped when the index cannot be reached or no CPU build of that torch is at hand (a plain
  ``torch==X`` would pull gigabytes of CUDA wheels). pip's cache makes later runs quicker.
"""

from __future__ import annotations

import os
import re
import shutil
import site
import subprocess
import sys
import sysconfig
import tarfile
import urllib.request
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytest
from filelock import FileLock
from packaging.version import Version

import fedhet

ROOT = Path(__file__).resolve().parents[1]
FMNIST = Path(os.environ.get("FEDHET_DATA", "/usr/share/datasets")) / "fashion-mnist"
# every file of the package (its modules and its data, such as fedhet/configs/demo.toml), as the wheel names it
PACKAGE_FILES = sorted(
    p.relative_to(ROOT / "src").as_posix()
    for p in (ROOT / "src" / "fedhet").rglob("*")
    if p.is_file() and "__pycache__" not in p.parts
)


PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check"]


def call(*args: str | Path, cwd: Path, env: dict[str, str] | None = None, timeout: float = 300) -> str:
    proc = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{args} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc.stdout


def build_sdist(tmp: Path) -> Path:
    """The sdist, built by setuptools' own build hook from a copy of the sources (the build writes egg-info)."""
    source = tmp / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    hook = "from setuptools import build_meta; print(build_meta.build_sdist('dist'))"
    name = call(sys.executable, "-c", hook, cwd=source).strip().splitlines()[-1]
    return source / "dist" / name


def build_wheel(tmp: Path) -> Path:
    """The wheel, built (offline) from the sdist; both hold every file of the package."""
    sdist = build_sdist(tmp)
    with tarfile.open(sdist) as tar:
        names = tar.getnames()
        tar.extractall(tmp / "unpacked", **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    top = f"fedhet-{fedhet.__version__}"
    assert "fedhet/configs/demo.toml" in PACKAGE_FILES
    missing = [f for f in PACKAGE_FILES if f"{top}/src/{f}" not in names]
    assert not missing, f"the sdist lacks {missing}"
    wheels = tmp / "wheels"
    call(
        *PIP,
        "wheel",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "-w",
        wheels,
        tmp / "unpacked" / top,
        cwd=tmp,
    )
    (built,) = wheels.glob("fedhet-*.whl")
    missing = [f for f in PACKAGE_FILES if f not in zipfile.ZipFile(built).namelist()]
    assert not missing, f"the wheel lacks {missing}"
    return built


def index_url() -> str:
    return os.environ.get("PIP_INDEX_URL") or "https://pypi.org/simple/"


def index_unreachable() -> str | None:
    """Why the package index cannot be used here, or None when it answers."""
    try:
        with urllib.request.urlopen(f"{index_url().rstrip('/')}/pip/", timeout=10):
            return None
    except OSError as err:
        return f"the package index {index_url()} is unreachable ({err}); the bare install needs it"


def install_from_index(python: Path, wheel: Path, tmp: Path) -> None:
    """torch's CPU build first (as the Makefile does), then the wheel, its dependencies resolved by pip."""
    reason = index_unreachable()
    if reason:
        pytest.skip(reason)
    torch = f"torch=={Version(version('torch')).base_version}+cpu"
    # --no-compile: byte-compiling all of torch takes longer than installing it; Python compiles what is imported
    install = [*PIP, "--python", python, "install", "-q", "--no-compile"]
    # without this process's PYTHONPATH: pip would count what it names as installed in the new environment
    env = bare_environment()
    proc = subprocess.run([*install, torch], capture_output=True, text=True, cwd=tmp, env=env, timeout=900)
    if proc.returncode and "No matching distribution found for torch" in proc.stderr:
        pytest.skip(f"no CPU build {torch} where pip looks (a plain torch==X would pull CUDA wheels)")
    assert proc.returncode == 0, proc.stderr[-3000:]
    call(*install, wheel, cwd=tmp, env=env, timeout=900)


def bare_environment() -> dict[str, str]:
    """This process's environment without what points Python at the test environment's packages."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}


def see_test_environment(python: Path, wheel: Path, tmp: Path) -> None:
    call(*PIP, "--python", python, "install", "-q", "--no-deps", "--no-index", wheel, cwd=tmp)
    ours = [sysconfig.get_path("purelib"), *site.getsitepackages()]
    (purelib_of(python, tmp) / "test_environment.pth").write_text("\n".join(dict.fromkeys(ours)) + "\n")


def purelib_of(python: Path, cwd: Path) -> Path:
    return Path(call(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))", cwd=cwd).strip())


def shared_folder(tmp_path_factory, name: str) -> Path:
    """A folder that every pytest-xdist worker of this session sees (the session's own without xdist)."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if "PYTEST_XDIST_WORKER" in os.environ else base) / name


@pytest.fixture(scope="module", params=["test-env", "index"])
def installed(request, tmp_path_factory) -> dict[str, Path]:
    """The wheel installed into a new virtual environment; its bin folder, a clean env and an empty folder.

    The environment is made once per session: the first worker to need it builds it, under a lock, and the
    others wait for it (the index install takes a minute or more)."""
    tmp = shared_folder(tmp_path_factory, f"wheel-{request.param}")
    venv = tmp / "env"
    python = venv / "bin" / "python"
    with FileLock(f"{tmp}.lock"):
        if not (tmp / "ready").exists():
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            wheel = build_wheel(tmp)
            call(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp)
            (install_from_index if request.param == "index" else see_test_environment)(python, wheel, tmp)
            (tmp / "ready").touch()

    env = bare_environment()
    env.update(COLUMNS="200", OMP_NUM_THREADS="1", PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}")
    empty = tmp_path_factory.mktemp("empty")
    location = call(python, "-c", "import fedhet; print(fedhet.__file__)", cwd=empty, env=env).strip()
    assert Path(location).is_relative_to(purelib_of(python, tmp)), f"fedhet imported from {location}, not the wheel"
    script = (venv / "bin" / "fedhet").read_text().splitlines()[0]
    assert script.startswith(f"#!{venv}"), f"the fedhet command runs {script}, not the new environment's Python"
    return {"bin": venv / "bin", "env": env, "empty": empty, "bare": request.param == "index"}


@pytest.mark.slow
def test_the_installed_package_reports_its_version_and_lists(installed):
    fedhet_cmd, run = installed["bin"] / "fedhet", {"cwd": installed["empty"], "env": installed["env"]}
    assert call(fedhet_cmd, "--version", **run).strip() == f"fedhet {fedhet.__version__}"  # no checkout: no commit
    listing = call(fedhet_cmd, "list", **run)
    for word in ("fmnist", "dirichlet", "mlp", "fedavg", "scaffold", "fedadam"):
        assert word in listing
    assert "train.lr" in call(fedhet_cmd, "list", "config", **run)
    assert call(fedhet_cmd, "demo", "--print-config", **run) == (ROOT / "src/fedhet/configs/demo.toml").read_text()
    assert not any(installed["empty"].iterdir())


@pytest.mark.slow
@pytest.mark.skipif(not FMNIST.is_dir(), reason="apt-get install dataset-fashion-mnist")
def test_the_installed_package_runs_the_demo_from_an_empty_folder(installed):
    """The README's demo, shrunk to one method and one round; the rest of its setting as shipped."""
    folder = installed["empty"] / "demo"
    folder.mkdir()
    out = call(installed["bin"] / "fedhet", "demo", "-v", "fedavg", "-r", "1", cwd=folder, env=installed["env"])
    assert "fedavg" in out and "table: demo-runs/comparison.md" in out
    runs = folder / "demo-runs"
    assert (runs / "comparison.md").read_text().count("| fedavg ") == 1
    assert (runs / "comparison.png").read_bytes().startswith(b"\x89PNG")
    assert sorted(p.name for p in folder.iterdir()) == ["demo-runs"]  # nothing written beside the output folder


@pytest.mark.slow
def test_the_installed_package_says_usage_errors_in_one_line_and_helps_plainly(installed):
    """A mistyped command, a missing or wrong option value: one ``error:`` line and exit 2 with the typer and click
    that the environment has; the help lists options without typer's own "<bool>" / "<path>" type tags."""
    fedhet_cmd, run = installed["bin"] / "fedhet", {"cwd": installed["empty"], "env": installed["env"]}
    bare = [(["flower", "simulate"], "error: fedhet flower simulate needs Flower (flwr), not installed")]
    for args, words in [
        *(bare if installed["bare"] else []),  # no extras: no flwr
        (["rn"], "error: no such command 'rn'. Did you mean 'run'?"),
        (["run", "--rounds"], "error: option '--rounds' requires an argument."),
        (["run", "-r", "abc"], "error: invalid value for '--rounds' / '-r': 'abc' is not a valid integer."),
    ]:
        proc = subprocess.run([fedhet_cmd, *args], capture_output=True, text=True, timeout=120, **run)
        assert proc.returncode == 2 and proc.stderr.startswith(words), proc.stderr[-3000:]
        assert proc.stderr.count("\n") == 1 and not proc.stdout, proc.stderr[-3000:]
    for args in ([], ["run"], ["list"]):
        text = call(fedhet_cmd, *args, "--help", **run)
        assert "--help" in text and not re.search(r"<(bool|path|int|text)>|``", text), text

"""The package on its own: an sdist built from the sources, a wheel built from that sdist, installed (no network) into
a fresh virtual environment, and `fedhet` run from an empty folder there, away from this checkout.

The new environment sees the test environment's installed packages through a ``.pth`` line (a plain path: the
``.pth`` files inside it, such as an editable fedhet's, are not read), so nothing is downloaded, and its own
site-packages comes first, so ``import fedhet`` finds the installed wheel (checked)."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

import fedhet

ROOT = Path(__file__).resolve().parents[1]
FMNIST = Path(os.environ.get("FEDHET_DATA", "/usr/share/datasets")) / "fashion-mnist"
# every file of the package (its modules and its data, such as fedhet/configs/demo.toml), as the wheel names it
PACKAGE_FILES = sorted(
    p.relative_to(ROOT / "src").as_posix()
    for p in (ROOT / "src" / "fedhet").rglob("*")
    if p.is_file() and "__pycache__" not in p.parts
)


def call(*args: str | Path, cwd: Path, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
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


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict[str, Path]:
    """The wheel (built from the sdist) installed into a new virtual environment; its interpreter and a clean env."""
    tmp = tmp_path_factory.mktemp("wheel")
    sdist = build_sdist(tmp)
    with tarfile.open(sdist) as tar:
        names = tar.getnames()
        tar.extractall(tmp / "unpacked", **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    top = f"fedhet-{fedhet.__version__}"
    assert "fedhet/configs/demo.toml" in PACKAGE_FILES
    missing = [f for f in PACKAGE_FILES if f"{top}/src/{f}" not in names]
    assert not missing, f"the sdist lacks {missing}"
    wheels = tmp / "wheels"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    call(
        *pip,
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
    (wheel,) = wheels.glob("fedhet-*.whl")
    missing = [f for f in PACKAGE_FILES if f not in zipfile.ZipFile(wheel).namelist()]
    assert not missing, f"the wheel lacks {missing}"

    venv = tmp / "env"
    call(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp)
    python = venv / "bin" / "python"
    call(*pip, "--python", python, "install", "-q", "--no-deps", "--no-index", wheel, cwd=tmp)
    purelib = Path(call(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))", cwd=tmp).strip())
    ours = [sysconfig.get_path("purelib"), *site.getsitepackages()]
    (purelib / "test_environment.pth").write_text("\n".join(dict.fromkeys(ours)) + "\n")

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(COLUMNS="200", OMP_NUM_THREADS="1", PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}")
    empty = tmp / "empty"
    empty.mkdir()
    location = call(python, "-c", "import fedhet; print(fedhet.__file__)", cwd=empty, env=env).strip()
    assert Path(location).is_relative_to(purelib), f"fedhet imported from {location}, not the installed wheel"
    script = (venv / "bin" / "fedhet").read_text().splitlines()[0]
    assert script.startswith(f"#!{venv}"), f"the fedhet command runs {script}, not the new environment's Python"
    return {"bin": venv / "bin", "env": env, "empty": empty}


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

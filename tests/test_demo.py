"""`fedhet demo`: the README's comparison from the config installed with the package, through compare's machinery."""

from __future__ import annotations

import json
import re
import subprocess
from importlib import resources
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedhet.cli import app

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]
PACKAGED = resources.files("fedhet") / "configs" / "demo.toml"
TINY = ["-s", "dataset.name=digits", "-s", "run.progress=false", "-r", "1", "--threads", "1"]


def test_the_demo_config_is_package_data_and_printed_as_is():
    assert Path(str(PACKAGED)).is_relative_to(ROOT / "src" / "fedhet")
    result = runner.invoke(app, ["demo", "--print-config"])
    assert result.exit_code == 0, result.output
    assert result.output == PACKAGED.read_text(encoding="utf-8")


def test_the_repository_keeps_one_copy_of_the_demo_config():
    """The package's copy is the only one: a second would drift from what `fedhet demo` runs. (A reader's own
    `fedhet demo --print-config > demo.toml` is theirs: untracked, and ignored by git.)"""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run(["git", "ls-files", "*demo.toml"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert listed.stdout.split() == ["src/fedhet/configs/demo.toml"]


def test_demo_dry_run_lists_every_variant_under_demo_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["demo", "--dry-run"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    cells = re.findall(r"│ (\S+-s0) +│ demo-runs/\1", result.output)
    assert len(cells) == 32 and {"fedavg-s0", "scaffold-s0", "fedavg_fedadam-s0"} <= set(cells)
    assert not (tmp_path / "demo-runs").exists()  # a dry run writes nothing


def test_demo_passes_its_options_to_compare(tmp_path):
    out = tmp_path / "out"
    args = ["demo", *TINY, "-v", "fedavg,fedprox", "--seeds", "0,1", "-o", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert (out / "comparison.md").is_file() and (out / "comparison.png").stat().st_size > 0
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["fedavg-s0", "fedavg-s1", "fedprox-s0", "fedprox-s1"]
    config = json.loads((out / "fedprox-s1" / "config.json").read_text())
    assert config["run"]["rounds"] == 1 and config["dataset"]["name"] == "digits"
    assert config["algorithm"]["mu"] == 1.0  # the demo config's [compare.params.fedprox]
    assert config["partition"]["num_clients"] == 20  # and the rest of its setting
    again = runner.invoke(app, args)  # compare's continuation: finished cells are skipped
    assert again.exit_code == 0 and "comparison.md" in again.output
    assert json.loads((out / "fedprox-s1" / "summary.json").read_text())["rounds_done"] == 1


def test_demo_refuses_a_bad_override_in_one_line(tmp_path):
    result = runner.invoke(app, ["demo", "-o", str(tmp_path), "-s", "train.lrr=0.1"])
    assert result.exit_code != 0
    assert "unknown key 'train.lrr'" in str(result.exception)
    assert not any(tmp_path.iterdir())


def test_every_config_file_the_docs_run_is_there_or_written_first():
    """A `-c FILE.toml` in the README or docs/ names a file of the repository or one the same page writes
    (`fedhet demo --print-config > demo.toml`); cfg.toml stands for the reader's own config."""
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = doc.read_text()
        for name in set(re.findall(r"(?:-c|--config) ([^\s`)]+\.toml)", text)) - {"cfg.toml"}:
            assert (ROOT / name).is_file() or f"> {name}" in text, f"{doc.relative_to(ROOT)}: -c {name} is nowhere"

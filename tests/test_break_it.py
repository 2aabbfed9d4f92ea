"""Defects found by trying to break fedhet: a foreign config.json in a run folder, usage errors, plug-ins that exit
or raise KeyboardInterrupt on import, where a comparison's cell runs, a torn metrics line at resume, and Ray helpers
left behind by a killed Flower simulation. The commands run in this process through ``fedhet.cli.main``, as the
``fedhet`` script does (argv in, message on stderr, exit status out), except where a process must be killed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from fedhet.cli import main

TINY = ["-d", "digits", "-m", "mlp", "-n", "4", "-r", "1", "-s", "run.progress=false", "-s", "partition.min_size=20"]


def fedhet(monkeypatch, capsys, *args) -> tuple[int, str]:
    """(exit status, stderr) of ``fedhet ARGS``, run by the console script's ``main``."""
    monkeypatch.setattr(sys, "argv", ["fedhet", *map(str, args)])
    with pytest.raises(SystemExit) as info:
        main()
    return info.value.code, capsys.readouterr().err


def one_line(err: str, prefix: str = "error: ") -> str:
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix), err
    return lines[0]


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (hidden ones too) with its bytes: what a refused command must leave as it was."""
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else b"<dir>" for p in folder.rglob("*")}


# ---------------------------------------------------------------------------------------------- a foreign config.json
@pytest.mark.parametrize("content", ['{"precious": true}', "[1, 2]", '{"run": null}'])
@pytest.mark.parametrize("through_link", [False, True], ids=["folder", "link to an outside folder"])
def test_resume_into_a_folder_with_a_foreign_config_json_is_one_line_and_writes_nothing(
    tmp_path, monkeypatch, capsys, content, through_link
):
    out = tmp_path / "runs"
    folder = tmp_path / "elsewhere" if through_link else out / "x"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(content)
    (folder / "notes.txt").write_text("mine")
    if through_link:
        out.mkdir()
        (out / "x").symlink_to(folder)
    before = snapshot(folder)

    code, err = fedhet(monkeypatch, capsys, "run", *TINY, "-o", out, "--name", "x", "--resume")
    line = one_line(err)
    assert code == 2 and line.endswith("config.json: not a fedhet run config"), line
    assert snapshot(folder) == before  # no lock file, no truncated log, no config written

    code, err = fedhet(monkeypatch, capsys, "resume", out / "x")  # the same check, the same words
    assert code == 2 and one_line(err).endswith("config.json: not a fedhet run config"), err
    assert snapshot(folder) == before

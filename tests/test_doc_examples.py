"""Every ```python block of README.md and docs/extending.md runs, exactly as printed, as a script of its own.

Each block is written to a file in an empty folder and run there by a fresh Python, as a reader who copies it would
(no ``if __name__ == "__main__":`` in them, and none needed). The blocks run at once, so their start-ups overlap."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
DOCS = ["README.md", "docs/extending.md"]


def python_blocks(doc: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", (ROOT / doc).read_text(), flags=re.S | re.M)


def test_the_docs_have_python_examples():
    assert [len(python_blocks(doc)) for doc in DOCS] == [1, 3]


def test_the_plugin_walked_through_is_the_example_file():
    """extending.md prints "Its whole body" of examples/label_smoothing.py: it must be that file's code."""
    block = python_blocks("docs/extending.md")[0]
    assert block in (ROOT / "examples" / "label_smoothing.py").read_text()


@pytest.mark.slow  # three Python processes (torch imports), two of which train: 20-50 s on a shared 2-core machine
def test_every_python_example_runs_as_written(tmp_path):
    unique: dict[str, str] = {}  # code -> where it is printed first (the README's API example is in both)
    for doc in DOCS:
        for i, code in enumerate(python_blocks(doc)):
            unique.setdefault(code, f"{doc} block {i + 1}")
    procs = {}
    for n, (code, where) in enumerate(unique.items()):
        folder = tmp_path / f"example{n}"
        folder.mkdir()
        (folder / "example.py").write_text(code)
        procs[where] = (
            folder,
            subprocess.Popen(
                [sys.executable, "example.py"],
                cwd=folder,
                env={**os.environ, "COLUMNS": "200"},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            ),
        )
    outputs = {}
    for where, (folder, proc) in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{where} failed:\n{out}\n{err[-3000:]}"
        assert "Traceback" not in err, f"{where}:\n{err[-3000:]}"
        outputs[where] = (folder, out)
    # the API example: one run where its comment says, a comparison of two methods over two seeds, one line each
    folder, out = outputs["README.md block 1"]
    acc, rounds = out.splitlines()[0].split()
    assert 0 <= float(acc) <= 1 and rounds == "3"
    assert [line.split(":")[0] for line in out.splitlines()[1:]] == ["fedavg", "scaffold"]
    assert [p.name.startswith("scaffold-digits-") for p in (folder / "runs").iterdir()] == [True]
    cells = sorted(p.name for p in (folder / "study").iterdir() if p.is_dir())
    assert cells == ["fedavg-s0", "fedavg-s1", "scaffold-s0", "scaffold-s1"]

"""What a person sees when fedhet's output goes to a file or a pipe (issue 27)."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.slow
def test_a_run_logged_to_a_file_prints_a_line_per_evaluation(tmp_path):
    args = ["run", "-d", "digits", "-m", "mlp", "-n", "4", "-r", "3", "-o", str(tmp_path), "--name", "log"]
    args += ["-s", "partition.min_size=20", "-s", "run.eval_every=2"]
    proc = subprocess.run([sys.executable, "-m", "fedhet.cli", *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("log: round")]
    assert [line.split(",")[0] for line in lines] == ["log: round 2/3", "log: round 3/3"]
    assert all("test_acc" in line and "train_loss" in line for line in lines)
    assert "━" not in proc.stderr  # no bar drawn into the file


@pytest.mark.slow
def test_a_quiet_run_prints_no_round_lines(tmp_path):
    args = ["run", "-d", "digits", "-m", "mlp", "-n", "4", "-r", "2", "-o", str(tmp_path), "--name", "quiet"]
    args += ["-s", "partition.min_size=20", "-s", "run.progress=false"]
    proc = subprocess.run([sys.executable, "-m", "fedhet.cli", *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "quiet: round" not in proc.stderr, proc.stderr

"""benchmarks/noniid/tables.py: the cells of docs/non-iid.md from run folders (mean ± std over finished seeds, the
worst domain or client, the seeds listed, unfinished runs counted), and the noise sweep's like-for-like columns."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "noniid" / "tables.py"


@pytest.fixture
def tables(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("noniid_tables", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "ARCHIVE", tmp_path / "archive")  # only the folders this test writes
    return module


def write_run(out: Path, kind: str, name: str, records: list[dict], torn: bool = False) -> None:
    run = out / kind / name
    run.mkdir(parents=True)
    text = "".join(json.dumps(r) + "\n" for r in records) + ('{"round": 9' if torn else "")
    (run / "metrics.jsonl").write_text(text)


def test_a_cell_is_mean_and_std_over_finished_seeds_with_the_worst_part(tables, tmp_path):
    out = tmp_path / "out"
    write_run(out, "rotated", "fedavg-s0", [{"round": 30, "test_acc": 0.80, "test_acc/domain/worst": 0.70}])
    write_run(out, "rotated", "fedavg-s1", [{"round": 30, "test_acc": 0.70, "test_acc/domain/worst": 0.60}])
    write_run(out, "rotated", "fedavg-s2", [{"round": 12, "test_acc": 0.50}], torn=True)  # still running
    assert tables.cell(tables.runs(out, "rotated", "fedavg"), 30) == "75.0 ± 7.1 (65.0) <sub>s0,1</sub> +1 unfinished"
    write_run(out, "iid", "fedavg-s0", [{"round": 30, "test_acc": 0.871, "client_acc_min": 0.85}])
    assert tables.cell(tables.runs(out, "iid", "fedavg"), 30) == "87.1 (85.0) <sub>s0</sub>"
    write_run(out, "iid", "moon-s0", [{"round": 5, "test_acc": 0.4}])
    assert tables.cell(tables.runs(out, "iid", "moon"), 30) == "(running: round 5)"
    assert tables.cell(tables.runs(out, "iid", "scaffold"), 30) == "–"
    rows = tables.table(out, 30, ["fedavg", "fedbn"])
    assert rows[2].startswith("| fedavg | 87.1 (85.0) <sub>s0</sub> | – |") and "n/a¹" in rows[3]


def test_the_noise_sweep_compares_like_with_like(tables, tmp_path):
    out = tmp_path / "out"
    record = {"round": 30, "test_acc": 0.44, "client_acc_mean": 0.52, "client_acc_min": 0.32}
    write_run(out, "noise2", "fedavg-s0", [record])
    write_run(out, "noise2", "fedbn-s0", [{"round": 30, "test_acc": 0.2, "personal_acc_micro": 0.568}])
    rows = tables.sweep_table(out, 30)
    assert "fedavg: clean test" in rows[0] and "fedbn personalised: clients' own" in rows[0]
    sigma2 = next(r for r in rows if r.startswith("| 2 |"))
    assert sigma2 == "| 2 | 44.0 <sub>s0</sub> | 52.0 (32.0) <sub>s0</sub> | – | – | 56.8 <sub>s0</sub> |"

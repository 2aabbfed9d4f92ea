"""benchmarks/gpu.py in its small mode on the CPU: every case runs, the JSON and the Markdown table are written."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from fedhet.data.datasets.base import DATASETS

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "gpu.py"


@pytest.mark.slow
def test_small_mode_runs_every_case_and_writes_its_table(tmp_path, monkeypatch):
    monkeypatch.setattr(DATASETS, "_entries", dict(DATASETS._entries))  # its generated datasets end with the test
    spec = importlib.util.spec_from_file_location("gpu_bench", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    report = bench.main(["--small", "--device", "cpu", "--rounds", "2", "--out", str(tmp_path)])
    results = report["results"]
    assert not [r for r in results if "error" in r]
    runners = {(r["case"][:3], r["runner"]) for r in results}
    assert {("(a)", "sequential"), ("(a)", "batched"), ("(a)", "bare torch")} <= runners
    assert {("(b)", "sequential"), ("(b)", "batched"), ("(c)", "batched bf16"), ("(c)", "sequential fp32")} <= runners
    assert {("(d)", "sequential"), ("(d)", "batched"), ("(e)", "sequential"), ("(e)", "batched")} <= runners
    changed = {r["case"].split()[1] for r in results if r["case"].startswith("(d)")}
    assert changed == {"moon", "fedrcl"}
    swept = [r["case"] for r in results if r["case"].startswith("(e)") and r["runner"] == "batched"]
    assert [c.split(", ")[2].split("/")[0] for c in swept] == ["2", "4"] * 3  # per model: K = 2, 4 (small mode)
    for r in results:
        assert r["s_per_round"] > 0 and len(r["rounds"]) == 2 and r["peak_mib"] is None  # no CUDA here
        assert r["executor"] == ("bare torch" if r["runner"] == "bare torch" else r["runner"].split()[0])
    assert json.loads((tmp_path / "gpu.json").read_text())["results"] == json.loads(json.dumps(results))
    table = (tmp_path / "gpu.md").read_text()
    assert table.count("\n| (") == len(results) and "median of rounds 2-2" in table
    assert "final_test_acc" in results[0] and 0 <= results[0]["final_test_acc"] <= 1

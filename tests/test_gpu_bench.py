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
    monkeypatch.setattr("fedhet.toolkit.compiled.COMPILE_BACKEND", "aot_eager")  # the CPU's code generation: minutes
    argv = ["--small", "--device", "cpu", "--rounds", "2", "--profile", "--before", "--compile", "default"]
    report = bench.main([*argv, "--compile-only", "(a)", "--compile-sequential", "(b)", "--out", str(tmp_path)])
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
        assert r["s_per_round"] > 0 and len(r["rounds"]) == 2 and r["peak_mib"] is r["resident_mib"] is None  # CPU
        assert r["executor"] == ("bare torch" if r["runner"] == "bare torch" else r["runner"].split()[0])
    assert json.loads((tmp_path / "gpu.json").read_text())["results"] == json.loads(json.dumps(results))
    table = (tmp_path / "gpu.md").read_text()
    runner_rows = table.split("\n\nSequential")[0].count("\n| (")  # the first table: a row per runner
    assert runner_rows == len(results) and "median of rounds 2-2" in table
    assert "final_test_acc" in results[0] and 0 <= results[0]["final_test_acc"] <= 1

    # every case's runners as they are and as they were before the launch work; case (a)'s batched runner compiled
    # too, and case (b)'s sequential one
    compiled = {r for r in runners if "compiled" in r[1]}
    assert compiled == {("(a)", "batched compiled"), ("(b)", "sequential compiled")}
    assert {("(b)", "sequential before"), ("(b)", "batched before"), ("(c)", "batched bf16 before")} <= runners
    # speed-ups from the unrounded times: each batched runner against the sequential one of the same build
    by = {(r["case"], r["runner"]): r["s_per_round"] for r in results}
    assert len(report["speedups"]) == len([r for r in results if r["runner"].startswith("batched")])
    for r in report["speedups"]:
        assert r["speedup"] == by[(r["case"], r["sequential"])] / by[(r["case"], r["runner"])]
        assert r["sequential"] == r["runner"].replace("batched", "sequential").replace(" compiled", "")
    assert "from the unrounded times" in table
    # what case (a)'s runners launch: the batched executor launches fewer ops a client than the sequential one
    profiles = {r["runner"]: r["profile"] for r in results if "profile" in r}
    assert set(profiles) == {
        "sequential",
        "batched",
        "bare torch",
        "sequential before",
        "batched before",
        "batched compiled",
    }
    for p in profiles.values():
        assert p["clients"] == 10 and p["steps"] >= 1 and p["ops_per_round"] > 0 and p["cuda_kernels_per_round"] is None
    assert profiles["batched"]["step"] == "group step" and profiles["sequential"]["step"] == "client step"
    assert profiles["batched"]["ops_per_client"] < profiles["sequential"]["ops_per_client"] / 2
    assert profiles["batched"]["ops_per_client"] < profiles["batched before"]["ops_per_client"]  # the launch work
    assert "What a round launches" in table


def test_a_cases_federation_is_dropped_before_another_cases_runner(tmp_path, monkeypatch):
    """Memory per case: a federation lives from its case's first runner until a runner of another case starts."""
    monkeypatch.setattr(DATASETS, "_entries", dict(DATASETS._entries))
    spec = importlib.util.spec_from_file_location("gpu_bench", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    built = []
    monkeypatch.setattr(bench, "build_federation", lambda cfg: built.append(cfg.dataset.name) or object())
    feds = bench.Federations()
    first = feds.get("a", type("C", (), {"dataset": type("D", (), {"name": "x"})})())
    assert feds.get("a", None) is first and built == ["x"]  # the same case: built once
    feds.keep("a")
    assert feds.fed is first
    feds.keep("b")  # another case's runner is next: the data goes
    assert feds.fed is None and feds.key is None


@pytest.mark.slow
def test_host_cost_times_both_builds_of_both_executors(tmp_path, monkeypatch):
    monkeypatch.setattr(DATASETS, "_entries", dict(DATASETS._entries))
    monkeypatch.chdir(tmp_path)  # its work folder is runs/ below the working directory
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("host_cost", SCRIPT.parent / "host_cost.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    report = bench.main(["--repeats", "1", "--clients", "20", "--per-round", "4", "--out", str(tmp_path / "h.json")])
    assert set(report["s_per_round"]) == {"sequential", "sequential before", "batched", "batched before"}
    assert all(len(v) == 1 and v[0] > 0 for v in report["s_per_round"].values())
    assert json.loads((tmp_path / "h.json").read_text()) == report

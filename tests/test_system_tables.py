"""benchmarks/system/tables.py: the cells of docs/system-heterogeneity.md (mean ± sample std over finished seeds),
the simulated time to a target accuracy, the clients' work per simulated second, and the doc's tables as the script
computes them from the archived results."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def load():
    spec = importlib.util.spec_from_file_location("system_tables", ROOT / "benchmarks" / "system" / "tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def tables(tmp_path, monkeypatch):
    module = load()
    monkeypatch.setattr(module, "ARCHIVE", tmp_path / "archive")  # only the folders this test writes
    return module


def write_run(out: Path, folder: str, seed: int, records: list[dict], rounds: int, clients: int = 10) -> None:
    run = out / folder / f"fedavg-s{seed}"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    config = {"run": {"rounds": rounds}, "train": {"clients_per_round": clients}}
    (run / "config.json").write_text(json.dumps(config))


def test_a_cell_is_the_mean_and_sample_std_over_finished_seeds(tables, tmp_path):
    out = tmp_path / "out"
    for seed, acc in enumerate((0.80, 0.70)):
        write_run(out, "stragglers/0/fedavg-drop", seed, [{"round": 200, "test_acc": acc}], 200)
    write_run(out, "stragglers/0/fedavg-drop", 2, [{"round": 100, "test_acc": 0.1}], 200)  # unfinished
    found = tables.runs(out, "stragglers/0/fedavg-drop")
    assert tables.cell(found, tables.final_acc) == "75.0 ± 7.1 <sub>s0,1</sub> +1 unfinished"  # n − 1, not 5.0


def test_time_to_a_target_is_the_first_evaluation_at_or_above_it_and_names_seeds_that_never_reach_it(tables, tmp_path):
    out = tmp_path / "out"
    curves = {0: [0.6, 0.72, 0.81], 1: [0.7, 0.75, 0.78], 2: [0.5, 0.69, 0.70]}
    for seed, accs in curves.items():
        recs = [{"round": 10 * (i + 1), "test_acc": a, "sim/time": 1000.0 * (i + 1)} for i, a in enumerate(accs)]
        write_run(out, "async/lognormal/fedbuff", seed, recs, 30)
    found = tables.runs(out, "async/lognormal/fedbuff")
    assert tables.time_cell(found, 70) == "2,000 ± 1,000 <sub>s0,1,2</sub>"  # 2,000, 1,000 and 3,000 s (70 % is in)
    assert tables.time_cell(found, 80) == "3,000 <sub>s0</sub>; not reached by s1,2"
    assert tables.time_cell(found, 90) == "not reached by s0,1,2"


def test_the_clients_work_counts_updates_exactly_and_estimates_steps_from_the_evaluated_rounds(tables, tmp_path):
    out = tmp_path / "out"
    sync = [{"round": r, "test_acc": 0.5, "sim/time": 100.0 * r, "sim/dropped": 0, "clients": 10,
             "clients/steps/mean": steps} for r, steps in ((10, 200.0), (20, 400.0))]  # fmt: skip
    write_run(out, "async/lognormal/fedavg-sync", 0, sync, 20)
    buff = [{"round": 50, "test_acc": 0.5, "sim/time": 500.0, "clients": 5, "clients/steps/mean": 100.0,
             "async/updates": 250}]  # fmt: skip
    write_run(out, "async/lognormal/fedbuff", 0, buff, 50)
    rows = tables.work(out)
    assert rows[2] == "| FedAvg, synchronous | 100.0 | 300 (20 of 200 updates) | 30.0 |"  # 200 updates in 2,000 s
    assert rows[3] == "| FedBuff (K = 5, 10 at once) | 500.0 | 100 (5 of 250 updates) | 50.0 |"
    sync[0]["sim/dropped"] = 1
    (out / "async/lognormal/fedavg-sync/fedavg-s0/metrics.jsonl").write_text("\n".join(map(json.dumps, sync)))
    with pytest.raises(AssertionError, match="dropped clients"):
        tables.work(out)


def test_the_docs_tables_are_what_tables_py_computes_from_the_archived_results(tmp_path):
    """docs/system-heterogeneity.md says exactly what was run: every row of every table the script prints from
    benchmarks/system/results is in the page, as printed."""
    tables, out = load(), tmp_path / "no-live-runs"
    doc = (ROOT / "docs" / "system-heterogeneity.md").read_text()
    printed = [
        *tables.stragglers(out),
        *tables.stragglers(out, "stragglers_shakespeare"),
        *tables.clock(out),
        *tables.local_work(out),
        *tables.asynchronous(out),
        *tables.time_to_target(out),
        *tables.work(out),
    ]
    missing = [row for row in printed if not row.startswith("|---") and row not in doc]
    assert not missing, missing

"""benchmarks/reproduce/archive.py keeps finished cells' result files; the FedACD tables read them beside runs/."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPRODUCE = Path(__file__).parents[1] / "benchmarks" / "reproduce"


def load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_run(folder: Path, status: str, rounds: int, acc: float, lr: float = 0.01) -> Path:
    folder.mkdir(parents=True)
    config = {"run": {"name": folder.name, "out_dir": str(folder.parent), "rounds": rounds}, "train": {"lr": lr}}
    (folder / "config.json").write_text(json.dumps(config))
    records = [{"round": r, "test_acc": acc} for r in range(1, rounds + 1)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (folder / "summary.json").write_text(json.dumps({"status": status, "rounds_done": rounds}))
    (folder / "checkpoints").mkdir()
    (folder / "checkpoints" / "last.pt").write_bytes(b"x" * 100)
    return folder


def test_archive_copies_finished_cells_without_checkpoints(tmp_path):
    archive = load(REPRODUCE / "archive.py")
    runs, dest = tmp_path / "runs", tmp_path / "results"
    make_run(runs / "alpha0.1" / "fedavg-s0", "finished", 3, 0.5)
    make_run(runs / "alpha0.1" / "fedacd-s0", "stopped", 2, 0.6)
    assert archive.archive(runs, dest) == ["alpha0.1/fedavg-s0"]
    kept = dest / "alpha0.1" / "fedavg-s0"
    assert sorted(p.name for p in kept.iterdir()) == ["config.json", "metrics.jsonl", "summary.json"]
    assert not (dest / "alpha0.1" / "fedacd-s0").exists()
    assert archive.archive(runs, dest) == []  # nothing newer: left alone
    dynamic = make_run(runs / "dynamic" / "fedufo-s0", "finished", 2, 0.3)
    (dynamic / "sampling.jsonl").write_text('{"round": 1, "worst": [3], "random": [5]}\n')
    assert archive.archive(runs, dest) == ["dynamic/fedufo-s0"]
    assert (dest / "dynamic" / "fedufo-s0" / "sampling.jsonl").read_text().startswith('{"round": 1')


def test_archive_keeps_a_tunes_record_and_leaves_its_trial_runs_out_unless_asked(tmp_path):
    archive = load(REPRODUCE / "archive.py")
    runs, dest = tmp_path / "runs", tmp_path / "results"
    make_run(runs / "two_classes" / "fedavg-s0", "finished", 3, 0.5)
    tune = runs / "two_classes" / "tuning" / "fedavg"
    make_run(tune / "trials" / "0", "finished", 2, 0.4)
    (tune / "study.db").write_bytes(b"db")
    running = runs / "two_classes" / "tuning" / "scaffold"  # a tune still searching: no tune.json yet
    make_run(running / "trials" / "0", "finished", 2, 0.4)
    (running / "study.db").write_bytes(b"db")
    assert archive.archive(runs, dest) == ["two_classes/fedavg-s0"]  # the unfinished tune's record: not yet
    (tune / "tune.json").write_text('{"best": null}')
    (tune / "tune.md").write_text("# Tune fedavg")
    assert archive.archive(runs, dest) == ["two_classes/tuning/fedavg"]
    kept = dest / "two_classes" / "tuning" / "fedavg"
    assert sorted(p.name for p in kept.iterdir()) == ["study.db", "tune.json", "tune.md"]
    assert archive.archive(runs, dest) == []  # the same tune.json: left alone
    assert archive.archive(runs, dest, trials=True) == [
        "two_classes/tuning/fedavg/trials/0",
        "two_classes/tuning/scaffold/trials/0",
    ]


def test_archive_keeps_failed_cells_only_when_asked_even_without_metrics(tmp_path):
    archive = load(REPRODUCE / "archive.py")
    runs, dest = tmp_path / "runs", tmp_path / "results"
    late = make_run(runs / "eps8" / "fedavg-s0", "failed", 2, 0.2)
    early = make_run(runs / "eps4" / "fedavg-s0", "failed", 1, 0.1)
    (early / "metrics.jsonl").unlink()  # failed before its first evaluation
    for run in (late, early):
        (run / "failures.jsonl").write_text('{"round": 3, "error": "FloatingPointError: non-finite"}\n')
    assert archive.archive(runs, dest) == []
    assert archive.archive(runs, dest, failed=True) == ["eps4/fedavg-s0", "eps8/fedavg-s0"]
    assert sorted(p.name for p in (dest / "eps4" / "fedavg-s0").iterdir()) == [
        "config.json",
        "failures.jsonl",
        "summary.json",
    ]
    assert (dest / "eps8" / "fedavg-s0" / "metrics.jsonl").exists()
    assert archive.archive(runs, dest, failed=True) == []  # nothing newer: left alone


def test_archive_replaces_a_shorter_copy_and_refuses_another_config(tmp_path):
    archive = load(REPRODUCE / "archive.py")
    runs, dest = tmp_path / "runs", tmp_path / "results"
    make_run(dest / "a" / "fedavg-s0", "finished", 2, 0.5)
    make_run(runs / "a" / "fedavg-s0", "finished", 4, 0.7)  # the same cell extended to more rounds
    assert archive.archive(runs, dest) == ["a/fedavg-s0"]
    assert json.loads((dest / "a" / "fedavg-s0" / "summary.json").read_text())["rounds_done"] == 4
    make_run(runs / "b" / "fedavg-s0", "finished", 4, 0.7, lr=0.1)
    make_run(dest / "b" / "fedavg-s0", "finished", 4, 0.7)
    with pytest.raises(SystemExit, match="another config"):
        archive.archive(runs, dest)


def test_archive_partial_keeps_unfinished_cells_by_their_logged_rounds(tmp_path):
    archive = load(REPRODUCE / "archive.py")
    runs, dest = tmp_path / "runs", tmp_path / "results"
    make_run(dest / "a" / "fedrane-s0", "finished", 5, 0.5)  # an earlier, shorter finished copy
    killed = make_run(runs / "a" / "fedrane-s0", "stopped", 9, 0.6)
    (killed / "summary.json").unlink()  # killed at a deadline: no summary written
    make_run(runs / "a" / "fedavg-s0", "stopped", 3, 0.4)
    assert archive.archive(runs, dest) == []  # finished cells only by default
    assert archive.archive(runs, dest, partial=True) == ["a/fedavg-s0", "a/fedrane-s0"]
    kept = dest / "a" / "fedrane-s0"
    assert archive.rounds_done(kept) == 9
    assert not (kept / "summary.json").exists()  # the 5-round copy's summary would contradict the metrics
    assert archive.archive(runs, dest, partial=True) == []


def test_fedacd_tables_read_archived_cells_beside_runs(tmp_path):
    runs, results = tmp_path / "runs", tmp_path / "results"
    make_run(runs / "alpha0.1" / "fedavg-s0", "finished", 2, 0.70)
    make_run(results / "alpha0.1" / "fedavg-s0", "finished", 2, 0.10)  # shadowed by runs/
    make_run(results / "alpha0.1" / "fedavg-s1", "finished", 2, 0.80)
    script = REPRODUCE / "fedacd" / "tables.py"
    out = subprocess.run(
        [sys.executable, str(script), str(runs), str(results)], capture_output=True, text=True, check=True
    ).stdout
    fedavg = next(line for line in out.splitlines() if line.startswith("| FedAvg |"))
    assert "| 75.00 ± 7.07 (2 seeds) |" in fedavg


def test_fedrane_tables_last_names_each_cells_own_round(tmp_path):
    runs = tmp_path / "runs"
    for method, rounds in (("fedavg", 100), ("fedrane", 24)):
        folder = make_run(runs / "alpha0.5" / f"{method}-s0", "finished", rounds, 0.9)
        config = json.loads((folder / "config.json").read_text())
        config["run"]["seed"] = 0
        (folder / "config.json").write_text(json.dumps(config))
    script = REPRODUCE / "fedrane" / "tables.py"
    last = subprocess.run(
        [sys.executable, str(script), str(runs), "--last"], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert "| 90.00 R100 | 86.85 | +3.15 ! |" in next(line for line in last if line.startswith("| FedAvg |"))
    assert "| 90.00 R24 | 91.35 | -1.35 |" in next(line for line in last if line.startswith("| FedRANE |"))
    common = subprocess.run([sys.executable, str(script), str(runs)], capture_output=True, text=True, check=True)
    assert "at round 24" in common.stdout  # without --last: the round every cell has reached


def test_archive_keeps_a_small_checkpoint_only_where_it_alone_resumes_the_run(tmp_path):
    archive = load(REPRODUCE / "archive.py")
    runs, dest = tmp_path / "runs", tmp_path / "results"
    make_run(runs / "a" / "fedavg-s0", "finished", 3, 0.5)  # a 100-byte last.pt
    spilled = make_run(runs / "a" / "ditto-s0", "finished", 3, 0.5)
    (spilled / "client_state").mkdir()  # client states on disk: the checkpoint alone cannot resume it
    big = make_run(runs / "b" / "fedavg-s0", "finished", 3, 0.5)
    (big / "checkpoints" / "last.pt").write_bytes(b"x" * 2**20)
    assert archive.archive(runs, dest, checkpoint_mb=0.5) == ["a/ditto-s0", "a/fedavg-s0", "b/fedavg-s0"]
    assert (dest / "a" / "fedavg-s0" / "checkpoints" / "last.pt").read_bytes() == b"x" * 100
    assert not (dest / "a" / "ditto-s0" / "checkpoints").exists()
    assert not (dest / "b" / "fedavg-s0" / "checkpoints").exists()
    make_run(tmp_path / "longer" / "a" / "fedavg-s0", "finished", 4, 0.5)
    (tmp_path / "longer" / "a" / "fedavg-s0" / "checkpoints" / "last.pt").unlink()
    assert archive.archive(tmp_path / "longer", dest) == ["a/fedavg-s0"]
    assert not (dest / "a" / "fedavg-s0" / "checkpoints").exists()  # the 3-round checkpoint would not match


def test_a_restored_cell_continues_where_the_archived_run_stopped(tiny_config, tmp_path):
    from fedhet.engine.simulation import Simulation
    from fedhet.results.store import read_metrics

    archive = load(REPRODUCE / "archive.py")
    full = Simulation(tiny_config(run={"name": "full", "rounds": 3}))
    full.run()
    cut = Simulation(tiny_config(run={"name": "cut", "rounds": 3}))
    cut.run(stop_after=2)  # killed after round 2: no summary, a round-2 checkpoint
    dest, elsewhere = tmp_path / "results", tmp_path / "other-machine" / "runs"
    assert archive.archive(cut.run_dir.parent, dest, partial=True, checkpoint_mb=5) == ["cut", "full"]
    assert archive.restore(dest, elsewhere) == (["cut", "full"], [])
    assert archive.restore(dest, elsewhere) == ([], ["cut", "full"])  # never over a run folder
    resumed = Simulation(tiny_config(run={"name": "cut", "rounds": 3, "out_dir": str(elsewhere)}))
    resumed.run(resume=True)
    assert json.loads((resumed.run_dir / "provenance.json").read_text())["resumes"][-1]["round"] == 2
    keys = ("round", "test_acc", "test_loss", "train_loss")
    expected, got = (
        [{k: r[k] for k in keys} for r in read_metrics(s.run_dir / "metrics.jsonl")] for s in (full, resumed)
    )
    assert len(got) == 3 and got == expected  # bit for bit: the same machine here


def test_privacy_table_names_a_failed_cell_and_its_reason(tmp_path):
    out = tmp_path / "privacy"
    make_run(out / "epsinf" / "fedavg-s0", "finished", 2, 0.78)
    dp = make_run(out / "eps8" / "fedavg-s0", "failed", 2, 0.16)
    records = [
        {"round": r, "test_acc": acc, "privacy/epsilon": 0.5 * r, "privacy/noise_multiplier": 3.04}
        for r, acc in ((1, 0.30), (2, 0.16))  # the noise undid progress: the table shows the best beside the final
    ]
    (dp / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = {"status": "failed", "rounds_done": 5, "error": "no client finished round 5; the errors are in ..."}
    (dp / "summary.json").write_text(json.dumps(summary))
    (dp / "failures.jsonl").write_text(json.dumps({"round": 3, "error": "FloatingPointError: non-finite"}) + "\n")
    early = out / "eps4" / "fedavg-s0"  # failed before its first evaluation: no metrics.jsonl at all
    early.mkdir(parents=True)
    (early / "config.json").write_text(json.dumps({"run": {"rounds": 100}}))
    (early / "summary.json").write_text(json.dumps({**summary, "rounds_done": 4}))
    (early / "failures.jsonl").write_text((dp / "failures.jsonl").read_text())
    script = Path(__file__).parents[1] / "benchmarks" / "privacy" / "tables.py"
    table = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True, check=True).stdout
    fedavg = next(line for line in table.splitlines() if line.startswith("| fedavg |")).split(" | ")
    assert fedavg[1] == "–"  # epsilon 1: not run
    assert fedavg[2] == "[failed after round 4: no client finished round 5 (clients: FloatingPointError: non-finite)]"
    assert fedavg[3].startswith("16.0 (best 30.0 at round 1) (eps 1.00, z 3.04) [last evaluated at round 2; failed ")
    assert fedavg[4] == "78.0 |"


@pytest.mark.slow  # two tunes of 2 rounds a trial on digits: 10-30 s
def test_an_unfinished_tune_archived_and_restored_resumes_its_search(tmp_path):
    """--partial keeps an unfinished tune's study.db (never over a finished tune's copy, nor over one as far), and
    --restore brings it back to a runs folder without it: the tune's command then keeps its finished trials and
    runs only the missing ones."""
    import optuna
    from test_tune import _env, _tune_command

    archive = load(REPRODUCE / "archive.py")
    runs, dest = tmp_path / "runs", tmp_path / "results"
    done = subprocess.run(_tune_command(runs, 2, 1), env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    folder = runs / "tu"
    for name in ("tune.json", "tune.md"):  # as if it had been stopped before writing its result
        (folder / name).unlink()
    assert archive.archive(runs, dest) == []  # not without --partial
    assert archive.archive(runs, dest, partial=True) == ["tu (unfinished: 2 trials)"]
    assert archive.archive(runs, dest, partial=True) == []  # as far as the copy: left alone
    assert sorted(p.name for p in (dest / "tu").iterdir()) == ["study.db"]
    fresh = tmp_path / "fresh"
    assert archive.restore(dest, fresh) == (["tu"], [])
    assert archive.restore(dest, fresh) == ([], ["tu"])  # a study already there is never replaced
    more = subprocess.run(_tune_command(fresh, 3, 1), env=_env(), capture_output=True, text=True, timeout=600)
    assert more.returncode == 0, more.stderr
    assert "2 of 3 trials had finished before: kept" in more.stderr
    study = optuna.load_study(study_name="tu", storage=f"sqlite:///{fresh / 'tu' / 'study.db'}")
    assert [t.number for t in study.trials if t.state.is_finished()] == [0, 1, 2]
    assert sorted(p.name for p in (fresh / "tu" / "trials").iterdir()) == ["2"]  # only the missing trial ran
    assert archive.archive(fresh, dest, partial=True) == ["tu"]  # finished now: its record replaces the partial one
    assert archive.archive(runs, dest, partial=True) == []  # never an unfinished copy over a finished tune's

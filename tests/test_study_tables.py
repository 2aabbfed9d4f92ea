"""The tables of docs/tuning.md's and docs/pretrained.md's studies (benchmarks/tuning/tables.py,
benchmarks/pretrained/tables.py) from run folders: finished seeds only, sample std, differences paired by seed."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_run(folder: Path, accs: list[tuple[int, float]], **extra) -> None:
    folder.mkdir(parents=True)
    text = "".join(json.dumps({"round": r, "test_acc": a, **extra}) + "\n" for r, a in accs)
    (folder / "metrics.jsonl").write_text(text)


def tuning_tables(tmp_path: Path, monkeypatch, name: str):
    """benchmarks/tuning/tables.py reading its default-settings cells from tmp_path/defaults, its archive from
    tmp_path/archive."""
    tables = load(BENCHMARKS / "tuning" / "tables.py", name)
    monkeypatch.setattr(tables, "DEFAULTS", tmp_path / "defaults")
    monkeypatch.setattr(tables, "ARCHIVE", tmp_path / "archive")
    return tables


def test_tuning_table_sets_each_tuned_cell_beside_its_default_with_ranks_and_budget(tmp_path, monkeypatch):
    tables = tuning_tables(tmp_path, monkeypatch, "tuning_tables")
    out = tmp_path / "out"
    for seed, (default, tuned) in enumerate([(0.60, 0.50), (0.62, 0.56), (0.64, 0.60)]):
        write_run(tmp_path / "defaults" / "two_classes" / f"fedavg-s{seed}", [(30, default)])
        write_run(out / "two_classes" / f"fedavg-s{seed}", [(30, tuned)])
        write_run(tmp_path / "defaults" / "two_classes" / f"scaffold-s{seed}", [(30, 0.40)])
        write_run(out / "two_classes" / f"scaffold-s{seed}", [(30, 0.70)])
    write_run(out / "two_classes" / "moon-s0", [(15, 0.9)])  # not finished: no tuned cell yet
    tune = out / "two_classes" / "tuning" / "fedavg"
    tune.mkdir(parents=True)
    budget = {"trials": 16, "complete": 9, "pruned": 7, "rounds_run": 170, "rounds_nominal": 240}
    (tune / "tune.json").write_text(json.dumps({"best": {"params": {"train.lr": 0.002}}, "budget": budget}))
    rows = {line.split("|")[1].strip(): line for line in tables.kind_table(out, "two_classes")[2:]}
    assert rows["fedavg"].split(" | ")[1:] == [
        "62.0 ± 2.0 <sub>s0,1,2</sub>",
        "55.3 ± 5.0 <sub>s0,1,2</sub>",
        "-6.7 ± 3.1 <sub>s0,1,2</sub>",
        "1 → 2",
        "–",  # the baseline itself
        "lr=0.002",
        "9+7 of 16, 170/240 rounds |",
    ]
    assert "| 2 → 1 |" in rows["scaffold"] and "+30.0 ± 0.0 <sub>s0,1,2</sub>" in rows["scaffold"]
    assert rows["scaffold"].split(" | ")[5] == "+14.7 [+10.0, +20.0]▲"  # 70 - (50, 56, 60), paired by seed
    assert rows["moon"].split(" | ")[2] == "–"
    assert "n/a¹" in rows["fedbn"]
    assert not [r for r in rows if "²" in r]  # no retuned folder named: no retuned rows

    # a method retuned over a wider lr range (run.sh LR=..., its own OUT): a row after the study's, not ranked
    monkeypatch.setattr(tables, "RETUNED_ARCHIVE", tmp_path / "retuned-archive")
    wide = tmp_path / "wide"
    for seed, acc in enumerate([0.58, 0.60, 0.62]):
        write_run(wide / "two_classes" / f"scaffold-s{seed}", [(30, acc)])
    lines = tables.kind_table(out, "two_classes", wide)
    assert lines[: len(rows) + 2] == tables.kind_table(out, "two_classes")
    extra = lines[len(rows) + 2 :]
    assert len(extra) == 1 and extra[0].startswith("| scaffold, lr on log:1e-4:0.3² | 40.0 ± 0.0 <sub>s0,1,2</sub> |")
    cells = extra[0].split(" | ")
    assert cells[2:6] == ["60.0 ± 2.0 <sub>s0,1,2</sub>", "+20.0 ± 2.0 <sub>s0,1,2</sub>", "–", "+4.7 [+2.0, +8.0]▲"]


def test_tuning_plot_draws_each_method_with_both_cells(tmp_path, monkeypatch):
    tables = tuning_tables(tmp_path, monkeypatch, "tuning_tables_plot")
    out = tmp_path / "out"
    for seed, (default, tuned) in enumerate([(0.60, 0.50), (0.62, 0.56), (0.64, 0.62)]):
        write_run(tmp_path / "defaults" / "rotated" / f"fedavg-s{seed}", [(30, default)])
        write_run(out / "rotated" / f"fedavg-s{seed}", [(30, tuned)])
    write_run(tmp_path / "defaults" / "rotated" / "moon-s0", [(30, 0.7)])  # no tuned cell: not drawn
    write_run(tmp_path / "archive" / "rotated" / "fedbn-s0", [(30, 0.7)])  # no global model: never drawn
    write_run(tmp_path / "defaults" / "rotated" / "fedbn-s0", [(30, 0.7)])
    assert [
        (m, round(d, 6), round(ds, 6), round(t, 6), round(ts, 6))
        for m, d, ds, t, ts in tables.dumbbells(out, "rotated")
    ] == [("fedavg", 62.0, 2.0, 56.0, 6.0)]
    tables.plot(out, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_pretrained_table_gives_the_gap_paired_by_seed_and_fedavgs_advantage(tmp_path, monkeypatch):
    tables = load(BENCHMARKS / "pretrained" / "tables.py", "pretrained_tables")
    monkeypatch.setattr(tables, "ARCHIVE", tmp_path / "archive")
    out = tmp_path / "out"
    for seed, (iid, skew) in enumerate([(0.80, 0.50), (0.82, 0.60)]):
        write_run(out / "full" / "iid" / f"fedavg-s{seed}", [(20, iid)])
        write_run(out / "full" / "two_classes" / f"fedavg-s{seed}", [(20, skew)])
        write_run(out / "full" / "two_classes" / f"scaffold-s{seed}", [(20, skew + 0.05)])
    write_run(out / "full" / "dir0.1" / "fedavg-s0", [(5, 0.3)])
    rows = [r for r in tables.accuracy_table(out, 20) if r.startswith("| full fine-tuning | fedavg |")]
    cells = rows[0].split(" | ")[2:]
    assert cells[0] == "81.0 ± 1.4 <sub>s0,1</sub>" and cells[1] == "(running: round 5)"
    assert cells[2] == "55.0 ± 7.1 <sub>s0,1</sub>" and cells[4] == "26.0 ± 5.7 <sub>s0,1</sub> |"
    advantage = [r for r in tables.advantage_table(out, 20) if r.startswith("| full fine-tuning |")][0]
    assert "+5.0 ± 0.0 <sub>s0,1</sub>" in advantage


def test_claims_table_compares_each_method_with_its_best_tuned_baseline_paired_by_seed(tmp_path, monkeypatch):
    tables = load(BENCHMARKS / "tuning" / "tables.py", "tuning_tables_claims")
    monkeypatch.setattr(tables, "CLAIMS_ARCHIVE", tmp_path / "archive")
    out = tmp_path / "claims"
    for seed, (mine, q, s) in enumerate([(0.88, 0.86, 0.91), (0.87, 0.87, 0.90), (0.88, 0.865, 0.92)]):
        for name, acc in (("fedbc", mine), ("qfedavg", q), ("scaffold", s)):
            write_run(out / "fedbc" / f"{name}-s{seed}", [(50, acc)])
            (out / "fedbc" / f"{name}-s{seed}" / "summary.json").write_text('{"status": "finished"}')
    write_run(out / "fedacd" / "fedacd-s0", [(10, 0.5)])  # killed before its summary: not a result
    rows = {line.split(" | ")[0][2:]: line for line in tables.claims_table(out)[2:]}
    assert "| -3.33 [-4.00, -3.00] ▼ against scaffold, p = 0.25 |" in rows["fedbc"]  # the better baseline of two
    assert "qfedavg 86.5 ± 0.5 <sub>s0,1,2</sub>; scaffold 91.0 ± 1.0 <sub>s0,1,2</sub>" in rows["fedbc"]
    assert "fedacd: not run yet" in rows["fedacd"]


def test_tuning_table_marks_a_chosen_value_at_the_edge_of_its_range():
    tables = load(BENCHMARKS / "tuning" / "tables.py", "tuning_tables")
    summary = {
        "space": "algorithm.mu=log:1e-3:1 train.lr=log:1e-3:0.3",
        "best": {"params": {"algorithm.mu": 0.0145, "train.lr": 0.00103}},
        "budget": {"complete": 10, "pruned": 6, "trials": 16, "rounds_run": 190, "rounds_nominal": 240},
    }
    assert tables.at_edge(summary) == {"train.lr": "lower"}
    assert tables.chosen(summary) == ("mu=0.0145, lr=0.00103⇤", "10+6 of 16, 190/240 rounds")


def test_edge_probe_reruns_the_chosen_values_as_a_tuning_trial_below_the_range(tmp_path, tiny_config, monkeypatch):
    """benchmarks/tuning/edge_probe.py: the seed-0 final run's config at the tuning seed and rounds, at each probed
    learning rate, its last val_acc beside the tune's best; a second call reads the finished runs, trains nothing."""
    probe = load(BENCHMARKS / "tuning" / "edge_probe.py", "edge_probe")
    monkeypatch.setattr(probe, "ARCHIVE", tmp_path / "archive")
    monkeypatch.setattr(probe, "TUNE_ROUNDS", 2)
    cell = tmp_path / "study" / "two_classes"
    final = cell / "fedavg-s0"
    final.mkdir(parents=True)
    cfg = tiny_config(run={"rounds": 30, "eval_every": 1}, partition={"validation_fraction": 0.2})
    (final / "config.json").write_text(json.dumps(cfg.to_dict()))
    tune = cell / "tuning" / "fedavg"
    tune.mkdir(parents=True)
    (tune / "tune.json").write_text(json.dumps({"best": {"params": {"train.lr": 0.001}, "value": 0.5}}))
    argv = ["two_classes", "fedavg", "--lrs", "0.05,0.0001", "--study", str(tmp_path / "study")]
    rows = probe.main([*argv, "--out", str(tmp_path / "probe")])["rows"]
    assert [r["method"] for r in rows] == ["fedavg"] and rows[0]["best_val_acc"] == 0.5
    runs = {lr: tmp_path / "probe" / f"fedavg-lr{lr}" for lr in ("0.05", "0.0001")}
    for lr, run in runs.items():
        saved = json.loads((run / "config.json").read_text())
        assert (saved["run"]["seed"], saved["run"]["rounds"], saved["train"]["lr"]) == (100, 2, float(lr))
        assert rows[0]["probes"][lr] == json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["val_acc"]
    assert rows[0]["probes"]["0.05"] > rows[0]["probes"]["0.0001"]  # digits: lr 1e-4 barely moves in 2 rounds
    assert json.loads((tmp_path / "probe" / "probe.json").read_text()) == rows
    stamps = {lr: (run / "metrics.jsonl").stat().st_mtime_ns for lr, run in runs.items()}
    assert probe.main([*argv, "--out", str(tmp_path / "probe")])["rows"] == rows
    assert stamps == {lr: (run / "metrics.jsonl").stat().st_mtime_ns for lr, run in runs.items()}
    # a later call with other rates joins its probes to the method's row in probe.json
    probe.main([*argv[:3], "0.05", *argv[4:], "--out", str(tmp_path / "probe")])
    assert json.loads((tmp_path / "probe" / "probe.json").read_text()) == rows

    # a claims.sh paper's folder, another setting, the tune's own rounds per trial
    paper = tmp_path / "paper"
    shutil.copytree(cell, paper)
    summary = {"best": {"params": {"train.lr": 0.001}, "value": 0.5}, "budget": {"rounds_per_trial": 3}}
    (paper / "tuning" / "fedavg" / "tune.json").write_text(json.dumps(summary))
    more = ["--out", str(tmp_path / "probe2")]
    [row] = probe.main([str(paper), "fedavg", "--param", "train.momentum", "--values", "0.5", *more])["rows"]
    assert (row["param"], row["chosen"], list(row["probes"])) == ("train.momentum", None, ["0.5"])
    saved = json.loads((tmp_path / "probe2" / "fedavg-momentum0.5" / "config.json").read_text())
    assert (saved["run"]["rounds"], saved["train"]["momentum"], saved["train"]["lr"]) == (
        3,
        0.5,
        0.1,
    )  # the final run's
    with pytest.raises(SystemExit, match="--param train.nope: the run's config has no such setting"):
        probe.main([str(paper), "fedavg", "--param", "train.nope", "--values", "1", *more])


def test_rank_table_averages_each_methods_rank_over_the_kinds_where_every_method_finished(tmp_path, monkeypatch):
    tables = tuning_tables(tmp_path, monkeypatch, "tuning_tables_ranks")
    out = tmp_path / "out"
    methods = [m for m in tables.METHODS if m not in tables.NO_GLOBAL_MODEL]
    assert tables.rank_table(out) == ["(no kind has every method's default and tuned cells yet)"]
    for kind, flip in (("dir0.1", False), ("two_classes", True)):
        for i, m in enumerate(methods):  # default: the list's order; tuned: reversed under two classes
            write_run(tmp_path / "defaults" / kind / f"{m}-s0", [(30, 0.9 - 0.1 * i)])
            write_run(out / kind / f"{m}-s0", [(30, 0.1 + 0.1 * i if flip else 0.9 - 0.1 * i)])
    write_run(tmp_path / "defaults" / "rotated" / "fedavg-s0", [(30, 0.5)])  # rotated unfinished: left out
    lines = tables.rank_table(out)
    assert lines[0] == "| method | Dir(0.1) default → tuned | 2 classes default → tuned | average default → tuned |"
    rows = {line.split(" | ")[0][2:]: line.split(" | ")[1:] for line in lines[2:]}
    n = len(methods)
    assert rows[methods[0]] == ["1 → 1", f"1 → {n}", f"1.0 → {(1 + n) / 2:.1f} |"]
    assert rows[methods[-1]] == [f"{n} → {n}", f"{n} → 1", f"{n:.1f} → {(1 + n) / 2:.1f} |"]

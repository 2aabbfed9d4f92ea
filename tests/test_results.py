import warnings

import numpy as np
import pytest
from rich.console import Console

from fedhet.errors import FedhetError
from fedhet.results import (
    MetricsLog,
    group_runs,
    load_runs,
    plot_curves,
    plot_label_distribution,
    print_table,
    read_json,
    read_metrics,
    summary_table,
    to_markdown,
    truncate_after,
    write_json_atomic,
)
from fedhet.results.report import make_labels

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def leftovers(folder):
    return [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]


# ---- store ----


def test_metrics_log_round_trip(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    log = MetricsLog(path)
    records = [{"round": 1, "test_acc": 0.5, "clients": 10}, {"round": 2, "test_acc": np.float32(0.75)}]
    for record in records:
        log.append(record)
    assert read_metrics(path) == [records[0], {"round": 2, "test_acc": 0.75}]
    assert path.read_text().count("\n") == 2


def test_record_without_round_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="round"):
        MetricsLog(tmp_path / "m.jsonl").append({"test_acc": 0.5})


def test_torn_last_line_is_skipped_and_repaired(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"round": 1, "test_acc": 0.1}\n{"round": 2, "test_acc": 0.2}\n{"round": 3, "test_a')
    with pytest.warns(UserWarning, match="torn"):
        assert [r["round"] for r in read_metrics(path)] == [1, 2]
    with pytest.warns(UserWarning, match="torn"):
        log = MetricsLog(path)
    log.append({"round": 3, "test_acc": 0.3})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [r["round"] for r in read_metrics(path)] == [1, 2, 3]


def test_corrupt_middle_line_is_an_error(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"round": 1}\n{"round": \n{"round": 3}\n')
    with pytest.raises(FedhetError, match=":2:"):
        read_metrics(path)


def test_truncate_after_keeps_earlier_rounds(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    for rnd in range(1, 6):
        log.append({"round": rnd, "train_loss": 1.0 / rnd})
    assert truncate_after(path, 3) == 3
    assert [r["round"] for r in read_metrics(path)] == [1, 2, 3]
    assert leftovers(tmp_path) == []
    assert truncate_after(tmp_path / "absent.jsonl", 3) == 0


def test_write_json_atomic_replaces_and_keeps_old_on_failure(tmp_path):
    path = tmp_path / "summary.json"
    write_json_atomic(path, {"a": 1})
    write_json_atomic(path, {"a": 2, "b": [1, 2]})
    assert read_json(path) == {"a": 2, "b": [1, 2]}
    with pytest.raises(TypeError):
        write_json_atomic(path, {"bad": object()})
    assert read_json(path) == {"a": 2, "b": [1, 2]}
    assert leftovers(tmp_path) == []


# ---- report ----


def make_run(root, name, algorithm, seed, accs, **extra_metrics):
    """A run folder with one evaluation per round; `accs` are the test accuracies."""
    folder = root / name
    folder.mkdir(parents=True)
    config = {
        "run": {"name": name, "seed": seed, "rounds": len(accs), "out_dir": str(folder)},
        "data": {"dataset": "mnist", "partition": "dirichlet", "alpha": 0.1, "num_clients": 10},
        "model": {"name": "cnn"},
        "train": {"lr": 0.01, "epochs": 1},
        "algorithm": algorithm,
        "server": {"optimizer": "avg"},
    }
    write_json_atomic(folder / "config.json", config)
    log = MetricsLog(folder / "metrics.jsonl")
    for rnd, acc in enumerate(accs, start=1):
        log.append({"round": rnd, "test_acc": acc, **{k: v[rnd - 1] for k, v in extra_metrics.items()}})
    return folder


def test_a_tuned_comparisons_folder_reports_its_final_runs_not_the_tuning_trials(tmp_path):
    out = tmp_path / "cmp"
    make_run(out, "fedavg-s0", {"name": "fedavg"}, 0, [0.5, 0.6])
    tune = out / "tuning" / "fedavg"
    make_run(tune / "trials", "0", {"name": "fedavg"}, 100, [0.1, 0.2])
    (tune / "study.db").write_bytes(b"")
    assert [r.path.name for r in load_runs([out])] == ["fedavg-s0"]
    assert [r.path.name for r in load_runs([tune])] == ["0"]  # the tune itself: its trials
    assert [r.path.name for r in load_runs([tune / "trials"])] == ["0"]
    with pytest.raises(FedhetError, match=r"only the trial runs of tunes under .*tuning; to report them, give a tune"):
        load_runs([out / "tuning"])


def test_runs_differing_by_seed_form_one_group(tmp_path):
    sweep = tmp_path / "sweep"
    for seed in (0, 1):
        make_run(sweep / "nested", f"fedavg-s{seed}", {"name": "fedavg"}, seed, [0.1, 0.2])
        make_run(sweep, f"fedprox-s{seed}", {"name": "fedprox", "mu": 0.1}, seed, [0.3, 0.4])
    (sweep / "not-a-run").mkdir()
    runs = load_runs([sweep])
    assert len(runs) == 4
    groups = group_runs(runs)
    assert sorted(g.label for g in groups) == ["fedavg", "fedprox"]
    assert all(len(g.runs) == 2 for g in groups)
    assert all(len({r.config["run"]["seed"] for r in g.runs}) == 2 for g in groups)
    assert load_runs([sweep / "fedprox-s0"])[0].config["algorithm"]["mu"] == 0.1


def test_load_runs_reports_missing_paths(tmp_path):
    with pytest.raises(FedhetError, match="does not exist"):
        load_runs([tmp_path / "nope"])
    with pytest.raises(FedhetError, match="no runs"):
        load_runs([tmp_path])


def test_labels_name_the_settings_that_differ():
    base = {"algorithm.name": "fedprox", "data.alpha": 0.1, "train.lr": 0.01, "server.lr": 1.0}
    fedavg = {"algorithm.name": "fedavg", "data.alpha": 0.1, "train.lr": 0.01, "server.lr": 1.0}
    assert make_labels([fedavg, {**base, "algorithm.mu": 0.01}, {**base, "algorithm.mu": 0.1}]) == [
        "fedavg",
        "fedprox mu=0.01",
        "fedprox mu=0.1",
    ]
    assert make_labels([fedavg, {**fedavg, "data.alpha": 0.5}]) == ["fedavg alpha=0.1", "fedavg alpha=0.5"]
    lrs = make_labels([fedavg, {**fedavg, "train.lr": 0.1, "server.lr": 0.5}])
    assert lrs == ["fedavg train.lr=0.01 server.lr=1", "fedavg train.lr=0.1 server.lr=0.5"]
    # Same algorithm, one group has an extra key: the key's presence is what tells them apart.
    assert make_labels([fedavg, {**fedavg, "algorithm.momentum": 0.9}]) == ["fedavg", "fedavg momentum=0.9"]
    # A run made before an option existed, beside one that sets it: the option shows although lr already tells
    # the two apart (else the second reads as the first at another lr)
    old, new = {**fedavg, "train.lr": 0.01}, {**fedavg, "algorithm.normalize": True, "train.lr": 0.5}
    assert make_labels([old, new]) == ["fedavg lr=0.01", "fedavg normalize=true lr=0.5"]
    plain = {**fedavg, "server.aggregation": "weights", "server.gne_solver": "newton"}
    gne = {**plain, "server.aggregation": "gne"}
    ccp = {**gne, "server.gne_solver": "ccp"}
    adam = {**gne, "server.name": "fedadam"}
    assert make_labels([plain, gne, ccp, adam]) == [
        "fedavg",
        "fedavg+gne gne_solver=newton",
        "fedavg+gne gne_solver=ccp",
        "fedavg+gne+fedadam gne_solver=newton",
    ]


def test_summary_table_mean_and_std_over_seeds(tmp_path):
    finals = [0.80, 0.84, 0.82]  # mean 0.82, sample std 0.02
    for seed, final in enumerate(finals):
        make_run(
            tmp_path,
            f"s{seed}",
            {"name": "fedavg"},
            seed,
            [0.5, 0.9 - seed * 0.01, final],
            client_acc_worst10=[None, None, 0.4 + 0.1 * seed],
        )
    [row] = summary_table(group_runs(load_runs([tmp_path])))
    assert row.seeds == 3 and row.rounds == (3, 3)
    assert row.final_mean == pytest.approx(0.82)
    assert row.final_std == pytest.approx(0.02)
    assert row.best_mean == pytest.approx(0.89)
    assert row.client_acc_worst10 == pytest.approx(0.5)
    assert row.client_dist_acc is None and row.personal_acc_macro is None

    markdown = to_markdown([row])
    # ± on every measured column with seeds (best: 0.90, 0.89, 0.88; worst-10%: 0.4, 0.5, 0.6), and beside the final
    # value its 95 % t interval: 82 ± t(0.975, 2) * 2 / sqrt(3) = 82 ± 4.3027 * 1.1547 = 82 ± 4.97
    assert "| fedavg | 3 | 82.00 ± 2.00 | [77.03, 86.97] | 89.00 ± 1.00 | — | 50.00 ± 10.00 | 3 |" in markdown
    assert "personal" not in markdown
    console = Console(record=True, width=200)
    print_table([row], console)
    text = console.export_text()
    assert "82.00 ± 2.00" in text and "fedavg" in text


def test_a_narrow_console_folds_long_labels_and_keeps_every_number_whole(tmp_path):
    for variant, on in enumerate((False, True)):
        algo = {"name": "fedrane", "lambda_cd": 0.2 * on, "self_loop": on, "lra_at_eval": on, "topk": 10 + on}
        for seed in range(3):
            accs = [0.5, 0.7 + seed * 0.01 + variant / 10]
            make_run(tmp_path, f"v{variant}s{seed}", algo, seed, accs, client_acc_worst10=[None, 0.4])
    rows = summary_table(group_runs(load_runs([tmp_path])))
    console = Console(record=True, width=60)
    print_table(rows, console)
    text = console.export_text()
    assert "71.00 ± 1.00" in text and "81.00 ± 1.00" in text and "…" not in text
    assert "| 2 |" in to_markdown(rows)  # the last column (rounds), which a too-narrow console must not crop
    assert text.count(" 2 │\n") == 2
    assert "fedrane lambda_cd=0.2 self_loop=true " in text and " lra_at_eval=true topk=11 " in text  # wrapped
    assert "test_acc" in text and "rounds" in text  # headers wrap between words, never inside one


def test_single_seed_has_no_std_and_loss_best_is_minimum(tmp_path):
    make_run(tmp_path, "only", {"name": "fedavg"}, 0, [0.5, 0.6], test_loss=[2.0, 1.5])
    groups = group_runs(load_runs([tmp_path]))
    [acc] = summary_table(groups)
    assert acc.final_std is None
    assert "60.00 |" in to_markdown([acc]) and "±" not in to_markdown([acc])
    [loss] = summary_table(groups, metric="test_loss")
    assert loss.best_mean == 1.5 and "final test_loss" in to_markdown([loss])


def test_attack_success_is_a_lower_is_better_percentage_column(tmp_path):
    # a backdoor run: the best ASR is the lowest one, shown as a percentage; the spent epsilon is a plain number
    asr, eps = [0.9, 0.2, 0.5], [1.0, 2.0, 3.5]
    make_run(tmp_path, "bd", {"name": "fedavg"}, 0, [0.5, 0.6, 0.7], **{"attack/asr": asr, "privacy/epsilon": eps})
    groups = group_runs(load_runs([tmp_path]))
    [row] = summary_table(groups, metric="attack/asr")
    assert row.best_mean == 0.2 and row.final_mean == 0.5
    [acc] = summary_table(groups)
    assert acc.extras["attack/asr"] == (0.5, None) and acc.extras["privacy/epsilon"] == (3.5, None)
    markdown = to_markdown([acc])
    assert "backdoor success (ASR) | epsilon spent |" in markdown and "| 50.00 | 3.5 |" in markdown


# ---- plots ----


def test_plot_curves_writes_png(tmp_path):
    for seed in (0, 1):
        make_run(tmp_path / "runs", f"a{seed}", {"name": "fedavg"}, seed, [0.1, 0.3 + 0.05 * seed, 0.5])
        make_run(tmp_path / "runs", f"b{seed}", {"name": "scaffold"}, seed, [0.2, 0.4, 0.6 - 0.05 * seed])
    groups = group_runs(load_runs([tmp_path / "runs"]))
    out = plot_curves(groups, tmp_path / "figs" / "acc.png")
    assert out.read_bytes()[:8] == PNG_MAGIC and out.stat().st_size > 1000
    with pytest.raises(FedhetError, match="client_dist_acc"):
        plot_curves(groups, tmp_path / "x.png", metric="client_dist_acc")


@pytest.mark.parametrize("clients,classes", [(40, 10), (20, 100)])
def test_plot_label_distribution_writes_png(tmp_path, clients, classes):
    counts = np.random.default_rng(0).integers(0, 50, size=(clients, classes))
    out = plot_label_distribution(counts, tmp_path / "labels.png", title="Dirichlet 0.1")
    assert out.read_bytes()[:8] == PNG_MAGIC and out.stat().st_size > 1000


def test_plot_label_distribution_rejects_bad_counts(tmp_path):
    with pytest.raises(ValueError):
        plot_label_distribution(np.array([1, 2, 3]), tmp_path / "x.png", "bad")

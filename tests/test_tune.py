"""Issue 45: `fedhet tune` (Optuna on validation data, a study in OUT/study.db, trials as run folders, resumable
after a kill) and `fedhet compare --tune` (every variant tuned at the same budget); bad input is one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from filelock import FileLock
from typer.testing import CliRunner

import fedhet
from fedhet.cli import app
from fedhet.errors import ConfigError, RunFailed

optuna = pytest.importorskip("optuna")

from fedhet.tuning.study import (  # noqa: E402  (after the skip: optuna is an optional dependency)
    STUDY_FILE,
    TuneSettings,
    counted,
    grid_space,
    open_study,
    requeue_interrupted,
    storage,
)
from fedhet.tuning.trials import TrialJob, run_trial, take_over  # noqa: E402
from fedhet.tuning.tuner import LOCK_FILE, plan_tune  # noqa: E402

runner = CliRunner()
TINY = [
    "dataset.name=digits",
    "model.name=mlp",
    "model.hidden=[16]",
    "partition.num_clients=3",
    "partition.validation_fraction=0.2",
    "train.batch_size=32",
    "run.rounds=2",
    "run.progress=false",
    "run.workers=1",
]
TINY_ARGS = [a for item in TINY for a in ("-s", item)]


def tiny(tmp_path: Path, *more: str, algorithm: str = "fedprox") -> fedhet.Config:
    return fedhet.make_config(None, [*TINY, *more], algorithm=algorithm, out=str(tmp_path / "out"))


def plan(tmp_path: Path, *more: str, space=("train.lr",), trials: int = 3, **settings):
    return plan_tune(tiny(tmp_path, *more), list(space), TuneSettings(trials, **settings), tmp_path / "tune")


# ---------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"metric": "test_acc"}, "tuning reads validation metrics only"),
        ({"metric": "client_acc_mean"}, "tuning reads validation metrics only"),
        ({"metric": "val_bogus"}, "unknown validation metric 'val_bogus'; choose one of: val_acc, val_loss"),
        ({"trials": 0}, "--trials 0: give the number of trials"),
        ({"sampler": "bayes"}, "unknown --sampler 'bayes'; choose one of: tpe, random, grid"),
        ({"pruner": "asha"}, "unknown --pruner 'asha'; choose one of: none, median, hyperband"),
        ({"reduce": "mean"}, "unknown --reduce 'mean'; choose 'last', 'best' or 'last<K>'"),
    ],
)
def test_bad_settings_are_refused_before_anything_runs(tmp_path, kwargs, message):
    args = {"trials": 2, **kwargs}
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        fedhet.tune(None, TINY, out=str(tmp_path / "out"), **args)
    assert not (tmp_path / "out").exists()


def test_the_cli_refuses_a_test_metric_in_one_line():
    result = runner.invoke(app, ["tune", "--trials", "4", "--metric", "test_acc", *TINY_ARGS])
    assert result.exit_code != 0
    assert "tuning reads validation metrics only" in str(result.exception)


def test_tuning_needs_validation_data(tmp_path):
    with pytest.raises(ConfigError, match=r"-s partition.validation_fraction=0.1$"):
        plan(tmp_path, "partition.validation_fraction=0")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("algorithm.foo", "unknown parameter 'algorithm.foo' of algorithm 'fedprox'"),
        ("algorithm.weighting", None),
        ("train.lr=log:0:1", "a log range needs bounds > 0"),
        ("train.lr=uniform:0.5:0.1", "is reversed"),
        ("train.lr=uniform:0.1:0.1", "is empty"),
        ("train.lr=choice:0.1", "a choice needs two or more values"),
    ],
)
def test_a_bad_space_is_one_line(tmp_path, spec, message):
    if message is None:  # a parameter fedprox does not have or cannot tune: either way refused by name
        message = "algorithm.weighting"
    with pytest.raises(ConfigError, match=message):
        plan(tmp_path, space=[spec])


def test_a_personalised_metric_for_a_method_without_personalised_models_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"^--metric val_personal_acc_micro: fedprox has no personalised models"):
        plan(tmp_path, metric="val_personal_acc_micro")
    assert plan(tmp_path, "algorithm.name=fedrod", metric="val_personal_acc_micro").settings.metric.endswith("micro")


def test_an_algorithm_with_nothing_to_tune_needs_a_named_setting(tmp_path):
    with pytest.raises(ConfigError, match="fedavg has no tunable parameter of its own: name the settings to tune"):
        plan_tune(tiny(tmp_path, algorithm="fedavg"), [], TuneSettings(2), tmp_path / "tune")


def test_a_grid_smaller_than_the_trials_is_refused(tmp_path):
    p = plan(tmp_path, space=["train.lr=choice:0.01,0.1"], trials=2, sampler="grid")
    assert grid_space(p.space) == {"algorithm.mu": [0.001, 0.0316228, 1.0], "train.lr": [0.01, 0.1]}
    with pytest.raises(ConfigError, match="has 6 points, fewer than --trials 7; give --trials 6 or fewer"):
        plan(tmp_path, space=["train.lr=choice:0.01,0.1"], trials=7, sampler="grid")


def test_a_tune_folder_in_use_is_refused(tmp_path):
    p = plan(tmp_path)
    p.out_dir.mkdir(parents=True)
    in_use = pytest.raises(ConfigError, match="is in use: another fedhet tune is running there")
    with FileLock(p.out_dir / LOCK_FILE, timeout=0), in_use:
        fedhet.tune(None, TINY, space=["train.lr"], trials=2, algorithm="fedprox", out=str(tmp_path), name="tune")


def test_a_study_made_for_another_config_is_refused_naming_what_differs(tmp_path):
    first = plan(tmp_path)
    open_study(first.out_dir, first.base, first.space, first.settings, parallel=False)
    again = plan(tmp_path)  # the same settings: accepted
    open_study(again.out_dir, again.base, again.space, again.settings, parallel=False)
    other = plan(tmp_path, "train.batch_size=16", space=["train.lr=log:1e-2:0.3"])
    with pytest.raises(ConfigError) as err:
        open_study(other.out_dir, other.base, other.space, other.settings, parallel=False)
    text = str(err.value)
    assert "was made for another tune: train.batch_size: 32 -> 16" in text
    assert (
        "space: 'algorithm.mu=log:1e-3:1 train.lr=log:1e-3:0.3' -> 'algorithm.mu=log:1e-3:1 train.lr=log:1e-2:0.3'"
        in text
    )
    longer = plan(tmp_path, "run.rounds=5")
    with pytest.raises(ConfigError, match="run.rounds: 2 -> 5"):
        open_study(longer.out_dir, longer.base, longer.space, longer.settings, parallel=False)


def test_trial_folders_without_their_study_are_refused(tmp_path):
    (tmp_path / "tune" / "trials" / "0").mkdir(parents=True)
    with pytest.raises(ConfigError, match="holds trial folders but no study.db"):
        plan(tmp_path)


# ---------------------------------------------------------------------------------------------- resume bookkeeping
def _open_storage(folder: str) -> str:
    try:
        storage(Path(folder))
        return "ok"
    except ConfigError as err:
        return str(err)


def test_processes_opening_a_new_study_database_at_once_all_get_it(tmp_path):
    # Each process creates the tables of a new study.db; unserialised, about half of these rounds failed one of them
    # with "table studies already exists" or a duplicate alembic_version (a killed-tune test failed on it in CI).
    import multiprocessing

    storage(tmp_path / "warm")  # sqlalchemy and alembic imported once, before the processes fork
    with multiprocessing.get_context("fork").Pool(3) as pool:
        for attempt in range(3):
            folder = tmp_path / str(attempt)
            assert pool.map(_open_storage, [str(folder)] * 3) == ["ok"] * 3
            assert optuna.get_all_study_summaries(f"sqlite:///{folder / STUDY_FILE}") == []


def test_a_trial_left_running_is_requeued_once_with_its_params_and_counts_once(tmp_path):
    p = plan(tmp_path)
    study = open_study(p.out_dir, p.base, p.space, p.settings, parallel=False)
    done = study.ask()
    p.space.suggest(done)
    study.tell(done, 0.5)
    left = study.ask()
    values = p.space.suggest(left)  # then the tune was killed
    assert requeue_interrupted(study) == [left.number]
    assert requeue_interrupted(study) == []  # a second start does not enqueue it again
    states = {t.number: t.state for t in study.get_trials()}
    assert states == {
        0: optuna.trial.TrialState.COMPLETE,
        1: optuna.trial.TrialState.FAIL,
        2: optuna.trial.TrialState.WAITING,
    }
    rerun = study.ask()
    assert rerun.number == 2 and p.space.suggest(rerun) == values
    assert rerun.user_attrs == {"continues": 1, "continued_from": [1]}
    assert [t.number for t in counted(study)] == [0]  # the interrupted one counts for nothing


def test_a_rerun_takes_over_the_folder_of_the_trial_it_continues(tmp_path):
    (tmp_path / "3").mkdir()
    (tmp_path / "3" / "metrics.jsonl").write_text("")
    assert take_over(tmp_path / "9", [3]) == 3
    assert (tmp_path / "9" / "metrics.jsonl").exists() and not (tmp_path / "3").exists()
    assert take_over(tmp_path / "12", [3, 9]) == 9  # the newest folder of the chain
    assert take_over(tmp_path / "12", [3, 9]) is None  # already there: nothing to take


# ---------------------------------------------------------------------------------------------- a trial
@pytest.mark.slow  # trains one round, then resumes the folder to round 3: 3-12 s on a shared 2-core machine
def test_a_pruned_trial_stops_cleanly_and_counts_the_rounds_it_ran(tmp_path):
    from fedhet.cells import _DataCache

    p = plan(tmp_path, "run.rounds=3")
    raw = p.base.to_dict()
    raw["run"]["name"] = "0"
    asked = []

    def report(step: int, value: float) -> bool:
        asked.append(step)
        return True  # the pruner says stop at the first evaluation

    outcome = run_trial(TrialJob(0, raw, "val_acc", "last"), _DataCache(), lambda event: None, report)
    assert (outcome.status, outcome.rounds_done, outcome.run_dir) == ("pruned", 1, "trials/0")
    folder = p.out_dir / "trials" / "0"
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["status"] == "pruned" and summary["rounds_done"] == 1
    assert (folder / "checkpoints" / "last.pt").exists() and asked == [1]
    # an ordinary run folder: fedhet resume trains it on to the end
    assert fedhet.resume(folder).summary["rounds_done"] == 3


def test_each_evaluation_reaches_the_pruner_once_when_rounds_go_unevaluated(tmp_path):
    # A round without an evaluation used to send every earlier evaluation to the pruner again (Optuna warned
    # "step=2 is already reported" in every trial of a run with eval_every > 1).
    from fedhet.cells import _DataCache

    p = plan(tmp_path, "run.rounds=4", "run.eval_every=2")
    raw = p.base.to_dict()
    raw["run"]["name"] = "0"
    asked, events = [], []

    def report(step: int, value: float) -> bool:
        asked.append(step)
        return False

    outcome = run_trial(TrialJob(0, raw, "val_acc", "last"), _DataCache(), events.append, report)
    assert outcome.status == "finished" and asked == [2, 4]
    assert [(e[2], e[3] is None) for e in events if e[0] == "round"] == [(1, True), (2, False), (3, True), (4, False)]


# ---------------------------------------------------------------------------------------------- end to end
def _tune_command(out: Path, trials: int, jobs: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "fedhet.cli",
        "tune",
        "--trials",
        str(trials),
        "-j",
        str(jobs),
        "--threads",
        "1",
        "-a",
        "fedprox",
        "-t",
        "train.lr=log:0.01:0.3",
        "-o",
        str(out),
        "--name",
        "tu",
        *TINY_ARGS,
    ]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}


@pytest.mark.slow  # 8 trials of 2 rounds in 2 worker processes: 30-90 s on a shared 2-core machine
def test_tune_with_two_jobs_writes_a_study_optuna_reads(tmp_path):
    result = subprocess.run(_tune_command(tmp_path, 8, 2), env=_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    folder = tmp_path / "tu"
    study = optuna.load_study(study_name="tu", storage=f"sqlite:///{folder / 'study.db'}")
    finished = [t for t in study.trials if t.state.is_finished()]
    assert len(finished) == 8 == len(study.trials)
    assert {t.number for t in finished} == {int(p.name) for p in (folder / "trials").iterdir()}
    summary = json.loads((folder / "tune.json").read_text())
    assert summary["study_name"] == "tu" and summary["budget"]["trials"] == 8
    assert summary["best"]["trial"] == study.best_trial.number
    assert set(summary["best"]["params"]) == {"algorithm.mu", "train.lr"}
    assert "best: trial" in result.stdout and "budget: 8 trials" in result.stdout
    assert (folder / "tune.md").read_text().startswith("# Tune tu")
    assert fedhet.report(folder / "trials")  # every trial a run folder fedhet report reads


@pytest.mark.slow  # a tune killed with -9 in the middle, then run again: a minute or two on 2 shared cores
def test_a_killed_tune_resumes_without_duplicating_finished_trials(tmp_path):
    trials, folder = 6, tmp_path / "tu"
    command = [*_tune_command(tmp_path, trials, 1), "-s", "run.rounds=10"]  # a window to kill it mid-trial
    proc = subprocess.Popen(
        command, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    state = optuna.trial.TrialState

    def load() -> list:
        if not (folder / "trials").exists():  # the tuner has not finished creating its study
            return []
        try:
            return optuna.load_study(study_name="tu", storage=f"sqlite:///{folder / 'study.db'}").trials
        except Exception:  # not created yet
            return []

    def mid_run(t) -> bool:  # a trial with a checkpoint and rounds still to train
        run = folder / "trials" / str(t.number)
        return (
            t.state == state.RUNNING
            and (run / "checkpoints" / "last.pt").exists()
            and not (run / "summary.json").exists()
        )

    deadline = time.monotonic() + 400
    while True:  # kill it once 2 trials completed and another is in the middle of its run
        found = load()
        if sum(t.state == state.COMPLETE for t in found) >= 2 and any(mid_run(t) for t in found):
            break
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1]
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    before = {t.number: t.params for t in load() if t.state == state.COMPLETE}
    killed = [t for t in load() if t.state == state.RUNNING]
    assert killed and all(t.params for t in killed)
    result = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "rerunning trial(s)" in result.stderr and "continues trial" in result.stderr
    trials_now = load()
    done = [t for t in trials_now if t.state in (state.COMPLETE, state.PRUNED)]
    assert len(done) == trials  # the total asked for, no more
    assert {t.number: t.params for t in done if t.number in before} == before  # finished trials kept as they were
    params = [tuple(sorted(t.params.items())) for t in done]
    assert len(set(params)) == len(params)  # none ran twice
    successors = {s.user_attrs["continues"]: s for s in trials_now if "continues" in s.user_attrs}
    assert [t.number for t in trials_now if t.state == state.FAIL] == [t.number for t in killed]
    for t in killed:  # rerun with its parameters, continuing its run folder from the checkpoint
        rerun = successors[t.number]
        assert rerun.params == t.params and rerun.state.is_finished()
        assert not (folder / "trials" / str(t.number)).exists()
        provenance = json.loads((folder / "trials" / str(rerun.number) / "provenance.json").read_text())
        assert provenance["resumes"], "the rerun resumed the killed trial's run"
    assert json.loads((folder / "tune.json").read_text())["budget"]["trials"] == trials


def test_compare_tune_refuses_a_key_no_variant_has_and_a_reused_seed(tmp_path):
    base = ["compare", "-v", "fedavg,fedprox", "--seeds", "0", *TINY_ARGS, "-o", str(tmp_path)]
    result = runner.invoke(app, [*base, "--tune", "2", "-t", "algorithm.tau"])
    assert "-t algorithm.tau: no variant of this comparison can tune it (fedavg, fedprox)" in str(result.exception)
    result = runner.invoke(app, [*base, "--tune", "2", "--tune-seeds", "0"])
    assert "the tuning seed(s) 0 are also seeds of the comparison (0)" in str(result.exception)
    result = runner.invoke(app, [*base, "--tune", "2", "--tune-seeds", "100,x"])
    assert "--tune-seeds '100,x': give distinct seeds as a comma list" in str(result.exception)
    result = runner.invoke(app, [*base, "-t", "train.lr"])
    assert "-t set(s) how compare tunes: add --tune TRIALS" in str(result.exception)
    result = runner.invoke(app, [*base, "--tune", "2", "--metric", "test_acc"])
    assert "tuning reads validation metrics only" in str(result.exception)
    assert not any(tmp_path.iterdir())


@pytest.mark.slow  # two variants x 2 trials x 2 rounds, then their final runs: 30-60 s on a shared 2-core machine
def test_compare_tune_tunes_each_variant_and_tabulates_the_chosen_values(tmp_path):
    args = ["compare", "-v", "fedavg,fedprox", "--seeds", "0", "--tune", "2", "-t", "train.lr=log:0.01:0.3"]
    result = runner.invoke(
        app, [*args, "--tune-rounds", "1", "--tune-seeds", "100,101", *TINY_ARGS, "-o", str(tmp_path)]
    )
    assert result.exit_code == 0, result.output
    table = (tmp_path / "comparison.md").read_text()
    assert "## Tuning: 2 trials x 1 rounds per variant, seeds 100,101 (mean), on val_acc (last)" in table
    results, tuning = table.split("## Tuning")
    # the chosen values belong to the method (in its label): the rows are one setting, so no rank over "settings"
    labels = [line.split("|")[1].strip() for line in results.splitlines() if line.startswith("| fed")]
    assert [label.split()[0] for label in labels] == ["fedavg", "fedprox"] and "lr=" in labels[0]
    assert "average rank" not in results, results
    rows = {line.split("|")[1].strip(): line for line in tuning.splitlines() if line.startswith("| fed")}
    assert "train.lr=" in rows["fedavg"] and "algorithm.mu=" not in rows["fedavg"]
    assert "algorithm.mu=" in rows["fedprox"] and "train.lr=" in rows["fedprox"]
    assert all("| 2 | 4 of 4 |" in rows[v] for v in ("fedavg", "fedprox")), table  # the same: 2 x 1 round x 2 seeds
    tuned = json.loads((tmp_path / "tuning" / "fedprox" / "tune.json").read_text())
    final = json.loads((tmp_path / "fedprox-s0" / "config.json").read_text())
    assert final["algorithm"]["mu"] == tuned["best"]["params"]["algorithm.mu"]
    assert final["run"]["seed"] == 0 and final["run"]["rounds"] == 2
    record = json.loads((tmp_path / "fedprox-s0" / "provenance.json").read_text())["tuning"]
    assert record["study"]["name"] == "fedprox" and record["study"]["path"].endswith("tuning/fedprox/study.db")
    assert record["trial"] == tuned["best"]["trial"] and record["objective"]["metric"] == "val_acc"
    best = tmp_path / "tuning" / "fedprox" / "trials" / str(record["trial"])
    values = [fedhet.load_run(best / f"s{seed}").records[-1]["val_acc"] for seed in (100, 101)]
    assert record["objective"]["value"] == pytest.approx(sum(values) / 2)  # the mean over the tuning seeds
    assert [fedhet.load_run(best / f"s{seed}").config["run"]["seed"] for seed in (100, 101)] == [100, 101]


class _AlwaysPrune:
    """A pruner that stops every trial at its first report (Optuna's BasePruner interface)."""

    def prune(self, study, trial) -> bool:
        return True


@pytest.mark.slow  # two worker processes start (torch import each): 20-40 s on a shared 2-core machine
def test_pooled_tunes_share_the_workers_and_pruned_trials_count_the_rounds_they_ran(tmp_path, monkeypatch):
    from fedhet.tuning import tuner

    monkeypatch.setattr("fedhet.tuning.study.make_pruner", lambda kind, rounds: _AlwaysPrune())
    first = plan(tmp_path / "a", "run.rounds=3", trials=1)
    second = plan(tmp_path / "b", "run.rounds=3", trials=2)
    results = tuner.tune_all([("fedprox a", first), ("fedprox b", second)], jobs=2, threads=1)
    assert [r.best_trial for r in results] == [None, None]
    assert [r.budget for r in results] == [
        {
            "trials": trials,
            "complete": 0,
            "pruned": trials,
            "failed": 0,
            "rounds_per_trial": 3,
            "rounds_run": trials,  # each stopped after its first round
            "rounds_nominal": 3 * trials,
        }
        for trials in (1, 2)
    ]
    for p, trials in ((first, 1), (second, 2)):
        for number in range(trials):
            summary = json.loads((p.out_dir / "trials" / str(number) / "summary.json").read_text())
            assert (summary["status"], summary["rounds_done"]) == ("pruned", 1)
        assert json.loads((p.out_dir / "tune.json").read_text())["budget"]["trials"] == trials
    # the first tune has one trial for two workers: the second tune's first trial takes the other at once
    only = optuna.load_study(study_name="tune", storage=storage(first.out_dir)).trials[0]
    second_first = optuna.load_study(study_name="tune", storage=storage(second.out_dir)).trials[0]
    assert second_first.datetime_start < only.datetime_complete
    with pytest.raises(RunFailed, match="no trial of the tune in .* completed"):
        tuner.raise_if_nothing(results[0])


def test_a_tune_of_several_writes_its_outputs_when_its_own_last_trial_ends(tmp_path):
    """A comparison's first tune is summed up while the next one's trials still run (tune.md readable, a kill then
    loses nothing of it), and only then: not while a trial of its own is running."""
    from fedhet.tuning.tuner import _Tune

    p = plan(tmp_path, trials=2)
    t = _Tune("fedprox", p, open_study(p.out_dir, p.base, p.space, p.settings, parallel=True), finished=1, running=1)
    t.end_if_done()
    assert t.result is None and not (p.out_dir / "tune.json").exists()
    t.running, t.finished = 0, 2
    t.end_if_done()
    assert t.result is not None and t.result.study_name == "tune"
    assert json.loads((p.out_dir / "tune.json").read_text())["study_name"] == "tune"


def test_a_tune_that_a_killed_comparison_finished_is_summed_up_before_the_next_one_runs(tmp_path, monkeypatch):
    from fedhet.tuning import tuner

    done, todo = plan(tmp_path / "a", trials=1), plan(tmp_path / "b", trials=1)
    study = open_study(done.out_dir, done.base, done.space, done.settings, parallel=False)
    trial = study.ask({"train.lr": optuna.distributions.FloatDistribution(1e-3, 0.3, log=True)})
    trial.set_user_attr("status", "finished")
    study.tell(trial, 0.5)
    seen = []  # what the first tune's folder holds when the second tune's trials start
    monkeypatch.setattr(tuner, "_run_here", lambda *a: seen.append((done.out_dir / "tune.json").exists()))
    tuner.tune_all([("a", done), ("b", todo)], jobs=1)
    assert seen == [True]


def test_a_grid_sampler_suggests_distinct_grid_points(tmp_path):
    p = plan(tmp_path, space=["train.lr=choice:0.01,0.1"], trials=6, sampler="grid")
    study = open_study(p.out_dir, p.base, p.space, p.settings, parallel=False)
    grid = grid_space(p.space)
    seen = set()
    for _ in range(6):
        trial = study.ask()
        values = p.space.suggest(trial)
        assert all(values[k] in grid[k] for k in grid)
        seen.add(tuple(values.values()))
        study.tell(trial, 0.5)
    assert len(seen) == 6


def test_a_trial_in_a_worker_process_trains_its_clients_there(tmp_path):
    """A worker process may not start processes of its own: its trials run with run.workers = 1 whatever the config
    says (auto starts client processes on a machine of 4 cores or more)."""
    from fedhet.tuning.tuner import next_job

    p = plan(tmp_path, "run.workers=0")
    study = open_study(p.out_dir, p.base, p.space, p.settings, parallel=True)
    _, here = next_job(study, p)
    _, there = next_job(study, p, in_worker=True)
    assert here.raw["run"]["workers"] == 0 and there.raw["run"]["workers"] == 1
    assert (here.raw["run"]["name"], there.raw["run"]["name"]) == ("0", "1")
    assert there.raw["run"]["out_dir"] == str(p.out_dir / "trials")


def test_several_tuning_seeds_give_a_trial_one_run_folder_per_seed(tmp_path):
    from fedhet.tuning.trials import seed_runs
    from fedhet.tuning.tuner import next_job

    p = plan_tune(tiny(tmp_path), [], TuneSettings(2), tmp_path / "tune", seeds=[100, 101])
    assert p.rounds_per_trial == 4 and p.base.run.seed == 100
    study = open_study(p.out_dir, p.base, p.space, p.settings, parallel=False, seeds=p.seeds)
    _, job = next_job(study, p)
    runs = seed_runs(job, tmp_path / "tune" / "trials" / "0")
    assert [(d.relative_to(tmp_path).as_posix(), r["run"]["seed"]) for d, r in runs] == [
        ("tune/trials/0/s100", 100),
        ("tune/trials/0/s101", 101),
    ]
    one = plan_tune(tiny(tmp_path), [], TuneSettings(2), tmp_path / "one", seeds=[7])
    assert one.seeds == [] and one.base.run.seed == 7  # one seed: the trial's own run folder
    with pytest.raises(ConfigError, match=r"seeds: \[100, 101\] -> \[100, 102\]"):
        open_study(p.out_dir, p.base, p.space, p.settings, parallel=False, seeds=[100, 102])


def test_the_tune_command_runs_each_trial_on_every_seed_of_seeds(tmp_path):
    args = ["tune", "--trials", "1", "-a", "fedprox", "-o", str(tmp_path), "--name", "tu", *TINY_ARGS]
    result = runner.invoke(app, [*args, "--seeds", "100,101"])
    assert result.exit_code == 0, result.output
    runs = sorted((tmp_path / "tu" / "trials" / "0").glob("s*/metrics.jsonl"))
    assert [r.parent.name for r in runs] == ["s100", "s101"]
    assert [json.loads(r.read_text().splitlines()[-1])["round"] for r in runs] == [2, 2]
    summary = json.loads((tmp_path / "tu" / "tune.json").read_text())
    assert summary["budget"]["rounds_per_trial"] == 4  # two seeds of 2 rounds


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--seeds", "100,100"], "--seeds '100,100': give distinct seeds as a comma list"),
        (["--seeds", "100,101", "--seed", "3"], "--seed 3 and --seeds '100,101' both give the tuning seed"),
        (["--seeds", "100", "-s", "run.seed=3"], "-s run.seed=3 and --seeds '100' both give the tuning seed"),
    ],
)
def test_bad_tuning_seeds_are_one_line(extra, message):
    result = runner.invoke(app, ["tune", "--trials", "1", "-a", "fedprox", *TINY_ARGS, *extra])
    assert message in str(result.exception)


def test_a_best_value_at_the_edge_of_its_range_is_named_in_tune_md_and_marked_in_the_comparison():
    from fedhet.tuning.compare import EDGE_NOTE, VariantTune, tuning_rows
    from fedhet.tuning.tuner import TuneResult, result_markdown

    budget = {"trials": 16, "complete": 10, "pruned": 6, "failed": 0, "rounds_per_trial": 15}
    result = TuneResult(
        out_dir=Path("tu"), study_name="fedprox", storage="sqlite:///tu/study.db", metric="val_acc", reduce="last",
        direction="maximize", best_trial=3, best_value=0.6, best_params={"algorithm.mu": 0.0145, "train.lr": 0.00103},
        best_run_dir=Path("tu/trials/3"), budget={**budget, "rounds_run": 190, "rounds_nominal": 240},
        at_edge={"train.lr": "lower"},
    )  # fmt: skip
    assert result.to_json()["at_edge"] == {"train.lr": "lower"}
    assert "at the edge of its range: train.lr (lower); the best may lie outside it" in result_markdown(result)
    tuned = VariantTune(point="", variant="fedprox", out_dir=Path("tu"), space="train.lr", result=result)
    head, rows = tuning_rows([tuned], "val_acc")
    assert "algorithm.mu=0.0145, train.lr=0.00103 ⇤" in rows[0] and "⇤" in EDGE_NOTE

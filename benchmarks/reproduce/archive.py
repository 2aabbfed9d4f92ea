"""Keep the small result files of finished reproduction cells in the repository, so tables survive the run folders.

    python benchmarks/reproduce/archive.py RUNS_DIR DEST
    e.g. RUNS_DIR = runs/reproduce/fedacd-fmnist, DEST = benchmarks/reproduce/fedacd/results

Run folders live under runs/, which git ignores, and a new machine starts without them; a cell that took an hour
should not have to run again just to print a table. For every run folder under RUNS_DIR whose summary.json says
"finished", this copies config.json, metrics.jsonl, summary.json, provenance.json and, where dynamic sampling
wrote one, sampling.jsonl (a few kB; no checkpoints) to the same relative place under DEST. A cell already in DEST
is replaced only when the new copy has more rounds, and never when its config differs (that is a different
experiment: the script stops with the cell's name). The tables scripts read DEST beside RUNS_DIR.

``--partial`` also keeps cells that did not finish (stopped at a deadline, killed): their metrics.jsonl is a true
record up to its last round, which is what counts as their rounds; a table must then say each cell's round.

``--failed`` also keeps cells whose run failed (summary.json says why, failures.jsonl what the clients hit; their
metrics, if any, run to the last evaluation before the failure): a failure is a result too, e.g. DP noise that made
every client's model non-finite.

A tune's folder (``fedhet tune``, or ``tuning/<variant>`` of ``fedhet compare --tune``: one holding ``study.db``)
keeps its record of the search, ``study.db`` (Optuna's SQLite study: every trial's values, reports and state),
``tune.json`` and ``tune.md``, once its ``tune.json`` is written; its trial runs are left out unless ``--trials``
(they are the search, and the study holds what they reported). With ``--partial`` an unfinished tune keeps its
``study.db`` too (replacing an archived unfinished copy only when it has more finished trials, never a finished
tune's), and ``--restore`` copies it back: the tune's command then resumes the search where the study stopped (a
trial that was running is run again from its start, since its run folder stayed behind).

``--checkpoint-mb MB`` also keeps a cell's last checkpoint (``checkpoints/last.pt``) where it is at most MB and the
run folder holds nothing else a resume needs (no client states spilled to disk), so a later run on another
machine can extend the cell instead of running it again: ``archive.py --restore DEST RUNS_DIR`` copies every archived
cell that has one back under RUNS_DIR (never over a run folder already there), and rerunning the reproduction's
command with more rounds continues them (the resume warns that floats round differently on another machine).
Stop the runs before archiving: a cell is copied checkpoint first, so its metrics reach at least the checkpoint's
round, and the resume drops any later lines.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

FILES = ("config.json", "metrics.jsonl", "summary.json", "provenance.json", "sampling.jsonl", "failures.jsonl")
TUNE_FILES = ("study.db", "tune.json", "tune.md")


def tune_folders(root: Path) -> list[Path]:
    """The tunes under ``root`` (folders holding study.db), finished or not."""
    return sorted(db.parent for db in root.rglob("study.db"))


def in_tune(run: Path, root: Path) -> bool:
    return any((root / parent / "study.db").exists() for parent in run.relative_to(root).parents)


def finished_trials(db: Path) -> int:
    """Trials of an Optuna SQLite study that ended (COMPLETE, PRUNED or FAIL), read without Optuna."""
    import sqlite3

    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
        return con.execute("SELECT COUNT(*) FROM trials WHERE state IN ('COMPLETE', 'PRUNED', 'FAIL')").fetchone()[0]


def archive_tunes(root: Path, dest: Path, partial: bool = False) -> list[str]:
    """Copy each finished tune's study.db, tune.json and tune.md (a newer tune.json replaces the copy); with
    ``partial``, an unfinished tune's study.db too, where the archive holds no finished copy nor one as far."""
    copied = []
    for tune in tune_folders(root):
        if not (tune / "tune.json").exists():
            if partial and archive_unfinished_tune(tune, dest / tune.relative_to(root)):
                copied.append(f"{tune.relative_to(root)} (unfinished: {finished_trials(tune / 'study.db')} trials)")
            continue
        target = dest / tune.relative_to(root)
        if (target / "tune.json").exists() and (target / "tune.json").read_bytes() == (tune / "tune.json").read_bytes():
            continue
        copy_tune(tune, target)
        copied.append(str(tune.relative_to(root)))
    return copied


def copy_tune(tune: Path, target: Path) -> None:
    """The record files a tune folder holds, into ``target``."""
    target.mkdir(parents=True, exist_ok=True)
    for name in TUNE_FILES:
        if (tune / name).exists():
            shutil.copy2(tune / name, target / name)


def archive_unfinished_tune(tune: Path, target: Path) -> bool:
    if (target / "tune.json").exists() or not finished_trials(tune / "study.db"):  # finished there, or nothing yet
        return False
    if (target / "study.db").exists() and finished_trials(target / "study.db") >= finished_trials(tune / "study.db"):
        return False
    target.mkdir(parents=True, exist_ok=True)
    shutil.copy2(tune / "study.db", target / "study.db")
    return True


def finished_runs(root: Path, statuses: tuple[str, ...] = ("finished",)) -> list[Path]:
    runs = []
    for summary in sorted(root.rglob("summary.json")):
        if json.loads(summary.read_text()).get("status") in statuses:
            runs.append(summary.parent)
    return runs


def config_differences(archived: Path, run: Path) -> list[str]:
    """What makes the two cells different experiments: the settings a resume could not change (fedhet's own test,
    so another length, location, executor or a setting added since with its default is the same cell)."""
    from fedhet.engine.training import config_changes

    return config_changes(*(json.loads((p / "config.json").read_text()) for p in (archived, run)))


def logged_runs(root: Path) -> list[Path]:
    """Every run folder with metrics, finished or not."""
    return sorted(m.parent for m in root.rglob("metrics.jsonl") if (m.parent / "config.json").exists())


def rounds_done(run: Path) -> int:
    """The last round the run's metrics logged (a killed run has no summary to ask)."""
    metrics = run / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.exists() else []  # a run that failed before evaluating
    return int(json.loads(lines[-1])["round"]) if lines else 0


def resumable_checkpoint(run: Path, limit_mb: float) -> Path | None:
    """The run's last checkpoint, where it alone (with the result files) lets the run resume and is small enough."""
    checkpoint = run / "checkpoints" / "last.pt"
    spilled = any(p.is_dir() and p.name != "checkpoints" for p in run.iterdir())  # e.g. client states on disk
    if not checkpoint.exists() or spilled or checkpoint.stat().st_size > limit_mb * 2**20:
        return None
    return checkpoint


def archive(
    root: Path,
    dest: Path,
    partial: bool = False,
    checkpoint_mb: float = 0.0,
    failed: bool = False,
    trials: bool = False,
) -> list[str]:
    copied = archive_tunes(root, dest, partial)
    runs = set(logged_runs(root) if partial else finished_runs(root))
    if failed:
        runs |= set(finished_runs(root, ("failed",)))
    if not trials:
        runs = {run for run in runs if not in_tune(run, root)}
    for run in sorted(runs):
        target = dest / run.relative_to(root)
        if (target / "config.json").exists():
            changes = config_differences(target, run)
            if changes:
                raise SystemExit(f"{target}: archived with another config ({'; '.join(changes)}); move it away first")
            if rounds_done(target) >= rounds_done(run):
                continue
        target.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(target / "checkpoints", ignore_errors=True)  # an older copy's checkpoint no longer matches
        checkpoint = resumable_checkpoint(run, checkpoint_mb) if checkpoint_mb > 0 else None
        if checkpoint is not None:  # before the metrics, which then reach at least its round
            (target / "checkpoints").mkdir()
            shutil.copy2(checkpoint, target / "checkpoints" / checkpoint.name)
        for name in FILES:
            if (run / name).exists():
                shutil.copy2(run / name, target / name)
            else:  # a partial copy replacing a shorter one must not keep the old copy's summary
                (target / name).unlink(missing_ok=True)
        copied.append(str(run.relative_to(root)))
    return copied


def restore(dest: Path, root: Path) -> tuple[list[str], list[str]]:
    """Copy every archived cell with a checkpoint and every archived tune back under ``root``; returns (restored,
    left alone as present)."""
    restored, present = [], []
    for tune in tune_folders(dest):
        target = root / tune.relative_to(dest)
        if (target / "study.db").exists():  # a study there may hold more trials than the archive's
            present.append(str(tune.relative_to(dest)))
            continue
        copy_tune(tune, target)
        restored.append(str(tune.relative_to(dest)))
    for checkpoint in sorted(dest.rglob("checkpoints/last.pt")):
        cell = checkpoint.parent.parent
        target = root / cell.relative_to(dest)
        if target.exists():  # a run folder is never replaced: it may hold newer rounds than the archive
            present.append(str(cell.relative_to(dest)))
            continue
        shutil.copytree(cell, target)
        restored.append(str(cell.relative_to(dest)))
    return restored, present


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="the runs folder (with --restore: the archive)")
    parser.add_argument("dest", type=Path, help="the archive (with --restore: the runs folder)")
    parser.add_argument("--partial", action="store_true", help="also keep cells and tunes that did not finish")
    parser.add_argument("--failed", action="store_true", help="also keep cells whose run failed (and why)")
    parser.add_argument("--checkpoint-mb", type=float, default=0.0, help="also keep last checkpoints up to this size")
    parser.add_argument(
        "--restore", action="store_true", help="copy archived tunes and cells with a checkpoint back to runs"
    )
    parser.add_argument("--trials", action="store_true", help="also keep the trial runs of tunes")
    args = parser.parse_args()
    if args.restore:
        restored, present = restore(args.root, args.dest)
        print(f"restored {len(restored)} cell(s) into {args.dest}" + "".join(f"\n  {c}" for c in restored))
        if present:
            print("left alone (a run folder is already there):" + "".join(f"\n  {c}" for c in present))
        return
    copied = archive(args.root, args.dest, args.partial, args.checkpoint_mb, args.failed, args.trials)
    print(f"archived {len(copied)} cell(s) and tune(s) into {args.dest}" + "".join(f"\n  {c}" for c in copied))


if __name__ == "__main__":
    main()

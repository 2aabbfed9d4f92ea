"""A run's folder through its life: prepared fresh, replaced (--overwrite) or resumed from its newest usable
checkpoint; the files checked at resume (config, metrics.jsonl against the checkpoint's copy, provenance.json); the
logs appended while it trains; summary.json at the end; and the one-line message when the disk is full.

The round loop (``engine/simulation.py``) owns what goes into a checkpoint; this module owns the files around it."""

from __future__ import annotations

import errno
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock

from fedhet import plugins
from fedhet.components import plugins_in_use
from fedhet.config import Config, read_saved_config
from fedhet.engine.checkpoint import CheckpointError, Loaded, load_latest, remove_temporaries
from fedhet.engine.rundir import (
    check_removable,
    check_run_flags,
    environment_changes,
    holds_run,
    lock_run_dir,
    make_out_dir,
    remove_run_dir,
)
from fedhet.engine.training import RESUMABLE_CHANGES, config_changes
from fedhet.errors import ConfigError, CorruptFile, DiskFull
from fedhet.results.store import (
    MetricsLog,
    read_json,
    read_metrics,
    to_json,
    truncate_after,
    write_json_atomic,
    write_text_atomic,
)


@dataclass
class Checks:
    """What a checkpoint must pass before a resume takes it up, beyond the folder's own checks; neither changes
    anything. ``check(state)`` raises ``ConfigError`` for one this run cannot continue (another trace file, other
    data); ``verify(state)`` raises the ``CheckpointError`` that taking it up would (its client states are gone)."""

    check: Callable[[dict[str, Any]], None] | None = None
    verify: Callable[[dict[str, Any]], None] | None = None


# errnos of a write that failed for want of space: the run stops with DiskFull and resumes once space is freed
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
LOGS = ("metrics.jsonl", "failures.jsonl", "sampling.jsonl", "clients.jsonl")


class RunFolder:
    """``path`` = run.out_dir / name. ``flags`` words how the user continues or replaces a run (fedhet's flags, or
    Flower's run config); ``warn`` prints one warning line."""

    def __init__(
        self, path: Path, cfg: Config, resolved: dict[str, Any], warn: Callable[[str], None], flags: dict[str, str]
    ) -> None:
        self.path, self.cfg, self.resolved, self.warn, self.flags = path, cfg, resolved, warn, flags
        self.metrics_lines: list[str] = []  # metrics.jsonl as written, kept in the checkpoint to check it at resume
        self.metrics_log: MetricsLog | None = None
        self.failures_log: MetricsLog | None = None
        self.clients_log: MetricsLog | None = None  # clients.jsonl: each round's sampled clients
        self.lock: FileLock | None = None
        self._said: set[str] = set()  # warnings given: a torn log line is met by every read of the file

    @property
    def checkpoint_dir(self) -> Path:
        return self.path / "checkpoints"

    # ------------------------------------------------------------------ before training
    def prepare(
        self, resume: bool, overwrite: bool, load: Callable[[dict[str, Any]], None], checks: Checks | None = None
    ) -> Loaded | None:
        """Set up the folder. Returns the checkpoint a resume continues from (``load``, which refuses changing
        nothing, has restored its client-held state), or None for a run that starts from round 0. ``checks``: what
        else a checkpoint must pass, changing nothing (``check``: ConfigError; ``verify``: what ``load`` would
        raise), besides the config and round checks here."""
        check_run_flags(resume, overwrite)
        make_out_dir(Path(self.cfg.run.out_dir))
        existed = self.path.is_dir()
        # before the lock file goes in: a folder whose config.json is not a fedhet run's is left as it was
        saved = self.saved_config() if resume and existed else None
        if overwrite and self.path.exists():
            check_removable(self.path)  # before the lock file goes into a folder that is not ours
        self.lock = lock_run_dir(self.path)  # released by unlock(), or by the OS when this process ends
        if overwrite and existed:
            remove_run_dir(self.path)
        if resume and existed:
            self.check_plugins()
            loaded = self.load_checkpoint(load, checks or Checks())
            if loaded is not None:
                self.restore_metrics(loaded.state)
                for log in LOGS[1:]:
                    truncate_after(self.path / log, loaded.state["round"], self.warn_once)
                write_json_atomic(self.path / "config.json", self.resolved)  # e.g. run.rounds raised to extend it
                return loaded
            self.check_nothing_lost(saved)
            for log in LOGS:  # crashed before its first checkpoint: start over
                truncate_after(self.path / log, 0, self.warn_once)
        elif holds_run(self.path):
            raise ConfigError(
                f"run folder {str(self.path)!r} already holds a run; pass {self.flags['resume']} to continue "
                f"it, {self.flags['overwrite']} to replace it, or choose another run.name"
            )
        self.path.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.path / "config.json", self.resolved)
        return None

    def warn_once(self, text: str) -> None:
        if text not in self._said:
            self._said.add(text)
            self.warn(text)

    def unlock(self) -> None:
        """Let another process train this run folder (the end of a run, however it ended)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def check_plugins(self) -> None:
        """Refuse to resume under plug-in code that differs from what the run recorded in provenance.json (one
        line naming the file), unless --accept-changed-plugins; accepted, the change is a warning."""
        diffs = plugins.check_unchanged(plugins.saved_fingerprints(self.path), plugins_in_use(self.cfg), self.path)
        if diffs:
            self.warn(
                f"continuing under changed plug-in code ({'; '.join(diffs)}, accepted): the rounds before and after "
                "this resume ran different code"
            )

    def load_checkpoint(self, load: Callable[[dict[str, Any]], None], checks: Checks) -> Loaded | None:
        """The newest usable checkpoint, ``load`` applied to it; None when the folder has none."""
        for folder in (self.path, self.checkpoint_dir):
            remove_temporaries(folder)

        def check(state: dict[str, Any]) -> None:  # changes nothing
            self.check_resumable(state)
            if checks.check is not None:
                checks.check(state)

        loaded, problems = load_latest(self.checkpoint_dir, load, check=check, verify=checks.verify)
        if loaded is None:
            if problems:
                raise CheckpointError(
                    f"cannot resume {self.path}: no usable checkpoint ({'; '.join(problems)}); "
                    f"start again with {self.flags['overwrite']} (this deletes the run folder)"
                )
            return None
        if problems:
            self.warn(f"{'; '.join(problems)}: resuming from the previous checkpoint, round {loaded.state['round']}")
        return loaded

    def check_resumable(self, state: dict[str, Any]) -> None:
        changed = config_changes(state["config"], self.resolved)
        if changed:
            raise ConfigError(
                f"cannot resume {self.path}: its config differs from this one in {', '.join(changed)}; "
                f"use a new run name or {self.flags['overwrite']} (only {', '.join(RESUMABLE_CHANGES)} may change)"
            )
        if state["round"] > self.cfg.run.rounds:
            raise ConfigError(
                f"cannot resume {self.path} with run.rounds={self.cfg.run.rounds}: it has already trained "
                f"{state['round']} rounds; a run can be extended, not shortened (give -r {state['round']} or more, "
                "or train fewer rounds under a new run name)"
            )

    def restore_metrics(self, state: dict[str, Any]) -> None:
        """metrics.jsonl up to the checkpoint's round, checked against the records the checkpoint holds: a file
        deleted, emptied, cut short or edited is rebuilt from them, with a warning, so the finished file covers every
        round."""
        done, saved, path = state["round"], state.get("metrics_log"), self.path / "metrics.jsonl"
        try:
            kept = [r for r in read_metrics(path, self.warn_once) if r.get("round", 0) <= done]
        except CorruptFile:
            kept = None
        if saved is None:  # a checkpoint from before fedhet kept the records: trust the file, as then
            truncate_after(path, done, self.warn_once)
            self.metrics_lines = [to_json(r) + "\n" for r in read_metrics(path, self.warn_once)]
            return
        self.metrics_lines = saved.splitlines(keepends=True)
        want = [json.loads(line) for line in self.metrics_lines]
        if kept == want:
            truncate_after(path, done, self.warn_once)
            return
        if not path.exists():
            why = "is missing"
        elif kept is None:
            why = "is corrupt"
        elif len(kept) != len(want):
            why = f"holds {len(kept)} record(s) up to round {done} where the checkpoint has {len(want)}"
        else:
            why = "differs from the records in the checkpoint"
        self.warn(f"{path} {why}: rebuilt from the checkpoint's {len(want)} record(s) up to round {done}")
        write_text_atomic(path, saved)

    def saved_config(self) -> dict[str, Any] | None:
        """The folder's config.json (``read_saved_config`` refuses one that is not a fedhet run's), or None."""
        saved = self.path / "config.json"
        return read_saved_config(saved) if saved.exists() else None

    def check_nothing_lost(self, saved: dict[str, Any] | None) -> None:
        """Refuse to start over a run whose checkpoints are gone although it trained past the first one (``saved``:
        the folder's config.json, whose checkpoint interval the run used)."""
        records = read_metrics(self.path / "metrics.jsonl", self.warn_once)
        every = saved["run"].get("checkpoint_every") if saved else None
        if not isinstance(every, int) or isinstance(every, bool):
            every = self.cfg.run.checkpoint_every
        last = max((r["round"] for r in records), default=0)
        if last > every:
            raise CheckpointError(
                f"cannot resume {self.path}: metrics.jsonl goes to round {last} but checkpoints/ holds no "
                f"checkpoint (deleted?), so nothing can continue it; start again with {self.flags['overwrite']} "
                "(this deletes the run folder) or use a new run name"
            )

    def record_environment(
        self, resumed_at: int | None, now: dict[str, Any], data: dict[str, Any], rounding: list[str]
    ) -> None:
        """provenance.json: what ran (``now``: versions, machine, thread count; ``data``: its source and hash; the
        code: fedhet's version and commit, each plug-in's SHA-256, ``plugins.provenance``), and every resume (with
        the code it resumed under; the top-level ``plugins`` stay as first recorded).

        A resume warns once, naming every change since the checkpoint that alters float rounding (``rounding``: those
        the checkpoint shows, e.g. another thread count)."""
        path = self.path / "provenance.json"
        moved: list[str] = []
        info = self.read_provenance(path) if resumed_at is not None else None
        code = plugins.provenance(self.cfg.run.plugins)  # {"fedhet_code": ..., "plugins": ...}
        if info is None:
            info = {**now, **code, "data": data, "resumes": []}
            if resumed_at is not None:
                info["rewritten_at_round"] = resumed_at  # what ran before this resume is not known
        else:
            last = (info["resumes"] or [info])[-1]  # where the run trained until now
            moved = [f"it continues on {change}" for change in environment_changes(last, now)]
            info["resumes"].append({"round": resumed_at, **now, **code})
        changes = rounding + moved
        if changes:
            self.warn(
                f"this run resumes, but {'; '.join(changes)}: floats round differently now, so it will not match an "
                "uninterrupted run bit for bit"
            )
        write_json_atomic(path, info)

    def read_provenance(self, path: Path) -> dict[str, Any] | None:
        """provenance.json as the run wrote it, or None (with a warning: it is rewritten) when it is damaged."""
        if not path.exists():
            self.warn(f"{path} is missing; rewritten with this machine's environment")
            return None
        try:
            info = read_json(path, dict)
            resumes = info.get("resumes", [])
            if isinstance(resumes, list) and all(isinstance(r, dict) for r in resumes):
                return {**info, "resumes": resumes}
            why = f"{path}: 'resumes' is not a list of records"
        except CorruptFile as err:
            why = str(err)
        self.warn(f"{why}; rewritten with this machine's environment (what it recorded of earlier resumes is lost)")
        return None

    # ------------------------------------------------------------------ while and after training
    def open_logs(self) -> None:
        self.metrics_log = MetricsLog(self.path / "metrics.jsonl", self.warn_once)
        self.failures_log = MetricsLog(self.path / "failures.jsonl", self.warn_once)
        self.clients_log = MetricsLog(self.path / "clients.jsonl", self.warn_once)

    def log_clients(self, record: dict[str, Any]) -> None:
        """A round's line of clients.jsonl (cut back to the checkpoint's round on resume, so each round has one)."""
        self.clients_log.append(record)

    def log_metrics(self, record: dict[str, Any]) -> None:
        self.metrics_lines.append(self.metrics_log.append(record))

    @property
    def metrics_text(self) -> str:
        return "".join(self.metrics_lines)

    def write_summary(self, last: int, wall: float, extra: dict[str, Any], warnings: list[str], **status: Any):
        """summary.json: status (``status``/``error`` when given; else finished or stopped), rounds done, the final
        record and best accuracy, ``extra`` (e.g. empty_rounds) and the run's warnings."""
        records = read_metrics(self.path / "metrics.jsonl")
        accs = [r["test_acc"] for r in records if r.get("test_acc") is not None]
        cfg = self.cfg
        summary = {
            "name": self.path.name,
            "status": status.get("status") or ("finished" if last >= cfg.run.rounds else "stopped"),
            "rounds_done": last,
            "algorithm": cfg.algorithm.name,
            "dataset": cfg.dataset.name,
            "partition": cfg.partition.name,
            "seed": cfg.run.seed,
            "final": records[-1] if records else {},
            "best_test_acc": max(accs) if accs else None,
            **extra,
            "wall_time_s": round(wall, 3),
        }
        if warnings:
            summary["warnings"] = warnings
        if status.get("error"):
            summary["error"] = status["error"]
        write_json_atomic(self.path / "summary.json", summary)
        return summary

    def disk_full(self, err: OSError, at: int | str | None, saved_round: int) -> DiskFull:
        """The one-line error for a file that could not be written: where, the last round safely checkpointed, and
        that ``fedhet resume`` continues once there is space."""
        where = f" writing {err.filename}" if err.filename else f" under {self.path}"
        at = f" in round {at}" if isinstance(at, int) else f" {at or 'while preparing the run folder'}"
        safe = f"round {saved_round} is safely checkpointed" if saved_round else "no round was checkpointed yet"
        return DiskFull(
            f"{err.strerror or 'cannot write'}{where}{at}: the run stopped; {safe}; free space and run "
            f"fedhet resume {self.path} to continue"
        )


def rounding_changes(state: dict[str, Any], threads: int, kind: str) -> list[str]:
    """How the clients train now unlike before the checkpoint ``state``, in ways that change only float rounding."""
    changes = []
    before = state.get("torch_threads")
    if before is not None and before != threads:
        changes.append(
            f"its clients trained with {before} torch thread(s) and now train with {threads} (match "
            f"it with --threads {before} on fedhet run, resume and compare, or OMP_NUM_THREADS={before}; "
            "run.workers >= 2 trains with one)"
        )
    was = state.get("executor_kind")
    if was is not None and was != kind:
        changes.append(f"its clients trained {was} and now train {kind}")
    return changes


def record_accepted_plugins(folder: Path, cfg: Config) -> None:
    """Plug-in code accepted (--accept-changed-plugins) for a finished run that does not train again (compare skips
    the cell): provenance.json records it, so the next rerun without the flag compares with it and goes on."""
    path = folder / "provenance.json"
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # nothing readable recorded: nothing to refuse later either
    if not isinstance(info, dict):
        return
    resumes = info.get("resumes")
    done = len(resumes) if isinstance(resumes, list) else 0
    info[plugins.ACCEPTED_KEY] = {"after_resumes": done, "plugins": plugins.fingerprints(cfg.run.plugins)}
    write_json_atomic(path, info)

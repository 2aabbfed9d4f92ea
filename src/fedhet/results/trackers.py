"""Optional experiment trackers: TensorBoard, MLflow and Weights & Biases receive a copy of what a run folder gets.

Each is off by default and switched on in the config's ``[tracking]`` section; its package (the ``trackers`` extra)
is imported only then. The run folder stays the record of truth, so a tracker can neither change a run nor stop it:

- every call runs with the Python, NumPy and torch random states saved and restored, so a tracker that draws a
  random number (a generated run name, a retry jitter) cannot shift the run's sampling;
- a tracker that raises is switched off for the rest of the run with one warning; the run goes on.

Resume: the ids of the tracker runs are kept in ``<run folder>/trackers.json``, and a resumed run continues them.

- TensorBoard writes to ``<run folder>/tensorboard`` again with ``purge_step`` = the first round to retrain, so
  the events a killed run wrote after its last checkpoint are dropped when TensorBoard reads the folder.
- MLflow reopens the same run (same run id) in the same store (its URI is kept in ``trackers.json`` too). MLflow keeps
  every value logged for a step, so rounds retrained after a kill appear twice in a metric's history, with equal
  values (a resumed run is bit-exact).

MLflow's store is by default MLflow's SQLite backend, ``sqlite:///<run.out_dir>/mlflow.db``, with the artifacts
(config.json, summary.json) in ``<run.out_dir>/mlartifacts``: MLflow 2 and 3 read it as it is (``mlflow ui
--backend-store-uri sqlite:///runs/mlflow.db``, ``MlflowClient("sqlite:///runs/mlflow.db")``), where MLflow 3 reads
the older file store only with ``MLFLOW_ALLOW_FILE_STORE=true``. The runs of a comparison write one database from
several processes, so every MLflow call on a SQLite store holds a lock file beside it (``mlflow.db.lock``).
- W&B resumes the run id (``resume="allow"``). In offline mode each process writes its own ``offline-run-*``
  folder under the same id; ``wandb sync`` merges them into one run. Metrics are logged against ``round``
  (``define_metric``), not W&B's own step counter, so a retrained round lands at its round again.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedhet.paths import MLFLOW_ARTIFACTS, MLFLOW_DB, sqlite_path
from fedhet.results.store import read_json, to_json, write_json_atomic

# config flag -> (module imported, package to install)
PACKAGES = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "mlflow": ("mlflow", "mlflow-skinny"),
    "wandb": ("wandb", "wandb"),
}
STATE_FILE = "trackers.json"


def check_installed(flag: str) -> None:
    """A one-line config error when the package a switched-on tracker needs is missing."""
    module, package = PACKAGES[flag]
    if importlib.util.find_spec(module) is None:
        raise ValueError(
            f"needs the {package} package, which is not installed; install the trackers extra: "
            "pip install 'fedhet[trackers]'"
        )


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numeric entries of a metrics record (round excluded), as floats; None, NaN and non-numbers are left out."""
    out = {}
    for key, value in record.items():
        if key == "round" or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if value == value and abs(value) != float("inf"):
            out[key] = float(value)
    return out


def flat_config(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flat_config(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


@contextmanager
def preserved_rng() -> Iterator[None]:
    """Whatever runs inside leaves the global random states as it found them."""
    py, npy, tch = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)
        torch.set_rng_state(tch)


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, run_dir: Path, resumed_at: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step drops the events of rounds a killed run logged after its last checkpoint (all of them when it
        # was killed before its first one and starts over)
        self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=resumed_at + 1)
        self.resumed = resumed_at > 0

    def start(self, config: dict[str, Any]) -> None:
        if not self.resumed:
            self.writer.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```", global_step=0)

    def log(self, record: dict[str, Any]) -> None:
        for key, value in scalars(record).items():
            self.writer.add_scalar(key, value, global_step=record["round"])
        self.writer.flush()

    def finish(self, summary: dict[str, Any]) -> None:
        text = "```\n" + json.dumps(summary, indent=2, default=str) + "\n```"
        self.writer.add_text("summary", text, global_step=summary["rounds_done"])
        self.close()

    def close(self) -> None:
        self.writer.close()


def default_mlflow_uri(out_dir: Path) -> str:
    """The MLflow store a run writes to unless ``tracking.mlflow_uri`` names one: SQLite in ``run.out_dir``."""
    return "sqlite:///" + str((out_dir / MLFLOW_DB).resolve())


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` for the processes of one machine (none where fcntl is missing: Windows)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextmanager
def quiet_loggers(*names: str) -> Iterator[None]:
    """MLflow's and alembic's INFO lines while a SQLite store is created ("Creating initial MLflow database
    tables..."), kept out of the run's output."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(max(logger.getEffectiveLevel(), logging.WARNING))
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


class MLflowTracker:
    name = "mlflow"

    def __init__(self, uri: str, experiment: str, run_name: str, run_id: str | None) -> None:
        from mlflow.tracking import MlflowClient

        if uri.startswith("file:"):
            # MLflow 3.x reads and writes the local file store only on request; a user's own setting of the
            # variable wins. fedhet's default store is SQLite, which needs nothing.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.uri = uri
        database = sqlite_path(uri)
        self.lock_file = database.with_name(database.name + ".lock") if database is not None else None
        # a SQLite store's runs keep their artifacts beside the database, not in ./mlruns of whatever folder the run
        # was started from
        self.artifacts = (database.parent / MLFLOW_ARTIFACTS).resolve().as_uri() if database is not None else None
        with self.locked(), quiet_loggers("mlflow", "alembic"):
            if database is not None:
                database.parent.mkdir(parents=True, exist_ok=True)
            self.client = MlflowClient(tracking_uri=uri)
            if run_id is not None:
                self.run_id = run_id
                self.client.update_run(run_id, status="RUNNING")
                self.resumed = True
                return
            self.run_id = self.client.create_run(self.experiment_id(experiment), run_name=run_name).info.run_id
        self.resumed = False

    def locked(self):
        """The store's lock (a SQLite store that several processes of a comparison write), else nothing."""
        return file_lock(self.lock_file) if self.lock_file is not None else nullcontext()

    def experiment_id(self, name: str) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        try:
            return self.client.create_experiment(name, artifact_location=self.artifacts)
        except Exception:  # compare cells in parallel processes: another one created it first
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return found.experiment_id

    def start(self, config: dict[str, Any]) -> None:
        from mlflow.entities import Param

        with self.locked():
            self.client.log_dict(self.run_id, config, "config.json")  # replaced on resume: run.rounds may have grown
            if not self.resumed:  # MLflow params cannot change once logged
                params = [
                    Param(k, json.dumps(v) if not isinstance(v, str) else v) for k, v in flat_config(config).items()
                ]
                self.client.log_batch(self.run_id, params=params)

    def log(self, record: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, record["round"]) for k, v in scalars(record).items()]
        with self.locked():
            self.client.log_batch(self.run_id, metrics=metrics)

    def finish(self, summary: dict[str, Any]) -> None:
        with self.locked():
            self.client.log_dict(self.run_id, json.loads(to_json(summary)), "summary.json")
            for key in ("status", "rounds_done"):
                self.client.set_tag(self.run_id, f"fedhet.{key}", str(summary[key]))
            self.client.set_terminated(self.run_id, status="FAILED" if summary["status"] == "failed" else "FINISHED")

    def close(self) -> None:
        with self.locked():
            self.client.set_terminated(self.run_id, status="KILLED")


class WandbTracker:
    name = "wandb"

    def __init__(self, folder: Path, project: str, run_name: str, run_id: str | None, mode: str) -> None:
        import wandb

        folder.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(silent=True, console="off", x_disable_stats=True, x_disable_meta=True)
        self.run = wandb.init(
            project=project,
            name=run_name,
            id=run_id,
            resume="allow",
            mode=mode,
            dir=str(folder),
            settings=settings,
            reinit="create_new",
        )
        self.run_id = self.run.id
        self.run.define_metric("round")
        self.run.define_metric("*", step_metric="round")

    def start(self, config: dict[str, Any]) -> None:
        self.run.config.update(config, allow_val_change=True)

    def log(self, record: dict[str, Any]) -> None:
        self.run.log({"round": record["round"], **scalars(record)})

    def finish(self, summary: dict[str, Any]) -> None:
        final = scalars(summary.get("final") or {})
        fields = {k: summary[k] for k in ("status", "rounds_done", "best_test_acc", "wall_time_s") if k in summary}
        self.run.summary.update({**fields, **{f"final/{k}": v for k, v in final.items()}})
        self.run.finish(exit_code=1 if summary["status"] == "failed" else 0)

    def close(self) -> None:
        self.run.finish(exit_code=1)


class Trackers:
    """The trackers a run's config switches on; ``Trackers(...).start() / log() / finish()`` around the run."""

    def __init__(self, tracking: Any, run_dir: Path, out_dir: Path, name: str, warn: Callable[[str], None]) -> None:
        self.tracking, self.run_dir, self.out_dir, self.name, self.warn = tracking, run_dir, out_dir, name, warn
        self.active: list[Any] = []

    def start(self, config: dict[str, Any], resumed_at: int) -> None:
        """Open (or, after a resume, reopen) each switched-on tracker and give it the resolved config."""
        t = self.tracking
        saved = self.saved_ids() if resumed_at else {}
        makers: list[tuple[str, Callable[[], Any]]] = []
        if t.tensorboard:
            makers.append(("tensorboard", lambda: TensorBoardTracker(self.run_dir, resumed_at)))
        if t.mlflow:
            uri = t.mlflow_uri or self.saved_mlflow_uri(saved) or default_mlflow_uri(self.out_dir)
            makers.append(("mlflow", lambda: MLflowTracker(uri, t.experiment, self.name, saved.get("mlflow"))))
        if t.wandb:
            folder = Path(t.wandb_dir) if t.wandb_dir else self.out_dir
            makers.append(
                ("wandb", lambda: WandbTracker(folder, t.experiment, self.name, saved.get("wandb"), t.wandb_mode))
            )
        for name, make in makers:
            made, tracker = self.call(name, make)
            if made and self.call(name, tracker.start, config)[0]:
                self.active.append(tracker)
        ids = {tr.name: tr.run_id for tr in self.active if hasattr(tr, "run_id")}
        for tracker in self.active:
            if isinstance(tracker, MLflowTracker):  # a resumed run reopens its MLflow run in the same store
                ids["mlflow_uri"] = tracker.uri
        if ids:
            write_json_atomic(self.run_dir / STATE_FILE, {**saved, **ids})

    def saved_ids(self) -> dict[str, str]:
        path = self.run_dir / STATE_FILE
        return read_json(path) if path.exists() else {}

    def saved_mlflow_uri(self, saved: dict[str, str]) -> str | None:
        """The store a resumed run's MLflow run is in: the one trackers.json names, or for a run from before fedhet
        wrote SQLite stores (an id but no URI), the file store it wrote then."""
        if "mlflow_uri" in saved:
            return saved["mlflow_uri"]
        if "mlflow" in saved:
            return (self.out_dir / "mlruns").resolve().as_uri()
        return None

    def log(self, record: dict[str, Any]) -> None:
        for tracker in list(self.active):
            self.call(tracker.name, tracker.log, record, tracker=tracker)

    def finish(self, summary: dict[str, Any]) -> None:
        for tracker in list(self.active):
            self.call(tracker.name, tracker.finish, summary, tracker=tracker)
        self.active = []

    def close(self) -> None:
        """The run stopped without a summary (Ctrl-C, an unexpected error): close what is open, marked as killed."""
        for tracker in list(self.active):
            self.call(tracker.name, tracker.close, tracker=tracker)
        self.active = []

    def call(self, name: str, fn: Callable[..., Any], *args: Any, tracker: Any = None) -> tuple[bool, Any]:
        """(True, ``fn(*args)``) run with the random states preserved; a failure switches the tracker off (False)."""
        try:
            with preserved_rng():
                return True, fn(*args)
        except Exception as err:  # a tracker must never stop a run: its record is the run folder
            if tracker in self.active:
                self.active.remove(tracker)
            self.warn(f"{name} tracker failed and is off for the rest of this run: {type(err).__name__}: {err}")
            return False, None

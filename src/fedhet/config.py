"""Run configuration: TOML file + dotted overrides -> one validated, fully resolved config.

Sections: ``run``, ``dataset``, ``partition``, ``model``, ``train``, ``algorithm``, ``server``. The component sections
(``dataset``, ``partition``, ``model``, ``algorithm``, ``server``) hold a ``name`` plus that component's own
parameters, which the component's registry entry validates; resolution fills every default in, so a run folder's
``config.json`` shows exactly what ran.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from fedhet.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunSection(_Strict):
    name: str | None = None  # default: derived from algorithm, dataset, partition and seed
    seed: int = 0
    rounds: int = Field(20, ge=1)
    out_dir: str = "runs"
    eval_every: int = Field(1, ge=1)
    checkpoint_every: int = Field(1, ge=1)
    ema: float = Field(0.9, ge=0.0, lt=1.0)  # FedRCL reports accuracy EMA with 0.9 (notes/fedrcl.md section 4)
    device: str = "cpu"
    eval_batch_size: int = Field(1024, ge=1)
    progress: bool = True
    # where client-held state lives: "auto" keeps it in memory until it passes the budget, then moves it to disk
    client_state: Literal["auto", "memory", "disk"] = "auto"
    client_state_budget_mb: float = Field(2048.0, gt=0.0)
    # stop (with an error) after this many rounds in a row in which every client failed
    max_empty_rounds: int = Field(3, ge=1)
    # how a phase's clients train: one after another, or several as one batched computation (engine/batched.py;
    # same results to float rounding); "auto" batches only where docs/performance.md measured it to pay off
    executor: Literal["auto", "sequential", "batched"] = "auto"

    @field_validator("name")
    @classmethod
    def _plain_folder_name(cls, name: str | None) -> str | None:
        # --overwrite deletes out_dir/name: a name with a path in it could reach outside the output folder
        if name is not None and (name in ("", ".", "..") or any(c in name for c in "/\\\0") or name != name.strip()):
            raise ValueError(f"must be a plain folder name (no '/', '\\', '.' or '..', no edge spaces); got {name!r}")
        return name


class TrainSection(_Strict):
    participation: float = Field(1.0, gt=0.0, le=1.0)  # fraction of clients per round
    clients_per_round: int | None = Field(None, ge=1)  # overrides participation when set
    local_epochs: float = Field(1.0, gt=0.0)
    local_steps: int | None = Field(None, ge=1)  # a fixed number of local steps, overrides local_epochs
    batch_size: int = Field(64, ge=1)
    lr: float = Field(0.01, gt=0.0)
    lr_decay: float = Field(1.0, gt=0.0, le=1.0)  # per-round multiplicative client lr decay (FedRCL: 0.998)
    momentum: float = Field(0.0, ge=0.0, lt=1.0)
    nesterov: bool = False
    weight_decay: float = Field(0.0, ge=0.0)
    grad_clip: float | None = Field(None, gt=0.0)  # max global gradient norm
    augment: Literal["none", "crop_flip", "crop_flip_rotate", "crop"] = "none"


class _Component(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str

    def params(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class DatasetSection(_Component):
    name: str = "fmnist"
    data_dir: str | None = None


class PartitionSection(_Component):
    name: str = "dirichlet"
    num_clients: int = Field(20, ge=1)
    seed: int | None = None  # default: run.seed
    local_test_fraction: float = Field(0.0, ge=0.0, lt=1.0)  # FedRANE 0.25, FedBC 0.2
    merge_test: bool = False  # partition train+test together (FedBC's power-law protocol)


class ModelSection(_Component):
    name: str = "cnn"


class AlgorithmSection(_Component):
    name: str = "fedavg"


class ServerSection(_Component):
    name: str = "sgd"  # server optimiser; "sgd" with lr 1 is plain averaging


class Config(_Strict):
    run: RunSection = RunSection()
    dataset: DatasetSection = DatasetSection()
    partition: PartitionSection = PartitionSection()
    model: ModelSection = ModelSection()
    train: TrainSection = TrainSection()
    algorithm: AlgorithmSection = AlgorithmSection()
    server: ServerSection = ServerSection()

    @model_validator(mode="after")
    def _check(self) -> Config:
        n = self.partition.num_clients
        if self.train.clients_per_round is not None and self.train.clients_per_round > n:
            raise ValueError(f"train.clients_per_round={self.train.clients_per_round} exceeds num_clients={n}")
        return self

    def clients_per_round(self) -> int:
        if self.train.clients_per_round is not None:
            return self.train.clients_per_round
        return max(1, round(self.train.participation * self.partition.num_clients))

    def default_name(self) -> str:
        return f"{self.algorithm.name}-{self.dataset.name}-{self.partition.name}-s{self.run.seed}"

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def format_validation_error(err: ValidationError, prefix: str = "") -> str:
    """One line per problem: 'train.lr: Input should be greater than 0 (got -1)'."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in (prefix, *e["loc"]) if p != "")
        if e["type"] == "extra_forbidden":
            lines.append(f"unknown key {loc!r}")
        else:
            got = f" (got {e['input']!r})" if not isinstance(e.get("input"), dict) else ""
            lines.append(f"{loc}: {e['msg']}{got}" if loc else f"{e['msg']}")
    return "; ".join(lines)


def _valid_keys_hint(err: ValidationError) -> str:
    """For an unknown key in a fixed section (run, train) or at the top level, list that section's keys."""
    unknown = [e["loc"] for e in err.errors() if e["type"] == "extra_forbidden"]
    if not unknown:
        return ""
    section = unknown[0][0] if len(unknown[0]) > 1 else None
    model = Config.model_fields[section].annotation if section else Config
    return f"; valid keys{' in [' + section + ']' if section else ''}: {', '.join(model.model_fields)}"


def parse_value(text: str) -> Any:
    """Parse an override value: numbers, booleans, lists and quoted strings as Python literals, else a string."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def apply_override(raw: dict[str, Any], assignment: str) -> None:
    if "=" not in assignment:
        raise ConfigError(f"override {assignment!r} must look like section.key=value")
    key, value = assignment.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) < 2:
        raise ConfigError(f"override key {key!r} must name a section, e.g. train.lr=0.05")
    node = raw
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {key!r}: {part!r} is not a section")
    node[parts[-1]] = parse_value(value)


def load_raw(path: str | Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        with p.open("rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"config file {str(p)!r} is not valid TOML: {err}") from None


def build_config(raw: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err) + _valid_keys_hint(err)) from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    raw = load_raw(path)
    raw.pop("compare", None)  # a comparison's variant list; `fedhet run` on such a file runs its base setting
    for item in overrides or []:
        apply_override(raw, item)
    return build_config(raw)


def saved_run_config(run_dir: str | Path, overrides: list[str] | None = None) -> Config:
    """The config a run folder was started with, placed where the folder is now (it may have been moved)."""
    folder = Path(run_dir)
    saved = folder / "config.json"
    if not saved.is_file():
        raise ConfigError(f"{str(folder)!r} is not a run folder: it has no config.json")
    try:
        raw = json.loads(saved.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{saved}: unreadable ({err})") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("run"), dict):
        raise ConfigError(f"{saved}: not a fedhet run config")
    raw["run"].update(out_dir=str(folder.resolve().parent), name=folder.resolve().name)
    for item in overrides or []:
        apply_override(raw, item)
    return build_config(raw)

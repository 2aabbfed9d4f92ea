"""A run's initial global model from existing weights: ``model.init`` (any fedhet model) or ``model.pretrained``
(the transformer models, ``models/backbones.py``).

``model.init`` is a fedhet run folder (its last checkpoint's global model, unflattened by the names and shapes the
checkpoint records), a fedhet checkpoint file, a ``.safetensors`` file, or a ``torch.save``'d state dict. The
weights are put into the model as built (before an algorithm adds its modules, so FedRoD's personal head copies the
loaded head): every parameter and floating buffer of it must be in the file with its shape, or one line names the
first that is not; tensors of the file the model lacks (an algorithm's extra modules) are left out, and said.
A head whose shape does not fit the dataset's classes is refused unless ``model.replace_head``: then the head stays
as built, drawn from the run seed. ``model.init`` wins over ``model.pretrained``, whose config still shapes the model.

The init file's SHA-256 goes to provenance.json and to every checkpoint; a resume whose init file changed is refused
(``check_resume``), as one whose data changed is.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from fedhet.engine.checkpoint import LAST, MAGIC, CheckpointError, read_checkpoint
from fedhet.errors import ConfigError

# the checkpoint's record of the init file (its SHA-256), and of the flat model's names and shapes
INIT_KEY = "init_sha256"
LAYOUT_KEY = "model_layout"
SHOWN = 3  # tensor names a message lists


@dataclass
class InitialWeights:
    """Tensors under the built model's names, where they came from, and what loading them left to say."""

    tensors: dict[str, Tensor]
    source: str  # "model.init '<path>'" or "model.pretrained '<id>'"
    sha256: str | None = None  # the init file's
    trained_head: bool = True  # the file has a head (a pretrained body alone has none)
    lenient: bool = False  # a pretrained checkpoint may lack tensors (a pooler): those keep their fresh weights
    notes: list[str] = field(default_factory=list)

    def record(self) -> dict[str, Any]:
        """provenance.json's ``initial_weights``."""
        out: dict[str, Any] = {"source": self.source, "notes": self.notes}
        if self.sha256 is not None:
            out["sha256"] = self.sha256
        return out


def initial_weights(model_name: str, params: dict[str, Any], init: str | None) -> InitialWeights | None:
    """What ``model.init`` or ``model.pretrained`` gives, read once; None when neither is set."""
    if init is not None:
        path = Path(init).expanduser()
        tensors, sha, detail = read_init(path)
        return InitialWeights(tensors, f"model.init {str(path)!r}{detail}", sha)
    pretrained = params.get("pretrained")
    if pretrained is None:
        return None
    from fedhet.models.backbones import pretrained_tensors
    from fedhet.models.hub import resolve_pretrained

    tensors, head = pretrained_tensors(model_name.lower(), pretrained)
    folder = str(resolve_pretrained(model_name.lower(), pretrained))
    where = f" ({folder})" if folder != pretrained else ""
    return InitialWeights(tensors, f"model.pretrained {pretrained!r}{where}", trained_head=head, lenient=True)


# ---------------------------------------------------------------------------------------------- reading a file
def read_init(path: Path) -> tuple[dict[str, Tensor], str, str]:
    """The named tensors ``path`` holds, the SHA-256 of the file read (a run folder's: its last checkpoint) and what
    the tensors are, for messages (a checkpoint's round)."""
    what = f"model.init {str(path)!r}"
    if path.is_dir():
        if not (path / "checkpoints" / LAST).is_file():
            raise ConfigError(
                f"{what} is a folder without a fedhet run's checkpoint (checkpoints/{LAST}); give a run folder, a "
                "checkpoint, a .safetensors file or a torch state dict"
            )
        path = path / "checkpoints" / LAST
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ConfigError(f"{what} cannot be read: {err.strerror or err}") from None
    sha = hashlib.sha256(data).hexdigest()
    if data.startswith(MAGIC):
        tensors, rnd = checkpoint_tensors(path, what)
        return tensors, sha, f" (the global model after round {rnd})"
    if path.suffix == ".safetensors":
        return safetensors_tensors(data, what), sha, ""
    return state_dict_tensors(data, what), sha, ""


def checkpoint_tensors(path: Path, what: str) -> tuple[dict[str, Tensor], int]:
    """The global model of a fedhet checkpoint, under the names its layout records."""
    try:
        state = read_checkpoint(path)
    except CheckpointError as err:
        raise ConfigError(f"{what}: {err}") from None
    layout = state.get(LAYOUT_KEY)
    if layout is None:
        raise ConfigError(
            f"{what}: {path} records no names of its model's tensors (an older fedhet wrote it), so its global model "
            "cannot be matched to this one; resume that run with this fedhet for a round to record them"
        )
    algo = state["algo"]
    out = unflatten(algo["global_params"], layout["params"])
    if algo.get("global_buffers") is not None:
        out.update(unflatten(algo["global_buffers"], layout["buffers"]))
    return out, state["round"]


def unflatten(vector: Tensor, layout: list) -> dict[str, Tensor]:
    out, offset = {}, 0
    for name, shape in layout:
        n = int(torch.Size(shape).numel())
        out[name] = vector[offset : offset + n].view(*shape).clone()
        offset += n
    return out


def model_layout(flat) -> dict[str, list]:
    """The checkpoint's ``model_layout``: the flat vectors' tensors, in order, by name and shape (``FlatModel``)."""
    params = dict(flat.model.named_parameters())
    buffers = dict(flat.model.named_buffers())
    return {
        "params": [[name, list(params[name].shape)] for name in flat.slices()],
        "buffers": [[name, list(buffers[name].shape)] for name in flat.buffer_slices()],
    }


def safetensors_tensors(data: bytes, what: str) -> dict[str, Tensor]:
    try:
        from safetensors.torch import load
    except ImportError:
        raise ConfigError(
            f"{what} is a .safetensors file, which needs safetensors: pip install 'fedhet[pretrained]'"
        ) from None
    try:
        return load(data)
    except Exception as err:  # safetensors' errors have no common base
        raise ConfigError(f"{what} is not a readable .safetensors file ({type(err).__name__}: {err})") from None


def state_dict_tensors(data: bytes, what: str) -> dict[str, Tensor]:
    """A ``torch.save``'d state dict (or a dict holding one under "state_dict" or "model"), read without running
    code (``weights_only``)."""
    try:
        obj = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as err:  # a pickle that does not load as plain data: refuse, never execute it
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise ConfigError(
            f"{what} is not a fedhet run or checkpoint, a .safetensors file or a torch state dict ({first[:200]})"
        ) from None
    if isinstance(obj, dict):
        for key in ("state_dict", "model"):
            if isinstance(obj.get(key), dict):
                obj = obj[key]
                break
    if not isinstance(obj, dict) or not obj or not all(isinstance(v, Tensor) for v in obj.values()):
        raise ConfigError(f"{what} holds a {type(obj).__name__}, not a state dict (names -> tensors)")
    return dict(obj)


# ---------------------------------------------------------------------------------------------- loading
def trained_tensors(model: nn.Module) -> dict[str, Tensor]:
    """What a run trains and averages: the parameters and the floating buffers (not BatchNorm's step counter)."""
    out = dict(model.named_parameters())
    out.update({name: b for name, b in model.named_buffers() if b.is_floating_point()})
    return out


def load_into(model: nn.Module, weights: InitialWeights, replace_head: bool) -> list[str]:
    """Copy ``weights`` into ``model`` (as built); what is worth saying about it, or a ConfigError in one line naming
    the first of the model's tensors (in its order) that the weights do not give or give in another shape."""
    own = trained_tensors(model)
    missing = [k for k in own if k not in weights.tensors and not is_head(k)]
    if missing and not weights.lenient:
        raise ConfigError(architecture_problem(weights, own))
    fresh_head = replace_head or not weights.trained_head
    for name, target in own.items():
        value = weights.tensors.get(name)
        if is_head(name) and fresh_head:
            continue
        if is_head(name) and (value is None or value.shape != target.shape):
            raise ConfigError(head_problem(weights, name, value, target, model))
        if value is None:
            continue
        if value.shape != target.shape:
            raise ConfigError(
                f"{weights.source} does not fit model tensor {name!r}: its shape is {tuple(value.shape)}, the "
                f"model's {tuple(target.shape)}"
            )
        with torch.no_grad():
            target.copy_(value.to(target.dtype))
    return notes(weights, own, missing, replace_head, model)


def is_head(name: str) -> bool:
    return name.startswith("head.")


def architecture_problem(weights: InitialWeights, own: dict[str, Tensor]) -> str:
    lacking = [k for k in own if k not in weights.tensors]
    extra = [k for k in weights.tensors if k not in own]
    theirs = f"; it has {listed(extra)} instead" if extra else ""
    return (
        f"{weights.source} is another architecture than this model: it lacks {len(lacking)} of the model's "
        f"{len(own)} tensors ({listed(lacking)}){theirs}"
    )


def head_problem(weights: InitialWeights, name: str, value: Tensor | None, target: Tensor, model: nn.Module) -> str:
    """A head missing from the weights, or of another shape (other classes): refused unless model.replace_head."""
    fix = "set model.replace_head = true for a fresh head (drawn from the run seed)"
    if value is None:
        return f"{weights.source} has no {name!r} (the head); {fix}"
    classes = getattr(model, "num_classes", target.shape[0])
    return (
        f"{weights.source}'s head does not fit the dataset's {classes} classes ({name} is {tuple(value.shape)}, the "
        f"model's {tuple(target.shape)}); {fix}"
    )


def notes(
    weights: InitialWeights, own: dict[str, Tensor], missing: list[str], replace_head: bool, model: nn.Module
) -> list[str]:
    classes = getattr(model, "num_classes", "?")
    out = [f"the initial global model is {weights.source}"]
    if replace_head or not weights.trained_head:
        why = "model.replace_head" if replace_head else "it has no trained head"
        out.append(f"a fresh head for {classes} classes, drawn from the run seed ({why})")
    if missing:
        out.append(f"{len(missing)} tensors not in it keep their fresh weights ({listed(missing)})")
    unused = [k for k in weights.tensors if k not in own and not is_head(k)]
    if unused:
        out.append(f"{len(unused)} of its tensors are not in this model and are left out ({listed(unused)})")
    return out


def listed(names: list[str]) -> str:
    more = f", ... ({len(names) - SHOWN} more)" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more


def check_resume(state: dict[str, Any], weights: InitialWeights | None) -> None:
    """Refuse (changing nothing) a resume whose model.init file is not the one the run started from."""
    before = state.get(INIT_KEY)
    now = None if weights is None else weights.sha256
    if before is not None and now is not None and before != now:
        raise ConfigError(
            f"{weights.source} has changed since the run was checkpointed (sha256 {before[:12]}..., now "
            f"{now[:12]}...): the rounds before started from another model; put the original file back or start a "
            "new run"
        )

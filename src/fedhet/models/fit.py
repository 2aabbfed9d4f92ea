"""Which models take which datasets' inputs, and the model a config gets when it names none.

A dataset's input is known without loading it (``dataset_input``): images (channels, height, width), tabular
vectors, or sequences of character indices. A model fits a dataset when it is built for that input without error
(on PyTorch's meta device: no memory, no data), and sequence models (the LSTM, which embeds integer indices) take
sequences and nothing else. ``model.name`` defaults to the model ``fedhet list models`` shows as fitting the
dataset: the CNN for images large enough for it, the MLP for digits (8x8) and synthetic vectors, the LSTM for
Shakespeare, logistic regression for LEAF's Sent140 (bags of words, as LEAF's baseline); a dataset from a plug-in
keeps the historical default, the CNN. The resolved config (config.json) records the model chosen, so a run resumes
with it whatever the default becomes.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from fedhet.errors import ConfigError

# the model a config without model.name gets, for a dataset not listed in DATASET_MODELS (and before this table: all)
DEFAULT_MODEL = "cnn"
# datasets whose inputs the CNN cannot take: the model that fits them
DATASET_MODELS = {"digits": "mlp", "synthetic": "mlp", "shakespeare": "lstm", "leaf_sent140": "logreg"}
# datasets whose kind of input is a parameter, ``task``: the model that fits each kind (Hugging Face datasets; "auto"
# finds the kind only when the data are loaded, so it keeps the historical default)
BY_TASK = {"hf": {"image": "cnn", "text": "lstm", "tabular": "mlp"}}
# models that read sequences of integer indices (an embedding first), and only those
SEQUENCE_MODELS = frozenset({"lstm", "bert_tiny", "bert_base", "distilbert", "gpt_tiny", "gpt2"})

_IMAGES = {
    "mnist": (1, 28, 28),
    "fmnist": (1, 28, 28),
    "emnist": (1, 28, 28),
    "cifar10": (3, 32, 32),
    "cifar100": (3, 32, 32),
    "tinyimagenet": (3, 64, 64),
    "digits": (1, 8, 8),
    "leaf_femnist": (1, 28, 28),
}
# datasets whose input size is a parameter: (task, the parameter, its default); an image's is its side, in colour
_SIZED = {
    "synthetic": ("tabular", "dim", 60),
    "shakespeare": ("sequence", "seq_len", 80),
    "leaf_celeba": ("image", "image_size", 84),
    "leaf_sent140": ("tabular", "vocab_size", 5000),
}


def default_model(dataset: str, params: dict[str, Any] | None = None) -> str:
    """``model.name`` for a config that names none: one that fits ``dataset``'s input (with ``params``, the
    dataset's parameters, where they say what the input is)."""
    name = str(dataset).lower()
    if name in BY_TASK:
        return BY_TASK[name].get(str((params or {}).get("task", "auto")), DEFAULT_MODEL)
    return DATASET_MODELS.get(name, DEFAULT_MODEL)


def dataset_input(dataset: str, params: dict[str, Any] | None = None) -> tuple[str, tuple[int, ...]] | None:
    """(task, input shape) of a built-in dataset with these parameters ("image", "tabular" or "sequence", as its
    ``ArrayDataset.task``), or None for one fedhet does not know (a plug-in's)."""
    name, params = str(dataset).lower(), params or {}
    if name in BY_TASK and params.get("task") == "text":
        size = params.get("seq_len", 80)
        return ("sequence", (size,)) if isinstance(size, int) and not isinstance(size, bool) and size >= 1 else None
    if name in _IMAGES:
        return "image", _IMAGES[name]
    task, key, default = _SIZED.get(name, (None, None, None))
    if task is None:
        return None
    size = params.get(key, default)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        return None  # a bad parameter: the dataset's own check words it
    return task, (3, size, size) if task == "image" else (size,)


def datasets() -> list[str]:
    """The datasets whose input is known, in the order ``fedhet list datasets`` shows them."""
    return sorted([*_IMAGES, *_SIZED])


def why_not(model: str, task: str, shape: tuple[int, ...], params: dict[str, Any] | None = None) -> str | None:
    """Why ``model`` (with ``params``) cannot take inputs of ``task`` and ``shape``; None when it can."""
    key = json.dumps(params or {}, sort_keys=True, default=str)
    return _why_not(model.lower(), task, tuple(shape), key)


@functools.lru_cache(maxsize=1024)
def _why_not(model: str, task: str, shape: tuple[int, ...], params: str) -> str | None:
    if (task == "sequence") != (model in SEQUENCE_MODELS):
        if task == "sequence":
            return "its inputs are character indices, which only a sequence model reads"
        return f"it reads sequences of character indices, not {task} inputs"
    import torch

    from fedhet.models import MODELS, build_model

    entry = MODELS.get(model)
    check = getattr(entry.obj, "check_input", None)  # the transformer models: without importing transformers
    try:
        if check is not None:
            check(shape, MODELS.parse(model, json.loads(params))[1])
            return None
        with torch.device("meta"):  # shapes only: no memory is allocated, nothing is computed
            build_model(model, shape, 10, **json.loads(params))
    except ConfigError as err:
        return str(err)
    return None


def fitting_models(task: str, shape: tuple[int, ...], models: list[str] | None = None) -> list[str]:
    """The registered models (default parameters) that take inputs of ``task`` and ``shape``."""
    from fedhet.models import MODELS

    return [m for m in (models or MODELS.names()) if why_not(m, task, shape) is None]


def fits(model: str) -> list[str]:
    """The datasets whose inputs ``model`` (default parameters) takes: ``fedhet list models``' column."""
    out = []
    for name in datasets():
        found = dataset_input(name)
        if found is not None and why_not(model, *found) is None:
            out.append(name)
    return out


def misfit(model: str, model_params: dict[str, Any], dataset: str, dataset_params: dict[str, Any]) -> str | None:
    """One line when ``model`` cannot take ``dataset``'s input, naming the models that can; None when it can, or
    when either is not known here (a plug-in not loaded yet: the run's own build reports it)."""
    from fedhet.models import MODELS

    found = dataset_input(dataset, dataset_params)
    if found is None or model not in MODELS:
        return None
    task, shape = found
    try:
        MODELS.parse(model, model_params)
    except ConfigError:
        return None  # a bad parameter: the model's own check words it
    problem = why_not(model, task, shape, model_params) or vocabulary_problem(model, model_params, dataset_params)
    if problem is None:
        return None
    good = fitting_models(task, shape)
    name = MODELS.get(model).name
    problem = problem.removeprefix(f"model {name!r} ")
    if problem.startswith("cannot take inputs of shape"):  # the build's own words: "... (1, 8, 8): too small"
        problem = problem.split(": ", 1)[-1]
    return (
        f"model {name!r} cannot take the inputs of dataset {dataset!r} ({task}, shape {shape}): {problem}; "
        f"models that fit {dataset}: {', '.join(good) or 'none'} (fedhet list models; without model.name it gets "
        f"{default_model(dataset, dataset_params)!r})"
    )


def vocabulary_problem(model: str, model_params: dict[str, Any], dataset_params: dict[str, Any]) -> str | None:
    """Why a sequence model's embedding cannot take the token ids of a dataset with a ``vocab_size``; else None."""
    from fedhet.models import MODELS

    if dataset_params.get("tokenizer") or model_params.get("pretrained"):
        return None  # the vocabulary is a tokenizer's or a checkpoint's: checked on the data (engine/training.py)
    vocab = dataset_params.get("vocab_size", 80)
    params = MODELS.get(model).params
    if params is None or "vocab_size" not in params.model_fields or not isinstance(vocab, int):
        return None
    embedding = model_params.get("vocab_size", params.model_fields["vocab_size"].default)
    if embedding >= vocab:
        return None
    return f"its embedding takes {embedding} token ids, the dataset {vocab}: set model.vocab_size={vocab}"


def loaded_misfit(
    model: str, model_params: dict[str, Any], dataset: str, dataset_params: dict[str, Any], ds
) -> str | None:
    """One line when ``model`` cannot take the inputs of ``ds``, the dataset as loaded, whose kind of input the config
    could not know (a Hugging Face dataset with ``task = "auto"``), naming the settings that fix it; None when it
    can, or for any other dataset (a known input was checked with the config, by ``misfit``; a plug-in's inputs are
    left to its model)."""
    from fedhet.models import MODELS

    if model not in MODELS or str(dataset).lower() not in BY_TASK or dataset_input(dataset, dataset_params) is not None:
        return None
    task, shape = str(ds.task), tuple(ds.input_shape)
    try:
        problem = why_not(model, task, shape, model_params)
    except Exception:  # a plug-in model that cannot be built on the meta device: building it for real decides
        return None
    if problem is None:
        return None
    good = fitting_models(task, shape)
    kind = {"sequence": "text"}.get(task, task)
    by_task = BY_TASK.get(str(dataset).lower(), {})
    fixes = [f"-m {by_task.get(kind, good[0])}"] if good else []
    if kind in by_task:
        fixes.insert(0, f"-s dataset.task={kind} (its default model is {by_task[kind]!r})")
    name = MODELS.get(model).name
    return (
        f"model {name!r} cannot take the inputs of dataset {dataset!r} ({kind}, shape {shape}): "
        f"{problem.removeprefix(f'model {name!r} ')}; set {' or '.join(fixes) or 'a model that fits them'}"
        f" (models that fit: {', '.join(good) or 'none'})"
    )

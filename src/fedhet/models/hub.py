"""Where ``model.pretrained`` is: a local folder (``save_pretrained``'s), a ``.safetensors`` file beside its
``config.json``, or a hub id, taken from the Hugging Face cache (``HF_HOME``, ``HF_HUB_CACHE``) and downloaded only
where the hub answers. Offline without a cached copy: one line naming the model, the id and where it looked.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from fedhet.errors import ConfigError
from fedhet.hub import hub_endpoint, hub_problem, hub_reachable, looks_like_hub_id

# what a model's folder needs: the architecture, the weights, and the tokenizer when there is one
FILES = ["config.json", "*.safetensors", "*.bin", "*.json", "*.txt", "*.model"]


def resolve_pretrained(model: str, pretrained: str) -> Path:
    """The folder holding ``pretrained``'s config.json and weights, read once per process."""
    return _resolve(model, pretrained)


@functools.lru_cache(maxsize=16)
def _resolve(model: str, pretrained: str) -> Path:
    what = f"model {model!r}: model.pretrained {pretrained!r}"
    path = Path(pretrained).expanduser()
    if os.path.lexists(path):
        folder = path.parent if path.is_file() else path
        if path.is_file() and path.suffix != ".safetensors":
            raise ConfigError(f"{what} is a {path.suffix or 'suffix-less'} file; give a folder or a .safetensors file")
        if not (folder / "config.json").is_file():
            raise ConfigError(
                f"{what} has no config.json in {folder}: the architecture is read from it (save_pretrained writes it)"
            )
        return folder.resolve()
    if not looks_like_hub_id(pretrained):
        raise ConfigError(f"{what} does not exist, and is not a hub id (user/name); give a local folder or a hub id")
    return from_hub(what, pretrained)


def from_hub(what: str, repo: str) -> Path:
    try:
        import huggingface_hub
        from huggingface_hub import constants
    except ImportError:
        raise ConfigError(
            f"{what} is a hub id, which needs huggingface_hub: pip install 'fedhet[pretrained]'"
        ) from None

    try:
        return Path(huggingface_hub.snapshot_download(repo, local_files_only=True, allow_patterns=FILES))
    except Exception:  # not cached (huggingface_hub's errors have no common base); try the hub where it answers
        pass
    offline = bool(constants.HF_HUB_OFFLINE)
    if offline or not hub_reachable():
        why = "HF_HUB_OFFLINE is set" if offline else f"{hub_endpoint()} cannot be reached from here"
        raise ConfigError(
            f"{what} is not a local folder, and no cached copy of it is in {constants.HF_HUB_CACHE} ({why}); "
            f"download it where there is a network (hf download {repo}, with the same HF_HOME) or point "
            "model.pretrained at a local folder"
        )
    try:
        return Path(huggingface_hub.snapshot_download(repo, allow_patterns=FILES))
    except Exception as exc:
        raise ConfigError(f"{what} cannot be loaded from the Hugging Face Hub: {hub_problem(exc)}") from None


# a folder holds a tokenizer when it has one of these (a fast tokenizer's file, or a slow one's vocabulary)
TOKENIZER_MARKS = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json")


def tokenizer_of(pretrained: str) -> str | None:
    """``pretrained`` when its folder (local, or the hub id's cached copy) has a tokenizer; else None. Nothing is
    downloaded and nothing is refused here: the model's own loading words any problem."""
    path = Path(pretrained).expanduser()
    if os.path.lexists(path):
        folder = path.parent if path.is_file() else path
    elif looks_like_hub_id(pretrained):
        try:
            import huggingface_hub

            folder = Path(huggingface_hub.snapshot_download(pretrained, local_files_only=True, allow_patterns=FILES))
        except Exception:  # not cached (or huggingface_hub missing): no tokenizer known
            return None
    else:
        return None
    return pretrained if any((folder / name).is_file() for name in TOKENIZER_MARKS) else None

"""The Hugging Face Hub as fedhet reaches it: its address, whether it answers, and what an id looks like.

Shared by the ``hf`` dataset source (``data/datasets/huggingface.py``) and the transformer models' pretrained
weights (``models/hub.py``): without a network, Hugging Face's libraries retry for minutes, so both probe the host
first and read only their caches when it does not answer.
"""

from __future__ import annotations

import os
import re
import socket
import urllib.parse


def hub_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co")


def hub_reachable(timeout: float = 5.0) -> bool:
    """Whether the hub's host answers a TCP connection: without a network, datasets retries for minutes."""
    url = urllib.parse.urlparse(hub_endpoint())
    try:
        with socket.create_connection((url.hostname or "", url.port or 443), timeout=timeout):
            return True
    except OSError:
        return False


def looks_like_hub_id(text: str) -> bool:
    return re.fullmatch(r"[\w.-]+(/[\w.-]+)?", text) is not None and not text.startswith(".")


def hub_problem(exc: BaseException) -> str:
    """An exception of the Hugging Face libraries as one line of at most 300 characters, from its first cause:
    datasets wraps a reader's error (a CSV line with too many fields) in one that says only "An error occurred while
    generating the dataset"."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) < 300 else text[:297] + "..."

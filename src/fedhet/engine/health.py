"""Whether a run trained: empty rounds (no client finished some phase), the stop rules they trigger, and the notes a
summary carries about what the run could not train on or measure. A run that did not train never ends "finished"."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from fedhet.algorithms import Algorithm
from fedhet.config import Config
from fedhet.data.federated import FederatedDataset
from fedhet.errors import RunFailed


class RunHealth:
    def __init__(self, cfg: Config, fed: FederatedDataset, algo: Algorithm) -> None:
        self.cfg, self.fed, self.algo = cfg, fed, algo
        self.empty_streak = 0  # rounds in a row in which no client finished (some phase lost every client)
        self.empty_rounds = 0  # and in all
        self.streak_losses: dict[str, int] = {}  # what took the updates of those rounds: a phrase -> how many

    def record_round(self, rnd: int, empty: list[str], losses: dict[str, int]) -> None:
        """Count round ``rnd`` (``empty``: the phases that lost every client; ``losses``: what took its clients'
        updates, as ``lost_updates`` phrases them). Fails when ``run.max_empty_rounds`` rounds in a row were empty,
        or when the run's last round leaves it with no round that any client finished (a run shorter than the limit
        must not end "finished" untrained); the error says what took the updates."""
        self.empty_streak = self.empty_streak + 1 if empty else 0
        self.empty_rounds += bool(empty)
        if not empty:
            self.streak_losses = {}
            return
        self.streak_losses = add_losses(self.streak_losses, losses)
        limit = self.cfg.run.max_empty_rounds
        lost = "" if empty == ["train"] else f" (phase {', '.join(empty)} lost every client)"
        what = describe_losses(self.streak_losses)
        if self.empty_streak >= limit:
            raise RunFailed(
                f"no client finished round {rnd}{f' or the {limit - 1} before it' if limit > 1 else ''}{lost} "
                f"(run.max_empty_rounds={limit}); {what}"
            )
        if rnd == self.cfg.run.rounds and self.empty_rounds == rnd:
            raise RunFailed(f"no client finished any of the run's {rnd} round(s){lost}, so nothing trained; {what}")

    def start_notes(self) -> list[str]:
        """What the run will not train on or cannot measure, known before it starts: said at the start and kept
        in summary.json, so a run that trains on (almost) nothing never ends as if it had trained."""
        notes = list(self.fed.notes)  # what loading did to the data (images converted, a damaged cache)
        sizes = [len(c.y) for c in self.fed.clients]
        if not any(sizes):
            return notes  # the data are on the nodes (Flower)
        idle = sum(n == 0 for n in sizes)
        if idle:
            notes.append(f"{idle} of {len(sizes)} clients hold no training samples and drop out whenever sampled")
        total, batch = sum(sizes), self.cfg.train.batch_size
        # clients smaller than a batch still train (on one short batch), and together on every sample: only a
        # federation whose data would not fill a single batch trains on almost nothing
        if total < batch:
            fraction = self.cfg.dataset.train_fraction
            kept = f" (dataset.train_fraction={fraction:g})" if fraction < 1 else ""
            notes.append(
                f"the clients hold {total} training samples in all{kept}, fewer than one batch of {batch}: the run "
                "trains on almost nothing"
            )
        if self.algo.personalized and not any(c.y_test is not None and len(c.y_test) > 0 for c in self.fed.clients):
            notes.append(
                f"{self.cfg.algorithm.name} is personalised, but the clients have no local test splits, so "
                "personalised accuracy cannot be measured; set partition.local_test_fraction (e.g. 0.2)"
            )
        return notes

    def round_notes(self, rounds_done: int, seen: set[int]) -> list[str]:
        """What the rounds so far left untrained: empty rounds, personalised models never trained."""
        notes = []
        if self.empty_rounds:
            notes.append(
                f"{self.empty_rounds} of {rounds_done} round(s) had no client finish (a phase lost every client); "
                + (
                    "central DP applied (and accounted) those rounds' noise alone"
                    if self.cfg.privacy.mode == "central"
                    else "the model did not change in those rounds"
                )
            )
        if self.algo.personalized and rounds_done:
            never = self.fed.num_clients - len(seen)
            if never == self.fed.num_clients:
                notes.append("no client ever trained, so no personalised model exists")
            elif never:
                notes.append(
                    f"{never} of {self.fed.num_clients} clients never trained: they have no personalised model "
                    "and are not in the personalised accuracy"
                )
        return notes

    def state_dict(self) -> dict[str, Any]:
        return {
            "empty_streak": self.empty_streak,
            "empty_rounds": self.empty_rounds,
            "streak_losses": dict(self.streak_losses),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.empty_streak = state.get("empty_streak", 0)
        self.empty_rounds = state.get("empty_rounds", self.empty_streak)  # older checkpoints kept only the streak
        self.streak_losses = dict(state.get("streak_losses", {}))


def training_errors(failures: Path) -> str:
    """The phrase for clients that failed while training (``lost_updates``' counterpart for the executor's)."""
    return f"clients failed while training (the errors are in {failures})"


def add_losses(total: dict[str, int], more: dict[str, int]) -> dict[str, int]:
    return {**total, **{k: total.get(k, 0) + n for k, n in more.items() if n}}


def describe_losses(losses: dict[str, int]) -> str:
    """What took the updates, in one phrase: "6 updates lost to system.dropout=1, 2 clients failed ..."."""
    if not losses:
        return "why: no client was sampled"
    return "why: " + ", ".join(f"{n} {what}" for what, n in losses.items())


def nonfinite(tree: Any, prefix: str = "") -> list[str]:
    """The names of the non-finite tensors and floats in a (nested) state dict."""
    if isinstance(tree, dict):
        return [n for k, v in tree.items() for n in nonfinite(v, f"{prefix}{k}.")]
    if isinstance(tree, list | tuple):
        return [n for i, v in enumerate(tree) for n in nonfinite(v, f"{prefix}{i}.")]
    name = prefix.rstrip(".")
    if isinstance(tree, torch.Tensor):
        return [] if not tree.is_floating_point() or bool(torch.isfinite(tree).all()) else [name]
    if isinstance(tree, float):
        return [] if math.isfinite(tree) else [name]
    return []

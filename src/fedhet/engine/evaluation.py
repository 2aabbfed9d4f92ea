"""What a run measures at each evaluation: the global model on the global test set, on every client's distribution
and on the clients' validation data (partition.validation_fraction), the local models (FedACD's tables), the models an
algorithm asks to have scored, the personalised models, and the clients' own reports (``Reply.metrics``). One record
per evaluation, in ``metrics.jsonl``."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedhet.algorithms import Algorithm, Reply
from fedhet.config import Config
from fedhet.data.federated import FederatedDataset
from fedhet.engine.attack import attack_metrics
from fedhet.engine.client import LOCAL_BUFFERS, LOCAL_PARAMS, Executor, RoundResult
from fedhet.results.store import MetricsLog, Warn, truncate_after
from fedhet.toolkit.evaluate import (
    client_test_samples,
    evaluate,
    evaluate_global,
    local_risk,
    validation_metrics,
)
from fedhet.toolkit.flat import FlatModel
from fedhet.toolkit.local import derive_seed


class Evaluator:
    """Builds a round's metrics record. ``observe`` takes each phase's replies as they come (before aggregation, it
    keeps the local models ``run.eval_local_models`` asked the clients for); ``evaluate`` scores and assembles."""

    def __init__(
        self,
        cfg: Config,
        fed: FederatedDataset,
        model: torch.nn.Module,
        flat: FlatModel,
        algo: Algorithm,
        executor: Executor,
        run_dir: Path,
        seen: set[int],
        warn: Warn = None,
    ) -> None:
        self.cfg, self.eval_fed, self.model, self.flat, self.algo = cfg, fed, model, flat, algo
        self.executor, self.run_dir, self.seen = executor, run_dir, seen
        self.warn = warn  # a torn line of client_metrics.jsonl: the run's one warning line
        self.ema: float | None = None  # test_acc_ema (state: in the checkpoint)
        # run.eval_local_models: the local models (params, buffers) of the last phase's replies, for evaluation
        self.local_models: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.local_kls: list[float] = []  # and their KL(P^m || Q) on their own data (Table 9)
        self._dist_samples: list[np.ndarray] | None = None
        # each phase's Reply.metrics of the last round, (examples, metrics) per client: aggregated at evaluation
        self.client_reports: dict[str, dict[int, tuple[int, dict[str, Any]]]] = {}
        self._client_metrics_started = False  # client_metrics.jsonl cut back to the resumed round once

    def observe(self, phase: str, replies: dict[int, Reply]) -> None:
        if phase == self.algo.local_model_phase:  # this round's local models only: never a failed round's ones
            self.local_models = {
                cid: (r.tensors.pop(LOCAL_PARAMS), r.tensors.pop(LOCAL_BUFFERS, None))
                for cid, r in replies.items()
                if LOCAL_PARAMS in r.tensors
            }
            self.local_kls = [r.metrics["local_kl"] for r in replies.values() if "local_kl" in r.metrics]
        self.client_reports[phase] = {cid: (r.num_examples, dict(r.metrics)) for cid, r in replies.items()}

    def evaluate(self, rnd: int, result: RoundResult, elapsed: float) -> dict[str, Any]:
        self.flat.set_params(self.algo.global_params)
        self.flat.set_buffers(self.algo.global_buffers)
        metrics = evaluate_global(self.model, self.eval_fed, self.cfg.run.eval_batch_size, self.dist_samples())
        metrics.update(validation_metrics(self.model, self.eval_fed, self.cfg.run.eval_batch_size))
        metrics.update(self.local_model_metrics())
        metrics.update(self.extra_model_metrics())
        metrics.update(attack_metrics(self.cfg, self.model, self.eval_fed))  # the backdoor's success rate
        acc = metrics["test_acc"]
        self.ema = acc if self.ema is None else self.cfg.run.ema * self.ema + (1 - self.cfg.run.ema) * acc
        replies = result.replies
        n = sum(r.num_examples for r in replies.values())
        train_loss = sum(r.metrics.get("train_loss", math.nan) * r.num_examples for r in replies.values())
        record = {
            "round": rnd,
            "elapsed_s": round(elapsed, 4),  # a resumed run continues the clock
            "lr": self.algo.round_lr(rnd),
            "train_loss": train_loss / n if n else None,
            "clients": len(replies),
            "dropped": len(result.failures),
            **metrics,
            "test_acc_ema": self.ema,
        }
        record.update(self.personal_metrics(rnd))
        record.update(self.algo.round_metrics(rnd))
        record.update(self.algo.aggregation_metrics())
        record.update(self.client_metric_stats())  # after every key above: records only gain keys
        self.write_client_metrics(rnd)
        return record

    def client_metric_stats(self) -> dict[str, float]:
        """What the clients put in ``Reply.metrics`` this round, per metric over the clients that reported it:
        ``clients/<metric>/mean``, ``/min``, ``/max`` and ``/weighted_mean`` (weighted by ``num_examples``); a
        phase other than "train" adds its name (``clients/posterior/disc_loss/mean``). A flag counts as 0 or 1 (as
        Flower's MetricRecord carries it), text is left out. A NaN from any client makes all four NaN (stored as
        null), so a diverged client is never averaged away."""
        out: dict[str, float] = {}
        for phase, reports in self.client_reports.items():
            values: dict[str, list[tuple[float, int]]] = {}
            for examples, metrics in reports.values():
                for name, value in metrics.items():
                    if not isinstance(value, int | float | np.number | np.bool_ | torch.Tensor):
                        continue
                    values.setdefault(name, []).append((float(value), examples))
            prefix = "clients/" if phase == "train" else f"clients/{phase}/"
            for name in sorted(values):
                xs = [v for v, _ in values[name]]
                total = sum(n for _, n in values[name])
                if any(math.isnan(v) for v in xs):
                    stats = dict.fromkeys(("mean", "min", "max", "weighted_mean"), math.nan)
                else:
                    weighted = sum(v * n for v, n in values[name]) / total if total else math.nan
                    stats = {"mean": sum(xs) / len(xs), "min": min(xs), "max": max(xs), "weighted_mean": weighted}
                out.update({f"{prefix}{name}/{stat}": value for stat, value in stats.items()})
        return out

    def write_client_metrics(self, rnd: int) -> None:
        """run.client_metrics: each client's ``Reply.metrics`` of round ``rnd``, one line per (phase, client) in
        ``client_metrics.jsonl`` (``round``, ``phase``, ``client``, ``num_examples``, then the metrics). The first
        evaluation of a process drops the lines a killed run wrote after its last checkpoint, whether or not the
        setting is still on."""
        path = self.run_dir / "client_metrics.jsonl"
        if not self._client_metrics_started:
            self._client_metrics_started = True
            truncate_after(path, rnd - 1, self.warn)  # the rounds before this one are the resumed checkpoint's
        if not self.cfg.run.client_metrics:
            return
        lines = []
        for phase, reports in self.client_reports.items():
            for cid, (examples, metrics) in reports.items():
                line = {"round": rnd, "phase": phase, "client": cid, "num_examples": examples}
                lines.append({**line, **{k: v for k, v in metrics.items() if k not in line}})
        MetricsLog(path, self.warn).extend(lines)

    def dist_samples(self) -> list[np.ndarray] | None:
        """The clients' sampled test sets (run.client_dist_sampled): drawn once from the run seed, so every round
        is measured on the same samples."""
        run = self.cfg.run
        if not run.client_dist_sampled:
            return None
        if self._dist_samples is None:
            fixed = run.client_dist_sample_size
            sizes = self.eval_fed.sizes if fixed is None else np.full(self.eval_fed.num_clients, fixed)
            rng = np.random.default_rng(derive_seed(run.seed, 0x7E57))
            y = self.eval_fed.y_test.cpu().numpy()
            self._dist_samples = client_test_samples(y, self.eval_fed.label_distribution(), sizes, rng)
        return self._dist_samples

    def local_model_metrics(self) -> dict[str, float]:
        """FedACD's Tables 3 and 9 for this round's local models (run.eval_local_models): the mean over participants
        of their risk on every client's label distribution, and of their KL(P^m || Q) on their own data."""
        if not self.local_models:
            return {}
        risks = []
        fed, label_dist = self.eval_fed, self.eval_fed.label_distribution()
        for params, buffers in self.local_models.values():
            self.flat.set_params(params)
            if buffers is not None:
                self.flat.set_buffers(buffers)
            stats = evaluate(self.model, fed.x_test, fed.y_test, fed.num_classes, self.cfg.run.eval_batch_size)
            risks.append(local_risk(stats.per_class_acc(), label_dist))
        self.flat.set_params(self.algo.global_params)
        self.flat.set_buffers(self.algo.global_buffers)
        kls, self.local_models, self.local_kls = self.local_kls, {}, []
        out = {"local_risk": float(np.mean(risks))}
        if kls:
            out["local_kl"] = float(np.mean(kls))
        return out

    def extra_model_metrics(self) -> dict[str, float]:
        """Accuracy and loss on the global test set of the other models the algorithm asks to have scored."""
        out = {}
        fed = self.eval_fed
        for name, params in self.algo.extra_eval_params().items():
            self.flat.set_params(params)
            stats = evaluate(self.model, fed.x_test, fed.y_test, fed.num_classes, self.cfg.run.eval_batch_size)
            out[f"{name}_acc"], out[f"{name}_loss"] = stats.acc, stats.loss
        if out:
            self.flat.set_params(self.algo.global_params)
        return out

    def personal_metrics(self, rnd: int) -> dict[str, Any]:
        """Each client's personalised model on its local test split (micro and macro averages), and where clients
        hold validation data on that too (``val_<prefix>_acc_micro``, ``_macro``: what a tuner of a personalised
        method reads).

        Only clients that have trained at least once are evaluated; the others are counted, not silently scored
        with the global model."""
        if not self.algo.personalized:
            return {}
        p = self.algo.personal_metric_prefix
        seen = sorted(self.seen)
        cids = self.personal_sample(rnd, seen)
        accs = self.executor.personal_accuracies(rnd, cids, self.algo.global_message(rnd), self.cfg.run.eval_batch_size)
        counts = {f"{p}_never_sampled": self.eval_fed.num_clients - len(seen)}
        if len(cids) < len(seen):
            counts[f"{p}_sample"] = len(cids)  # a seeded sample of the clients that have trained
        tests = [s["test"] for s in accs.values() if "test" in s]
        vals = [s["val"] for s in accs.values() if "val" in s]
        out = {**averages(tests, p), f"{p}_clients": len(tests), **counts}
        return out | {f"val_{k}": v for k, v in averages(vals, p).items()}

    def personal_sample(self, rnd: int, seen: list[int]) -> list[int]:
        """At most ``run.personal_eval_clients`` of ``seen``: each personalised model costs a pass over its client's
        test split, so 10,000 of them are measured on a sample drawn from (seed, round)."""
        limit = self.cfg.run.personal_eval_clients
        if limit is None or len(seen) <= limit:
            return seen
        rng = np.random.default_rng(derive_seed(self.cfg.run.seed, rnd, 0xE7A1))
        return sorted(int(c) for c in rng.choice(seen, size=limit, replace=False))


def averages(scores: list[tuple[int, int]], prefix: str) -> dict[str, float]:
    """Micro (over samples) and macro (over clients) accuracy of (correct, total) pairs; none for no pairs."""
    if not scores:
        return {}
    correct, total = np.array(scores).sum(axis=0)
    return {
        f"{prefix}_acc_micro": float(correct / max(total, 1)),
        f"{prefix}_acc_macro": float(np.mean([c / max(n, 1) for c, n in scores])),
    }

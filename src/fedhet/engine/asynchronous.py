"""The asynchronous loop: FedBuff (Nguyen et al., AISTATS 2022) on the simulated clock, ``server.mode = "fedbuff"``.

``server.concurrency`` clients train at once. Each downloads the current model version and trains from it; its update
arrives after the time the system model gives it (its local work and two transfers of the model). The server buffers
the arrivals and steps every ``server.buffer_size`` of them (``engine/buffered.py``); a slot whose update arrived is
refilled at once by a uniform draw from the idle clients, which downloads the model as it is then. A "round" of the
run (``run.rounds``, ``run.eval_every``, ``run.checkpoint_every``) is one server step.

It is a second loop over the synchronous loop's parts (run folder, executors, evaluation, health, display,
checkpoints): ``BufferedSimulation`` replaces what a round is, ``FedBuffSchedule`` takes the sampler's place (who
trains, when, from which version; its state goes into the checkpoint through the sampler's hooks).

Determinism. A client's update depends only on the version it downloaded, so training waits until it is needed: the
clients dispatched since the last server step (all on the current version) train together, as one phase of the
executor, when one of them arrives or before the server steps, whichever comes first. Each such *wave* is numbered,
and a client's random stream is (seed, wave, client), as a synchronous round's is (seed, round, client); draws of
clients come from (seed, dispatch index). A checkpoint is written after a server step, when the buffer is empty:
it holds the clock, the counters and every client in flight with its update, or, for those dispatched after the step
and not yet trained, what recomputes it (client, wave to come, and the version, which is the checkpoint's model), so
a killed run resumes bit for bit."""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedhet.algorithms import Reply
from fedhet.engine.buffered import buffered_statistics, buffered_target, fedbuff_concurrency, staleness_weight
from fedhet.engine.client import RoundResult
from fedhet.engine.health import add_losses, describe_losses, nonfinite, training_errors
from fedhet.engine.simulation import Simulation
from fedhet.engine.system import DROPOUT_STREAM, FAILED, STRAGGLER, STRAGGLER_STREAM, SystemModel, loss_phrase
from fedhet.errors import ConfigError, RunFailed
from fedhet.toolkit.local import derive_seed

PHASE = "train"
DRAW = 0xFB  # the stream of the dispatch draws: derive_seed(seed, dispatch index, DRAW)


@dataclass
class Flight:
    """A client in flight: dispatched at ``start`` with model ``version``, its update arriving at ``arrival``."""

    cid: int
    dispatch: int  # this dispatch's index in the run (0, 1, ...): ties in arrival go in dispatch order
    version: int
    start: float
    arrival: float
    steps: int | None = None  # a straggler's local steps (its budget); None: its full count
    lost: str | None = None  # "straggler" (its work dropped) or "dropout" (failed before replying): never trains
    trained: bool = False
    update: torch.Tensor | None = None  # the client's model minus the version it downloaded
    buffers: torch.Tensor | None = None  # the floating buffers it reported (BatchNorm statistics), not a difference
    reply: Reply | None = None  # the rest of the reply (examples, metrics, other tensors)
    failure: dict[str, Any] | None = None  # trained, failed: its failures.jsonl record; it arrives with no update

    def key(self) -> tuple[float, int]:
        return (self.arrival, self.dispatch)

    def state(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            k: getattr(self, k)
            for k in ("cid", "dispatch", "version", "start", "arrival", "steps", "lost", "trained", "failure")
        }
        out.update(update=self.update, buffers=self.buffers)
        if self.reply is not None:
            r = self.reply
            out["reply"] = {"tensors": r.tensors, "scalars": r.scalars, "num_examples": r.num_examples}
            out["reply"]["metrics"] = r.metrics
        return out

    @classmethod
    def from_state(cls, state: dict[str, Any], device: torch.device) -> Flight:
        fields = {k: v for k, v in state.items() if k != "reply"}
        if fields.pop("buffer_update", None) is not None:  # written before the buffers were kept as reported
            raise ConfigError(
                "this FedBuff checkpoint holds BatchNorm statistics as differences, which this fedhet no longer "
                "applies (they could make a variance negative); start a new run"
            )
        for k in ("update", "buffers"):
            if fields.get(k) is not None:
                fields[k] = fields[k].to(device)
        reply = state.get("reply")
        if reply is not None:
            tensors = {k: t.to(device) for k, t in reply["tensors"].items()}
            reply = Reply(tensors, dict(reply["scalars"]), reply["num_examples"], dict(reply["metrics"]))
        return cls(**fields, reply=reply)


class FedBuffSchedule:
    """Which clients train, when, from which version: the in-flight clients ordered by arrival, the simulated clock
    and the counters. In the sampler's place in ``Simulation``: its ``state_dict`` goes into the checkpoint."""

    COUNTERS = (
        "lost",
        "clock",
        "version",
        "dispatched",
        "waves",
        "arrivals",
        "failed_streak",
        "stale_sum",
        "stale_n",
        "stale_max",
        "streak_losses",
    )

    def __init__(self, num_clients: int, concurrency: int, seed: int, device: torch.device) -> None:
        self.num_clients, self.concurrency, self.seed, self.device = num_clients, concurrency, seed, device
        self.clock = 0.0  # simulated seconds at the last arrival
        self.version = 0  # server steps taken
        self.dispatched = 0  # dispatches so far (the next one's index)
        self.waves = 0  # training waves so far
        self.arrivals = 0  # updates that arrived, failed ones too
        self.failed_streak = 0  # arrivals in a row that brought no update
        self.streak_losses: dict[str, int] = {}  # what took them: a phrase (health.describe_losses) -> how many
        self.lost = 0  # updates the system model dropped (stragglers under "drop", dropouts) since the last evaluation
        # the staleness of the updates that entered a server step since the last evaluation: sum, count, largest
        self.stale_sum, self.stale_n, self.stale_max = 0, 0, 0
        self.heap: list[tuple[float, int, Flight]] = []  # (arrival, dispatch, flight): ties go in dispatch order

    def idle(self) -> list[int]:
        busy = {f.cid for _, _, f in self.heap}
        return [c for c in range(self.num_clients) if c not in busy]

    def draw(self, n: int) -> list[int]:
        """``n`` idle clients, uniformly without replacement, from (seed, the next dispatch index)."""
        rng = np.random.default_rng(derive_seed(self.seed, self.dispatched, DRAW))
        idle = self.idle()
        return [idle[i] for i in rng.choice(len(idle), size=n, replace=False)]

    def push(self, flight: Flight) -> None:
        self.dispatched += 1
        heapq.heappush(self.heap, (flight.arrival, flight.dispatch, flight))

    def pop(self) -> Flight:
        _, _, flight = heapq.heappop(self.heap)
        self.clock = flight.arrival
        self.arrivals += 1
        return flight

    def untrained(self) -> list[Flight]:
        return sorted((f for _, _, f in self.heap if not f.trained), key=lambda f: f.dispatch)

    def count_staleness(self, stale: list[int]) -> None:
        self.stale_sum, self.stale_n = self.stale_sum + sum(stale), self.stale_n + len(stale)
        self.stale_max = max([self.stale_max, *stale])

    def staleness_metrics(self) -> dict[str, float]:
        """The mean and largest staleness since the last evaluation (then counted anew)."""
        mean = self.stale_sum / self.stale_n if self.stale_n else math.nan
        out = {"async/staleness_mean": mean, "async/staleness_max": float(self.stale_max)}
        self.stale_sum, self.stale_n, self.stale_max = 0, 0, 0
        return out

    # ------------------------------------------------------------------ the sampler's hooks
    def open_log(self, run_dir: Path) -> None:
        """No log of its own: the dispatches are a function of the seed and the clock."""

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {k: getattr(self, k) for k in self.COUNTERS}
        state["flights"] = [f.state() for _, _, f in sorted(self.heap, key=lambda e: e[:2])]
        return {"fedbuff": state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = dict(state["fedbuff"])
        for f in saved.pop("flights"):
            flight = Flight.from_state(f, self.device)
            self.heap.append((flight.arrival, flight.dispatch, flight))
        heapq.heapify(self.heap)
        for k, v in saved.items():
            setattr(self, k, v)


class BufferedSimulation(Simulation):
    """``Simulation`` whose round is one FedBuff server step (the loop, the run folder, evaluation and checkpoints are
    the synchronous loop's)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        cfg = self.cfg
        device = self.algo.global_params.device
        self.schedule = FedBuffSchedule(self.fed.num_clients, fedbuff_concurrency(cfg), cfg.run.seed, device)
        self.sampler = self.schedule  # type: ignore[assignment]  (its state is checkpointed in the sampler's place)
        self.buffer: list[Flight] = []

    # ------------------------------------------------------------------ one server step
    def train_round(self, rnd: int) -> RoundResult:
        """Arrivals, in simulated time, until the buffer holds ``server.buffer_size`` updates; then the step."""
        schedule, k = self.schedule, self.cfg.server.buffer_size
        if schedule.dispatched == 0:
            self.dispatch(schedule.concurrency)
        failures: list[dict[str, Any]] = []
        while True:
            flight = schedule.pop()
            if not flight.trained:
                self.train_wave([flight, *schedule.untrained()])
            if flight.lost or flight.failure is not None:
                if flight.failure is not None:
                    failures.append({**flight.failure, "round": rnd})
                    self.folder.failures_log.append(failures[-1])
                    what = training_errors(self.run_dir / "failures.jsonl")
                else:
                    schedule.lost += 1
                    what = loss_phrase(self.cfg.system, STRAGGLER if flight.lost == "straggler" else FAILED)
                schedule.failed_streak += 1
                schedule.streak_losses = add_losses(schedule.streak_losses, {what: 1})
                self.check_streak(rnd)
            else:
                self.buffer.append(flight)
                schedule.failed_streak, schedule.streak_losses = 0, {}
            full = len(self.buffer) == k
            if full:
                pending = schedule.untrained()
                if pending:  # they downloaded the version about to change
                    self.train_wave(pending)
                result = self.server_step(rnd, failures)
            self.dispatch(1)  # the freed slot, with the model as it is now
            if full:
                return result

    def dispatch(self, n: int) -> None:
        """``n`` idle clients start from the current version; the system model says when each update arrives."""
        schedule, system = self.schedule, self.system
        assert system is not None  # server.mode = "fedbuff" needs [system] (engine/buffered.py)
        for cid in schedule.draw(n):
            flight = Flight(cid, schedule.dispatched, schedule.version, schedule.clock, schedule.clock)
            self.plan_work(flight)
            flight.arrival = schedule.clock + system.arrival(cid, flight.steps or system.full[cid])
            schedule.push(flight)

    def plan_work(self, flight: Flight) -> None:
        """The system model's stragglers and dropouts, per dispatch: it is a straggler with probability
        ``system.stragglers`` (steps drawn as ``system.straggler_steps`` says; dropped or kept as
        ``system.straggler_policy`` says), and fails before replying with probability ``system.dropout``; draws
        from (seed, dispatch index, client)."""
        system, d, cid = self.system, flight.dispatch, flight.cid
        assert system is not None
        settings = system.system
        if settings.stragglers > 0 and system.uniform(d, cid, STRAGGLER_STREAM) < settings.stragglers:
            flight.steps = system.straggler_steps(d, cid, system.full[cid])
            if settings.straggler_policy == "drop":
                flight.lost = "straggler"
        if settings.dropout > 0 and system.uniform(d, cid, DROPOUT_STREAM) < settings.dropout and not flight.lost:
            flight.lost = "dropout"
        if flight.lost:
            flight.trained = True  # nothing to train: its update never comes

    def train_wave(self, flights: list[Flight]) -> None:
        """Train ``flights``, every client dispatched since the last server step (all from the current version), as
        one phase of the executor."""
        schedule = self.schedule
        flights = [f for f in flights if not f.lost]
        if not flights:
            return
        schedule.waves += 1
        msgs = self.algo.configure(schedule.version + 1, [f.cid for f in flights], PHASE)
        msgs = SystemModel.limit(msgs, {f.cid: f.steps for f in flights if f.steps is not None})
        replies, failures = self.executor.run_phase(schedule.waves, 0, PHASE, msgs)
        failed = {record["client"]: record for record in failures}
        x = self.algo.global_params
        for flight in flights:
            flight.trained = True
            reply = replies.get(flight.cid)
            if reply is None:
                flight.failure = {**failed[flight.cid], "dispatch": flight.dispatch}
                continue
            flight.update = reply.tensors.pop("params") - x
            flight.buffers = reply.tensors.pop("buffers", None)
            flight.reply = reply

    def server_step(self, rnd: int, failures: list[dict[str, Any]]) -> RoundResult:
        """FedBuff's step over the buffer: x + sum_i w_i s(t - tau_i) Delta_i through the server optimiser."""
        schedule, server, algo = self.schedule, self.cfg.server, self.algo
        buffer, self.buffer = self.buffer, []
        replies = {f.dispatch: f.reply for f in buffer}
        stale = [schedule.version - f.version for f in buffer]
        weights = [
            w * staleness_weight(s, server.staleness, server.staleness_exponent)
            for w, s in zip(algo.aggregation_weights(replies), stale, strict=True)
        ]
        by_client = {f.cid: f.reply for f in buffer}  # a client twice in one buffer: its last update's report
        self.evaluator.observe(PHASE, by_client)
        target = buffered_target(algo.global_params, [f.update for f in buffer], weights)
        algo.global_params = algo.server_opt.step(algo.global_params, target)
        if algo.global_buffers is not None and algo.global_buffers.numel():
            moved = buffered_statistics(algo.global_buffers, [f.buffers for f in buffer], weights)
            if algo.kept_buffers is not None:
                moved[algo.kept_buffers] = algo.global_buffers[algo.kept_buffers]
            algo.global_buffers = moved
        for f in buffer:
            algo.account({f.cid: f.reply})
        self.seen.update(by_client)
        schedule.version += 1
        schedule.count_staleness(stale)
        assert self.system is not None
        self.system.time = schedule.clock  # the clock a checkpoint keeps in the system model's place too
        if failures:
            self.display.dropped(rnd, PHASE, failures, len(failures) + len(buffer))
        self.health.record_round(rnd, [], {})
        self.check_finite(rnd)
        return RoundResult(by_client, failures)

    def check_finite(self, rnd: int) -> None:
        bad = nonfinite({"global_params": self.algo.global_params, "global_buffers": self.algo.global_buffers})
        if bad:
            raise RunFailed(f"server step {rnd}: the global model became non-finite ({', '.join(bad)})")

    def check_streak(self, rnd: int) -> None:
        """A run whose clients keep failing would wait forever: it fails after ``run.max_empty_rounds`` server
        steps' worth of arrivals in a row brought no update."""
        limit = self.cfg.run.max_empty_rounds * self.cfg.server.buffer_size
        if self.schedule.failed_streak >= limit:
            raise RunFailed(
                f"none of the last {limit} client updates reached the server (run.max_empty_rounds x "
                f"server.buffer_size) during server step {rnd}; {describe_losses(self.schedule.streak_losses)}"
            )

    # ------------------------------------------------------------------ what an evaluation adds
    def evaluate(self, rnd: int, result: RoundResult) -> dict[str, Any]:
        record = super().evaluate(rnd, result)
        schedule = self.schedule
        record.update(
            {"sim/time": schedule.clock, "async/version": schedule.version, "async/updates": schedule.arrivals}
        )
        record.update(schedule.staleness_metrics())
        record["async/lost"], schedule.lost = schedule.lost, 0
        return record

"""The system model (``[system]``, docs/system-heterogeneity.md): how fast each client computes and communicates,
who is online in a round, how many local steps each sampled client finishes, and when its reply arrives on the
simulated clock.

The round loop asks it three questions: which clients train this round and with how many local steps (``plan``),
how long the round lasted (the plan's ``duration``, added to the clock by ``finish``) and what to log (``metrics``).

- **Profiles**: each client's speed (samples per second) and bandwidth (bytes per second each way) are constant,
  uniform, log-normal, from device tiers, or read from a CSV trace; drawn once from the run seed.
- **The clock**: a client that trains ``s`` local steps on ``n`` samples with batch size ``B`` processes
  ``(s // ceil(n/B)) n + (s % ceil(n/B)) B`` samples (the shared loop's passes, the last batch of a pass short), so
  its compute time is that over its speed; moving the model both ways takes ``2 bytes / bandwidth + latency`` per
  phase. Its reply arrives after the sum.
- **A round**: the online clients (always, Bernoulli, a daily cycle on the simulated clock, or the trace's
  probability) are sampled ``clients per round x (1 + over_selection)``; a ``stragglers`` share of them draws a
  uniform step count in ``[1, full]`` (FedProx's experiment), or whole epochs in ``[1, E - 1]`` (its code); with
  ``straggler_policy = "drop"`` stragglers are dropped, with ``"partial"`` they send those steps. A client whose
  reply would arrive after ``deadline`` is dropped or sends the steps that fit; a ``dropout`` share fails after
  training. Of the rest, the first ``clients per round`` to arrive are kept (over-selection); the others' work is
  discarded.
- **Duration**: the last kept reply's arrival when the round got its clients per round; otherwise the server also
  waited for the clients that failed (until the deadline, or without one until their reply was due) and the late
  ones (until the deadline).

Clients that are not kept do not run at all: their reply would be discarded and their state is kept as it was (the
state store writes a client's state only when its reply is used), which is what a failure before the reply means.
Every draw comes from (run seed, round, client) streams, and the clock is in the checkpoint, so a resumed run plans
what the uninterrupted one planned."""

from __future__ import annotations

import csv
import hashlib
import math
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedhet.algorithms.contract import STEP_BUDGET, Message
from fedhet.config import Config, SystemSection
from fedhet.errors import ConfigError
from fedhet.toolkit.local import derive_seed, num_local_steps

# the seed parts of the system model's streams (no other stream of the run uses them)
PROFILE_STREAM = 0x5F5  # profiles and daily offsets: (seed, PROFILE_STREAM)
ONLINE_STREAM = 0x5F6  # (seed, round, client, ONLINE_STREAM)
STRAGGLER_STREAM = 0x5F7  # which clients straggle: (seed, round, STRAGGLER_STREAM)
WORK_STREAM = 0x5F8  # a straggler's step count: (seed, round, client, WORK_STREAM)
DROPOUT_STREAM = 0x5F9  # (seed, round, client, DROPOUT_STREAM)

TRACE_COLUMNS = ("client", "speed", "bandwidth", "availability")
# a trace has one short row per client: 64 MiB holds about a million clients, and a larger file (or /dev/zero) is
# refused before it is read rather than read into memory
MAX_TRACE_BYTES = 64 * 2**20
# the longest a client's full round (its local work and the model's transfers) may take on the simulated clock:
# about 31,700 years, beyond any study; speeds or bandwidths near zero would otherwise overflow the clock to inf
MAX_ROUND_SECONDS = 1e12

# what happened to a sampled client: its reply is used, or why not
KEPT, STRAGGLER, LATE, FAILED, SURPLUS = "kept", "straggler", "late", "failed", "surplus"


@dataclass(frozen=True)
class Profiles:
    """Every client's speed (samples per second), bandwidth (bytes per second) and, from a trace, its probability
    of being online in a round."""

    speed: np.ndarray
    bandwidth: np.ndarray
    availability: np.ndarray | None = None
    trace_sha256: str | None = None  # the trace file's bytes, checked when a run resumes


def draw_profiles(system: SystemSection, num_clients: int, seed: int) -> Profiles:
    """The clients' profiles as ``system.profiles`` says, from the run seed alone."""
    if system.profiles == "trace":
        return read_trace(Path(system.trace or ""), num_clients)
    rng = np.random.default_rng(derive_seed(seed, PROFILE_STREAM))
    ones = np.ones(num_clients)
    if system.profiles == "constant":
        return Profiles(system.speed * ones, system.bandwidth * ones)
    if system.profiles == "uniform":
        s = system.spread
        return Profiles(
            system.speed * rng.uniform(1 - s, 1 + s, num_clients),
            system.bandwidth * rng.uniform(1 - s, 1 + s, num_clients),
        )
    if system.profiles == "lognormal":
        with np.errstate(over="ignore"):  # a huge spread: SystemModel.check_clock refuses what comes out
            return Profiles(
                system.speed * np.exp(system.spread * rng.standard_normal(num_clients)),
                system.bandwidth * np.exp(system.spread * rng.standard_normal(num_clients)),
            )
    tier = client_tiers(system, num_clients, seed)
    speeds, bandwidths = np.array([t[1] for t in system.tiers]), np.array([t[2] for t in system.tiers])
    return Profiles(speeds[tier].astype(float), bandwidths[tier].astype(float))


def client_tiers(system: SystemSection, num_clients: int, seed: int) -> np.ndarray:
    """Each client's device tier (``system.profiles = "tiers"``): a seeded shuffle of the clients, cut by the tiers'
    shares (rounded; the last tier takes the rest)."""
    order = np.random.default_rng(derive_seed(seed, PROFILE_STREAM)).permutation(num_clients)
    tier = np.empty(num_clients, dtype=np.int64)
    start = 0
    for i, (share, _speed, _bandwidth) in enumerate(system.tiers):
        end = num_clients if i == len(system.tiers) - 1 else min(num_clients, start + round(share * num_clients))
        tier[order[start:end]] = i
        start = end
    return tier


def client_lora_ranks(cfg: Config, num_clients: int) -> list[int] | None:
    """Each client's LoRA rank (``model.lora_ranks``): cycled over the client ids, or by device tier
    (``model.lora_ranks_by = "tier"``); None without heterogeneous ranks."""
    ranks = cfg.model.lora_ranks
    if ranks is None:
        return None
    if cfg.model.lora_ranks_by == "tier":
        return [ranks[t] for t in client_tiers(cfg.system, num_clients, cfg.run.seed)]
    return [ranks[c % len(ranks)] for c in range(num_clients)]


def read_trace(path: Path, num_clients: int) -> Profiles:
    """A trace file: the header ``client,speed,bandwidth,availability`` and one row per client 0..N-1 (any order);
    a bad row or a missing client is one ``ConfigError`` naming it."""
    where = f"system.trace {str(path)!r}"
    data = trace_bytes(path, where)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{where} is not UTF-8 text (byte {err.start})") from None
    reader = csv.reader(text.splitlines())
    try:
        rows = list(reader)
    except csv.Error as err:  # a field over the csv module's limit, a stray NUL
        raise ConfigError(f"{where}, line {reader.line_num}: not a CSV row ({err})") from None
    header = [c.strip() for c in rows[0]] if rows else []
    if tuple(header) != TRACE_COLUMNS:
        raise ConfigError(
            f"{where}: the first row must be the header {','.join(TRACE_COLUMNS)} (got {','.join(header)!r})"
        )
    values = np.full((num_clients, 3), np.nan)
    for line, row in enumerate(rows[1:], start=2):
        if not row or not "".join(row).strip():
            continue
        cid = trace_row(row, line, where, num_clients, values)  # checked before a value is read
        values[cid] = [float(v) for v in row[1:]]
    missing = [c for c in range(num_clients) if np.isnan(values[c, 0])]
    if missing:
        shown = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
        raise ConfigError(
            f"{where} has no row for client(s) {shown}; it needs one row for every client 0..{num_clients - 1}"
        )
    digest = hashlib.sha256(data).hexdigest()
    return Profiles(values[:, 0].copy(), values[:, 1].copy(), values[:, 2].copy(), digest)


FILE_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device"}


def trace_bytes(path: Path, where: str) -> bytes:
    """The trace file's bytes: a regular file of at most ``MAX_TRACE_BYTES``, checked before reading (opened without
    blocking, so a FIFO is refused rather than waited on)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode):
                kind = FILE_KINDS.get(stat.S_IFMT(info.st_mode), "not a regular file")
                raise ConfigError(f"{where} is {kind}; it must be a regular CSV file")
            data = f.read(MAX_TRACE_BYTES + 1)
    except OSError as err:
        raise ConfigError(f"{where} cannot be read: {err.strerror or err}") from None
    if len(data) > MAX_TRACE_BYTES:
        raise ConfigError(
            f"{where} is larger than {MAX_TRACE_BYTES // 2**20} MiB, the most a trace of one row per client may be"
        )
    return data


def trace_row(row: list[str], line: int, where: str, num_clients: int, seen: np.ndarray) -> int:
    """The client of one trace row, after checking the row (``ConfigError`` naming the line and what is wrong)."""
    at = f"{where}, line {line}"
    if len(row) != len(TRACE_COLUMNS):
        raise ConfigError(f"{at}: expected 4 values ({','.join(TRACE_COLUMNS)}), got {len(row)}: {','.join(row)!r}")
    try:
        cid = int(row[0])
    except ValueError:
        raise ConfigError(f"{at}: client {row[0].strip()!r} is not a whole number") from None
    if not 0 <= cid < num_clients:
        raise ConfigError(f"{at}: client {cid} is not one of the federation's clients 0..{num_clients - 1}")
    if not np.isnan(seen[cid, 0]):
        raise ConfigError(f"{at}: client {cid} has a second row")
    for name, text in zip(TRACE_COLUMNS[1:], row[1:], strict=True):
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        low_ok = value > 0 if name != "availability" else value >= 0
        if not (math.isfinite(value) and low_ok and (name != "availability" or value <= 1)):
            valid = "a number in [0, 1]" if name == "availability" else "a positive number"
            raise ConfigError(f"{at}: {name} {text.strip()!r} is not {valid}")
    return cid


def samples_processed(steps: int, n: int, batch_size: int) -> int:
    """Samples the shared loop draws in ``steps`` steps over ``n`` samples: full passes of ``n``, then ``B`` a step
    (a pass's last, short batch is its last step, so a partial pass never reaches it)."""
    per_pass = max(1, math.ceil(n / batch_size))
    return (steps // per_pass) * n + (steps % per_pass) * batch_size


def steps_within(seconds: float, n: int, batch_size: int, speed: float, most: int) -> int:
    """The most local steps (at most ``most``) whose samples a client of ``speed`` processes in ``seconds``."""
    if seconds <= 0:
        return 0
    lo, hi = 0, most  # samples_processed grows with the steps: bisect for the last count that fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if samples_processed(mid, n, batch_size) / speed <= seconds:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass
class ClientPlan:
    """One sampled client in one round: the local steps it trains, its full count, when its reply arrives (seconds
    after the round starts) and what happens to it (``KEPT`` or why not)."""

    cid: int
    steps: int
    full: int
    arrival: float
    status: str = KEPT
    straggler: bool = False


@dataclass
class RoundPlan:
    """A round as the system model sees it: the online count, each sampled client's plan, the round's start and
    duration in simulated seconds."""

    round: int
    start: float
    online: int
    clients: list[ClientPlan] = field(default_factory=list)
    duration: float = 0.0

    @property
    def participants(self) -> list[int]:
        """The clients that train this round and whose replies are used, in client order."""
        return sorted(c.cid for c in self.clients if c.status == KEPT)

    def budgets(self) -> dict[int, int]:
        """client -> local steps, for each participant that trains fewer than its full count."""
        return {c.cid: c.steps for c in self.clients if c.status == KEPT and c.steps < c.full}

    def record(self) -> dict[str, Any]:
        """The round's line in clients.jsonl: who was sampled, how many were online, when the round started and how
        long it lasted, and each sampled client's plan (its steps, full count, straggler draw, reply's arrival in
        seconds after the start, and what happened to it), from which ``metrics`` can be recomputed."""
        return {
            "round": self.round,
            "sampled": [c.cid for c in self.clients],
            "online": self.online,
            "start": self.start,
            "duration": self.duration,
            "clients": [
                {
                    "client": c.cid,
                    "steps": c.steps,
                    "full": c.full,
                    "straggler": c.straggler,
                    "arrival": c.arrival,
                    "status": c.status,
                }
                for c in self.clients
            ],
        }

    def metrics(self) -> dict[str, Any]:
        count = {s: sum(c.status == s for c in self.clients) for s in (KEPT, STRAGGLER, LATE, FAILED, SURPLUS)}
        return {
            "sim/time": self.start + self.duration,
            "sim/round_time": self.duration,
            "sim/online": self.online,
            "sim/sampled": len(self.clients),
            "sim/stragglers": sum(c.straggler for c in self.clients),
            "sim/partial": len(self.budgets()),
            "sim/dropped": count[STRAGGLER] + count[LATE] + count[FAILED],
            "sim/late": count[LATE],
            "sim/failed": count[FAILED],
            "sim/surplus": count[SURPLUS],
        }


Sample = Callable[[int, list[int], int], list[int]]  # (round, the online clients, how many) -> the sampled clients


class SystemModel:
    """The system model of one run: its clients' profiles and the simulated clock (``time``, checkpointed)."""

    def __init__(
        self, cfg: Config, sizes: list[int], model_bytes: int, phases: int = 1, client_bytes: list[int] | None = None
    ) -> None:
        self.cfg, self.system, self.sizes = cfg, cfg.system, sizes
        self.seed, self.model_bytes, self.phases = cfg.run.seed, model_bytes, phases
        # each client's share where it differs (heterogeneous LoRA ranks move only the client's own slots)
        self.client_bytes = client_bytes
        self.profiles = draw_profiles(cfg.system, len(sizes), self.seed)
        t = cfg.train
        self.full = [num_local_steps(n, t.batch_size, t.local_epochs, t.local_steps) for n in sizes]
        # moving the model down and up once per phase, for each client
        moved = model_bytes if client_bytes is None else np.asarray(client_bytes, dtype=float)
        with np.errstate(over="ignore", divide="ignore"):  # a bandwidth near zero: check_clock refuses it
            self.comm = phases * (2 * moved / self.profiles.bandwidth + self.system.latency)
        offsets = np.random.default_rng(derive_seed(self.seed, PROFILE_STREAM, 1)).random(len(sizes))
        self.day_offsets = offsets  # daily availability: where in its day each client is at time 0
        self.time = 0.0  # simulated seconds at the end of the last finished round
        self.check_clock()
        self.check_deadline()

    # ------------------------------------------------------------------ the clock
    def compute_seconds(self, cid: int, steps: int) -> float:
        samples = samples_processed(steps, self.sizes[cid], self.cfg.train.batch_size)
        return samples / float(self.profiles.speed[cid]) if samples else 0.0  # no data: nothing to compute

    def arrival(self, cid: int, steps: int) -> float:
        """Seconds from the round's start until client ``cid``'s reply after ``steps`` local steps arrives."""
        return self.compute_seconds(cid, steps) + float(self.comm[cid])

    def check_clock(self) -> None:
        """A client whose full round would last longer than ``MAX_ROUND_SECONDS`` (a speed or bandwidth near zero, a
        huge latency) would overflow the simulated clock: refused, naming the client and the bound."""
        batch = self.cfg.train.batch_size
        work = np.array([samples_processed(f, n, batch) for f, n in zip(self.full, self.sizes, strict=True)], float)
        with np.errstate(all="ignore"):
            compute = np.where(work > 0, work / self.profiles.speed, 0.0)  # a client without data computes nothing
            total = compute + self.comm
        slow = np.flatnonzero(~(total <= MAX_ROUND_SECONDS))  # inf and nan too
        if not slow.size:
            return
        c = int(slow[0])
        fix = {
            "tiers": "raise that tier's speed or bandwidth in system.tiers",
            "trace": f"fix client {c}'s row in system.trace",
            "constant": "raise system.speed or system.bandwidth",
        }.get(self.system.profiles, "raise system.speed or system.bandwidth, or lower system.spread")
        if self.system.latency > MAX_ROUND_SECONDS / 2:
            fix = "lower system.latency"
        raise ConfigError(
            f"system.profiles={self.system.profiles!r}: client {c} would take {total[c]:.3g} simulated seconds a "
            f"round ({compute[c]:.3g} s computing at {self.profiles.speed[c]:.3g} samples/s, {self.comm[c]:.3g} s "
            f"moving the model at {self.profiles.bandwidth[c]:.3g} bytes/s with the latency), more than the "
            f"{MAX_ROUND_SECONDS:.0e} s a round may last on the simulated clock; {fix}"
        )

    def check_deadline(self) -> None:
        """A deadline that no client can meet with even one local step would leave every round empty: refused."""
        deadline = self.system.deadline
        if deadline is None:
            return
        trained = [c for c, n in enumerate(self.sizes) if n]
        fastest = min((self.arrival(c, 1) for c in trained), default=math.inf)
        if deadline < fastest:
            raise ConfigError(
                f"system.deadline={deadline:g} s is shorter than any client's round: the fastest needs {fastest:.4g} s "
                f"for one local step and the model's transfer; set system.deadline to at least {fastest:.4g}"
            )

    # ------------------------------------------------------------------ a round
    def online(self, rnd: int) -> list[int]:
        """The clients online at the start of round ``rnd`` (the daily cycle reads the simulated clock)."""
        n, system = len(self.sizes), self.system
        if system.availability == "always":
            return list(range(n))
        if system.availability == "daily":
            phase = (self.time / system.day + self.day_offsets) % 1.0
            return [c for c in range(n) if phase[c] < system.online]
        prob = self.profiles.availability if system.availability == "trace" else np.full(n, system.online)
        assert prob is not None
        return [c for c in range(n) if self.uniform(rnd, c, ONLINE_STREAM) < prob[c]]

    def uniform(self, rnd: int, cid: int, stream: int) -> float:
        return float(np.random.default_rng(derive_seed(self.seed, rnd, cid, stream)).random())

    def plan(self, rnd: int, sample: Sample) -> RoundPlan:
        """Who trains in round ``rnd`` and with how many steps, and how long the round lasts."""
        system, target = self.system, self.cfg.clients_per_round()
        online = self.online(rnd)
        asked = min(len(online), math.ceil(round(target * (1 + system.over_selection), 9)))
        cids = sample(rnd, online, asked) if asked else []
        plan = RoundPlan(rnd, self.time, len(online))
        stragglers = self.stragglers(rnd, cids)
        for cid in cids:
            full = self.full[cid]
            steps = self.straggler_steps(rnd, cid, full) if cid in stragglers else full
            client = ClientPlan(cid, steps, full, self.arrival(cid, steps), straggler=cid in stragglers)
            self.judge(rnd, client)
            plan.clients.append(client)
        self.keep_first(plan, min(target, len(cids)))
        return plan

    def stragglers(self, rnd: int, cids: list[int]) -> set[int]:
        """A ``stragglers`` share of the sampled clients (rounded half up), drawn from (seed, round)."""
        count = math.floor(self.system.stragglers * len(cids) + 0.5)
        if not count:
            return set()
        rng = np.random.default_rng(derive_seed(self.seed, rnd, STRAGGLER_STREAM))
        return {cids[i] for i in rng.permutation(len(cids))[:count]}

    def straggler_steps(self, rnd: int, cid: int, full: int) -> int:
        """A straggler's local steps, from (seed, round, client): uniform in [1, full] (FedProx's experiment as its
        paper states it), or with ``straggler_steps = "epochs"`` a uniform whole number of epochs in [1, E - 1]
        (FedProx's code), each epoch a pass of ceil(n / B) steps."""
        rng = np.random.default_rng(derive_seed(self.seed, rnd, cid, WORK_STREAM))
        if self.system.straggler_steps == "uniform":
            return int(rng.integers(1, full + 1))
        per_pass = max(1, math.ceil(self.sizes[cid] / self.cfg.train.batch_size))
        return int(rng.integers(1, int(self.cfg.train.local_epochs))) * per_pass

    def judge(self, rnd: int, client: ClientPlan) -> None:
        """The client's fate under the straggler policy, the deadline and a dropout."""
        system, partial = self.system, self.system.straggler_policy == "partial"
        if client.straggler and not partial:
            client.status = STRAGGLER
        deadline = system.deadline
        if client.status == KEPT and deadline is not None and client.arrival > deadline:
            fits = 0
            if partial:
                left = deadline - float(self.comm[client.cid])
                speed = float(self.profiles.speed[client.cid])
                fits = steps_within(left, self.sizes[client.cid], self.cfg.train.batch_size, speed, client.steps)
            if fits:
                client.steps, client.arrival = fits, self.arrival(client.cid, fits)
            else:
                client.status = LATE
        # drawn for every client, whatever happened above, so one client's draw never shifts another's
        failed = system.dropout > 0 and self.uniform(rnd, client.cid, DROPOUT_STREAM) < system.dropout
        if client.status == KEPT and failed:
            client.status = FAILED

    def keep_first(self, plan: RoundPlan, target: int) -> None:
        """Keep the first ``target`` replies to arrive (ties by client); set the round's duration."""
        arrived = sorted((c for c in plan.clients if c.status == KEPT), key=lambda c: (c.arrival, c.cid))
        for client in arrived[target:]:
            client.status = SURPLUS
        kept = arrived[:target]
        waited = [c.arrival for c in kept]
        if len(kept) < target:  # short of clients: the server also waited for the failed and the late ones
            deadline = self.system.deadline
            for c in plan.clients:
                if c.status == FAILED:
                    waited.append(deadline if deadline is not None else c.arrival)
                elif c.status == LATE:
                    waited.append(float(deadline))
        plan.duration = max(waited, default=0.0)

    def lost_updates(self, plan: RoundPlan) -> dict[str, int]:
        """What the system model took from round ``plan``, phrased for a run's error (``health.describe_losses``)."""
        out: dict[str, int] = {}
        if not plan.online:
            out[f"round(s) with no client online (system.availability={self.system.availability!r})"] = 1
        for client in plan.clients:
            if client.status in (STRAGGLER, LATE, FAILED):
                what = loss_phrase(self.system, client.status)
                out[what] = out.get(what, 0) + 1
        return out

    def finish(self, plan: RoundPlan) -> None:
        """The round is over: the clock moves on by its duration."""
        self.time = plan.start + plan.duration

    def describe(self) -> dict[str, Any]:
        """system_profiles.json: what the clock of every round is computed from, beside each round's plan in
        clients.jsonl. Per client: its training samples, full local steps, speed (samples/s), bandwidth (bytes/s
        each way), and where drawn its availability (trace) or its place in the day at time 0 (daily)."""
        profiles, availability = self.profiles, self.system.availability
        clients = []
        for cid, samples in enumerate(self.sizes):
            client = {
                "client": cid,
                "samples": samples,
                "full_steps": self.full[cid],
                "speed": float(profiles.speed[cid]),
                "bandwidth": float(profiles.bandwidth[cid]),
            }
            if profiles.availability is not None:
                client["availability"] = float(profiles.availability[cid])
            if availability == "daily":
                client["day_offset"] = float(self.day_offsets[cid])
            if self.client_bytes is not None:
                client["model_bytes"] = int(self.client_bytes[cid])
            clients.append(client)
        return {
            "profiles": self.system.profiles,
            **({"trace_sha256": profiles.trace_sha256} if profiles.trace_sha256 else {}),
            "clients_per_round": self.cfg.clients_per_round(),
            "batch_size": self.cfg.train.batch_size,
            "model_bytes": self.model_bytes,
            "phases": self.phases,
            "latency": self.system.latency,
            "deadline": self.system.deadline,
            "clients": clients,
        }

    # ------------------------------------------------------------------ messages and checkpoints
    @staticmethod
    def limit(msgs: dict[int, Message], budgets: dict[int, int]) -> dict[int, Message]:
        """The messages with each budgeted client's step budget (``STEP_BUDGET``), which the local loop honours.
        Tensors stay shared; only the budgeted clients' messages are new objects."""
        out = dict(msgs)
        for cid, steps in budgets.items():
            if cid in out:
                msg = out[cid]
                out[cid] = Message(tensors=msg.tensors, scalars={**msg.scalars, STEP_BUDGET: steps})
        return out

    def state_dict(self) -> dict[str, Any]:
        trace = {"trace_sha256": self.profiles.trace_sha256} if self.profiles.trace_sha256 else {}
        return {"system": {"time": self.time, **trace}}

    def check_resumable(self, state: dict[str, Any]) -> None:
        """Refuse (changing nothing) a checkpoint whose trace file had other bytes than the file now has."""
        before, now = state.get("system", {}).get("trace_sha256"), self.profiles.trace_sha256
        if before is not None and before != now:
            # the profiles are read from the file: other bytes would give the resumed rounds other clients' speeds
            raise ConfigError(
                f"system.trace {self.system.trace!r} has changed since the run was checkpointed (sha256 "
                f"{before[:12]}..., now {(now or 'none')[:12]}...); put the original file back or start a new run"
            )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.time = float(state.get("system", {}).get("time", 0.0))


def loss_phrase(system: SystemSection, status: str) -> str:
    """How a run's error names the updates the system model took: dropped stragglers, late replies, dropouts."""
    if status == STRAGGLER:
        return f"stragglers dropped (system.stragglers={system.stragglers:g}, straggler_policy='drop')"
    if status == LATE:
        return f"replies later than system.deadline={system.deadline:g} s"
    return f"updates lost to system.dropout={system.dropout:g}"


def model_bytes(params: Any, buffers: Any) -> int:
    """Bytes of the exchanged model: its flat parameters and buffers."""
    return int(params.numel() * params.element_size() + buffers.numel() * buffers.element_size())


def build_system(cfg: Config, fed: Any, flat: Any, phases: int) -> SystemModel | None:
    """The run's system model from ``[system]``; None when ``system.profiles = "none"``."""
    if not cfg.system.active:
        return None
    sizes = [len(client) for client in fed.clients]
    total = model_bytes(flat.params, flat.buffers)
    ranks, client_bytes = client_lora_ranks(cfg, len(sizes)), None
    if ranks is not None:  # a client of rank r moves its first r adapter slots, not the masked ones
        from fedhet.toolkit.lora import masked_slots

        size = flat.params.element_size()
        client_bytes = [total - size * masked_slots(flat, r) for r in ranks]
    return SystemModel(cfg, sizes, total, phases, client_bytes)

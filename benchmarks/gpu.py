"""Seconds per round on a GPU (docs/performance.md, "On a GPU"): fedhet's sequential and batched executors, bf16,
Flower's Ray simulation and a bare-torch floor, in one command.

    python benchmarks/gpu.py [--device cuda] [--flower] [--out runs/gpu-bench]   # the real shapes (CUDA)
    python benchmarks/gpu.py --small --device cpu                                # tiny shapes, seconds (the test)

Cases (each reports the median of rounds 2-6 in seconds per round, rounds per hour, peak device memory and the
mean GPU utilisation that ``nvidia-smi`` samples every 0.2 s while it runs):

(a) FedAvg, Fashion-MNIST (generated 1x28x28 images of the same size if its files are absent), 1,000 clients
    (Dirichlet 0.5), 100 a round, 1 local epoch, batch 64, ``convnet``: sequential, batched, a bare-torch sequential
    loop (the floor: the same SGD steps with nothing of fedhet around them) and, with ``--flower``, Flower 1.41's Ray
    simulation of a plain PyTorch ClientApp (one virtual SuperNode per client, fractional ``num_gpus``);
(b) the FedUFO protocol's shape (2NN, 100 clients, 10 a round, E = 10, B = 10) with FedAvg and SCAFFOLD;
(c) ResNet-18-GN (FedRCL's model) on CIFAR-10 (generated 3x32x32 images if absent), 100 clients, 10 a round,
    5 epochs, batch 50: sequential and batched, fp32 and bf16.

A round is timed from the server's configure to the end of aggregation (evaluation runs only after the last round
and is not timed), with the device synchronised at both ends. Writes ``gpu.json`` and ``gpu.md`` under ``--out``.

Memory is each runner's own: a case's federation (its clients' data on the device) is built when its first runner
starts and dropped before another case's runner is measured; every other reference is collected and the allocator's
cache emptied before the peak statistics are reset, and ``resident_mib`` records what was allocated when the runner
started (its case's data where an earlier runner of the case built it, nothing of other cases). Speed-ups
(sequential / batched seconds per round) are computed from the unrounded times.

``--profile`` (on in ``gpu_device.sh``) counts what case (a)'s runners launch in their second round: every non-view
aten op as a dispatch mode sees it (about one device kernel each; on any device) and, on CUDA, the kernels
``torch.profiler`` records; per round, per client and per local step (a group's step, batched).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from pathlib import Path

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # no calls home from Flower (read when flwr loads)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from fedhet.config import build_config  # noqa: E402
from fedhet.data.datasets.base import DATASETS, image_dataset  # noqa: E402
from fedhet.engine.simulation import Simulation, build_federation  # noqa: E402
from fedhet.errors import FedhetError  # noqa: E402
from fedhet.models import build_model  # noqa: E402
from fedhet.toolkit.local import batch_indices, derive_seed, num_local_steps  # noqa: E402

GENERATED = {"fmnist": (1, 28, 28, 60_000, 10_000), "cifar10": (3, 32, 32, 50_000, 10_000)}
SMALL = {"fmnist": (1, 28, 28, 600, 100), "cifar10": (3, 32, 32, 300, 100)}


def generated(name: str, shape: tuple[int, int, int, int, int]):
    """A loader of class-patterned uint8 images shaped like ``name``'s (the timing depends on shapes, not pixels)."""

    def load(data_dir=None, **params):
        c, h, w, n_train, n_test = shape
        rng = np.random.default_rng(0)
        pattern = rng.integers(0, 128, (10, c, h, w), dtype=np.uint8)

        def draw(n):
            y = rng.integers(0, 10, n)
            return pattern[y] + rng.integers(0, 128, (n, c, h, w), dtype=np.uint8), y

        return image_dataset(f"generated-{name}", draw(n_train), draw(n_test), 10, source=f"generated {shape}")

    return load


def dataset_for(name: str, small: bool) -> tuple[str, str]:
    """(dataset name to use, what it is): the real one where its files load, else a generated one of its shape."""
    if not small:
        try:
            from fedhet.data.datasets import load_dataset

            load_dataset(name)
            return name, name
        except (FedhetError, OSError, ImportError):
            pass
    gen = f"bench_{name}"
    if gen not in DATASETS:
        DATASETS.register(gen, f"generated images shaped like {name}")(
            generated(name, (SMALL if small else GENERATED)[name])
        )
    return gen, f"generated {name}-shaped images"


class TimedSimulation(Simulation):
    """Wall seconds of each round's phases, the device synchronised before each clock reading; with ``profile``
    (a ``Launches``), what round ``profile_round`` launches, and its clients."""

    def __init__(self, *args, profile: Launches | None = None, profile_round: int = 2, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.round_s: dict[int, float] = {}
        self.profile, self.profile_round = profile, profile_round
        self.profiled_clients: list[int] = []

    def run_phase(self, rnd, phase_idx, phase, cids, budgets=None):
        counting = self.profile is not None and rnd == self.profile_round
        sync(self.flat.params.device)
        start = time.perf_counter()
        with self.profile.count() if counting else nullcontext():
            result = super().run_phase(rnd, phase_idx, phase, cids, budgets)
            sync(self.flat.params.device)
        self.round_s[rnd] = self.round_s.get(rnd, 0.0) + time.perf_counter() - start
        if counting:
            self.profiled_clients += list(cids)
        return result


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Launches:
    """What a block launches on the device: the non-view aten ops a dispatch mode sees (each about one kernel; under
    vmap, the batched ops) and, on CUDA, the kernels ``torch.profiler`` records. Counting slows the block: its
    seconds are not the runner's."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.ops: Counter[str] = Counter()
        self.kernels: int | None = None

    @contextmanager
    def count(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        ops, device = self.ops, self.device.type

        class Count(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if not func.is_view and func.overloadpacket.__name__ not in METADATA_OPS and on_device(out, args):
                    ops[func.overloadpacket.__name__] += 1
                return out

        def on_device(out, args) -> bool:  # off a CPU run, host ops (a CPU generator's randperm) launch nothing
            leaves = torch.utils._pytree.tree_leaves((out, args))
            return any(isinstance(t, torch.Tensor) and t.device.type == device for t in leaves)

        profiler = None
        if self.device.type == "cuda":
            from torch.profiler import ProfilerActivity, profile

            profiler = profile(activities=[ProfilerActivity.CUDA])
        with profiler or nullcontext(), Count():
            yield
        if profiler is not None:
            self.kernels = sum(1 for e in profiler.events() if e.device_type.name == "CUDA")

    def summary(self, clients: int, steps: int, step: str) -> dict:
        """The counts per round, per client and per ``step`` (``steps`` of them in the round)."""
        total = sum(self.ops.values())
        per_step = None if self.kernels is None else self.kernels / max(steps, 1)
        return {
            "clients": clients,
            "steps": steps,
            "step": step,
            "ops_per_round": total,
            "ops_per_client": total / max(clients, 1),
            "ops_per_step": total / max(steps, 1),
            "cuda_kernels_per_round": self.kernels,
            "cuda_kernels_per_step": per_step,
            "top_ops": dict(self.ops.most_common(8)),
        }


METADATA_OPS = ("_unsafe_view", "lift_fresh")  # no kernel, though the schema does not mark them as views


class Utilisation:
    """Mean GPU utilisation (%) from ``nvidia-smi`` sampled every 0.2 s while the block runs; None without it."""

    def __init__(self, device: torch.device) -> None:
        self.on = device.type == "cuda" and shutil.which("nvidia-smi") is not None
        self.index = device.index if device.index is not None else 0
        self.samples: list[float] = []
        self._stop = threading.Event()

    def _sample(self) -> None:
        query = ["nvidia-smi", f"--id={self.index}", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"]
        while not self._stop.wait(0.2):
            try:
                self.samples.append(float(subprocess.run(query, capture_output=True, text=True, timeout=5).stdout))
            except (OSError, ValueError, subprocess.SubprocessError):
                return

    def __enter__(self) -> Utilisation:
        if self.on:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self.on:
            self._thread.join()

    @property
    def mean(self) -> float | None:
        return round(statistics.fmean(self.samples), 1) if self.samples else None


class Federations:
    """The federation of the case being run (its clients' data on the device): built at its case's first use, and
    dropped (``keep``) before a runner of another case is measured."""

    def __init__(self) -> None:
        self.key: str | None = None
        self.fed = None

    def get(self, key: str, cfg):
        if key != self.key:
            self.keep(key)
            self.fed, self.key = build_federation(cfg), key
        return self.fed

    def keep(self, key: str) -> None:
        """Drop the federation held unless it is ``key``'s."""
        if key != self.key:
            self.fed = self.key = None


def measure(device: torch.device, fn) -> dict:
    """Run ``fn() -> (round seconds, extra)`` and add the median of rounds 2-6, the memory allocated at its start
    and its peak (after every unreachable object is collected and the allocator's cache emptied), and the GPU's
    mean utilisation."""
    gc.collect()  # simulations and models of earlier runners, in reference cycles
    resident = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        resident = torch.cuda.memory_allocated(device) / 2**20
    with Utilisation(device) as util:
        rounds, extra = fn()
    later = rounds[1:6] or rounds
    s = statistics.median(later)
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    return {
        "s_per_round": s,
        "rounds_per_hour": 3600 / s,
        "resident_mib": resident,
        "peak_mib": peak,
        "gpu_util": util.mean,
        "rounds": rounds,
        **extra,
    }


# ---------------------------------------------------------------------- the runs
def config(args, name: str, dataset: str, clients: int, per_round: int, model: dict, train: dict, algo: str, **run):
    return build_config(
        {
            "run": {
                "name": name,
                "rounds": args.rounds,
                "out_dir": str(args.work),
                "progress": False,
                "seed": 0,
                "workers": 1,
                "device": args.device,
                "eval_every": args.rounds,
                **run,
            },
            "dataset": {"name": dataset},
            "partition": {"name": "dirichlet", "alpha": 0.5, "num_clients": clients, "min_size": 2},
            "model": model,
            "train": {"clients_per_round": per_round, "lr": 0.01, **train},
            "algorithm": {"name": algo},
        }
    )


def fedhet_run(cfg, fed, profile: bool = False, before: bool = False) -> tuple[list[float], dict]:
    """Seconds per round of a fedhet run (``before``: as the executors were before the launch work); with
    ``profile``, its second round run again, counted (``Launches``)."""
    with before_launch_work() if before else nullcontext():
        return timed_run(cfg, fed, profile)


def timed_run(cfg, fed, profile: bool) -> tuple[list[float], dict]:
    sim = TimedSimulation(cfg, fed=fed)
    summary = sim.run(overwrite=True)
    rounds = [sim.round_s[r] for r in sorted(sim.round_s)]
    extra = {"executor": sim.executor_kind, "final_test_acc": summary["final"]["test_acc"]}
    if profile:  # a run of its own: counting slows a round, and the timed run stays as it is
        name = f"{cfg.run.name}-profile"
        launches = Launches(torch.device(cfg.run.device))
        counted = cfg.model_copy(update={"run": cfg.run.model_copy(update={"rounds": 2, "name": name})})
        sim = TimedSimulation(counted, fed=fed, profile=launches, profile_round=2)
        sim.run(overwrite=True)
        extra["profile"] = profile_summary(launches, sim, fed)
    return rounds, extra


def profile_summary(launches: Launches, sim: TimedSimulation, fed) -> dict:
    """``launches`` per round, client and step: a client's local step (sequential) or a group's (batched: the
    clients of a group step together, a group takes as many steps as its longest client)."""
    t = sim.cfg.train
    steps = client_steps(fed, t, sim.profiled_clients)
    if sim.executor_kind != "batched":
        return launches.summary(len(steps), sum(steps), "client step")
    group = sim.executor.max_group or len(steps)
    ordered = sorted(steps, reverse=True)
    return launches.summary(len(steps), sum(ordered[::group]), "group step")


def bare_torch(cfg, fed, device: torch.device, profile: bool = False) -> tuple[list[float], dict]:
    """The floor: each round's clients one after another, plain torch SGD steps on device-resident data, their
    models averaged by size; no hooks, messages, state store or checks. With ``profile``, one more round, counted."""
    model = build_model(cfg.model.name, fed.input_shape, fed.num_classes, **cfg.model.params()).to(device)
    glob = [p.detach().clone() for p in model.parameters()]
    rng, rounds, extra = np.random.default_rng(0), [], {}
    n_per = cfg.clients_per_round()
    for rnd in range(cfg.run.rounds):
        sync(device)
        start = time.perf_counter()
        glob = bare_round(model, glob, fed, rng.choice(fed.num_clients, n_per, replace=False), cfg.train, rnd)
        sync(device)
        rounds.append(time.perf_counter() - start)
    if profile:  # untimed: counting slows it
        launches, cids = Launches(device), rng.choice(fed.num_clients, n_per, replace=False)
        with launches.count():
            bare_round(model, glob, fed, cids, cfg.train, cfg.run.rounds)
            sync(device)
        extra["profile"] = launches.summary(len(cids), sum(client_steps(fed, cfg.train, cids)), "client step")
    return rounds, {"executor": "bare torch", **extra}


def bare_round(model, glob: list[torch.Tensor], fed, cids, t, rnd: int) -> list[torch.Tensor]:
    """One round of ``bare_torch``: the new global parameters."""
    total = [torch.zeros_like(g) for g in glob]
    weight = sum(len(fed.clients[c]) for c in cids)
    for cid in cids:
        data = fed.clients[cid]
        with torch.no_grad():
            for p, g in zip(model.parameters(), glob, strict=True):
                p.copy_(g)
        opt = torch.optim.SGD(model.parameters(), lr=t.lr)
        gen = torch.Generator().manual_seed(derive_seed(0, rnd, int(cid)))
        steps = max(1, int(np.ceil(t.local_epochs * np.ceil(len(data) / t.batch_size))))
        for idx in batch_indices(len(data), t.batch_size, steps, gen, data.x.device):
            opt.zero_grad(set_to_none=False)
            F.cross_entropy(model(data.x[idx]), data.y[idx]).backward()
            opt.step()
        with torch.no_grad():
            for acc, p in zip(total, model.parameters(), strict=True):
                acc.add_(p, alpha=len(data) / weight)
    return total


def client_steps(fed, t, cids) -> list[int]:
    return [num_local_steps(len(fed.clients[c]), t.batch_size, t.local_epochs, t.local_steps) for c in cids]


def flower_run(cfg, fed, device: torch.device, gpus_per_client: float) -> tuple[list[float], dict]:
    """Flower 1.41's Ray simulation of a plain PyTorch ClientApp and the stock FedAvg strategy, on the same clients'
    data (saved once, each Ray worker loads it once) and model; a round is the time between the strategy's
    evaluate_fn calls (which it makes after every aggregation)."""
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation

    path = Path(cfg.run.out_dir) / "flower-data.pt"
    torch.save([(c.x.cpu(), c.y.cpu()) for c in fed.clients], path)
    shape, classes, model_name, params, t = (
        fed.input_shape,
        fed.num_classes,
        cfg.model.name,
        cfg.model.params(),
        cfg.train,
    )
    dev = str(device)
    client = ClientApp()
    cache: dict = {}

    @client.train()
    def train(msg: Message, context: Context) -> Message:
        if "data" not in cache:
            cache["data"] = torch.load(path)
            cache["model"] = build_model(model_name, shape, classes, **params).to(dev)
        x, y = (v.to(dev) for v in cache["data"][int(context.node_config["partition-id"])])
        model = cache["model"]
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        opt = torch.optim.SGD(model.parameters(), lr=t.lr)
        for _ in range(max(1, round(t.local_epochs))):
            for idx in torch.randperm(len(y), device=dev).split(t.batch_size):
                opt.zero_grad()
                F.cross_entropy(model(x[idx]), y[idx]).backward()
                opt.step()
        content = RecordDict(
            {"arrays": ArrayRecord(model.state_dict()), "metrics": MetricRecord({"num-examples": len(y)})}
        )
        return Message(content=content, reply_to=msg)

    stamps: list[float] = []
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        model = build_model(model_name, shape, classes, **params)
        strategy = FedAvg(fraction_train=cfg.clients_per_round() / fed.num_clients, fraction_evaluate=0.0)
        stamps.append(time.perf_counter())
        strategy.start(
            grid,
            ArrayRecord(model.state_dict()),
            num_rounds=cfg.run.rounds,
            train_config=ConfigRecord({}),
            evaluate_fn=lambda rnd, arrays: stamps.append(time.perf_counter()) or MetricRecord({}),
        )

    actors = max(1, int(1 / gpus_per_client)) if device.type == "cuda" else 1
    start = time.perf_counter()
    run_simulation(
        server_app=server,
        client_app=client,
        num_supernodes=fed.num_clients,
        backend_config={
            "client_resources": {"num_cpus": 1.0, "num_gpus": gpus_per_client if device.type == "cuda" else 0.0},
            "init_args": {"num_cpus": min(actors, os.cpu_count() or 1)},
        },
    )
    # stamps: strategy start, then evaluate_fn at round 0 (the initial model) and after every round
    rounds = [b - a for a, b in zip(stamps[1:], stamps[2:], strict=False)]
    return rounds, {
        "executor": f"flower ray, num_gpus {gpus_per_client} a client",
        "total_wall_s": time.perf_counter() - start,
    }


def with_executor(cfg, executor: str, name: str, compile_mode: str = "off"):
    """``cfg`` run by ``executor`` ("sequential" | "batched") under the run name ``name``, ``run.compile`` set."""
    run = {"executor": executor, "name": name, "compile": compile_mode}
    return cfg.model_copy(update={"run": cfg.run.model_copy(update=run)})


@contextmanager
def before_launch_work():
    """The executors as they were before the launch work (docs/performance.md, "Fewer launches per client"), for
    the "before" rows of one run: each client's row set from its message and its batch loaded on its own (a few ops
    per client and step), finiteness read tensor by tensor (on a GPU a wait each) and each client's global
    generators seeded with ``torch.manual_seed`` (which queues the seeding of every accelerator type with a
    formatted stack trace). Not restored: the shared model loaded with each client's row before training (one copy
    a client)."""
    from unittest import mock

    from fedhet.engine import batched, client

    def one_by_one(tensors):
        return [bool(torch.isfinite(t).all()) for t in tensors]

    with (
        mock.patch.object(batched._GroupData, "build", classmethod(lambda cls, members, device: None)),
        mock.patch.object(batched, "_common_start", lambda members, params: None),
        mock.patch.object(batched, "all_finite", one_by_one),
        mock.patch.object(client, "all_finite", one_by_one),
        mock.patch.object(client, "seed_global", lambda seed, device: torch.manual_seed(seed)),
    ):
        yield


def named(title: str, cases: str) -> bool:
    """Whether a comma-separated list of case names ("(a),(b)") names the case ``title``."""
    return any(part and part in title for part in cases.split(","))


def runners(args, feds: Federations, title: str, cfg, label: str = "", profile: bool = False) -> list[Case]:
    """The runners of one case: sequential and batched; with ``--before`` both as they were before the launch
    work; with ``--compile MODE``, batched with ``run.compile = MODE`` in the cases ``--compile-only`` names, and
    sequential with it in those ``--compile-sequential`` names."""
    variants = [("sequential", False, "off"), ("batched", False, "off")]
    if args.before:
        variants += [("sequential", True, "off"), ("batched", True, "off")]
    if args.compile != "off" and named(title, args.compile_only):
        variants.append(("batched", False, args.compile))
    if args.compile != "off" and named(title, args.compile_sequential):
        variants.append(("sequential", False, args.compile))
    out = []
    for ex, before, mode in variants:
        words = (ex, label, "before" if before else "", "compiled" if mode != "off" else "")
        c = with_executor(cfg, ex, f"{cfg.run.name}-{'-'.join(w for w in words if w)}", mode)
        run = lambda c=c, before=before: fedhet_run(c, feds.get(key(c), c), profile, before)  # noqa: E731
        out.append((title, " ".join(w for w in words if w), key(c), run))
    return out


# ---------------------------------------------------------------------- the cases
Case = tuple[str, str, str, Callable[[], tuple[list[float], dict]]]  # title, runner, federation key, run


def key(cfg) -> str:
    """What a federation depends on here (every case partitions by Dirichlet 0.5 with seed 0): runners of cases
    that share it share one federation, and their memory its data."""
    return f"{cfg.dataset.name}, {cfg.partition.num_clients} clients"


def cases(args, feds: Federations) -> list[Case]:
    """Every runner of every case, in order; a runner builds its case's federation when it runs (``feds``)."""
    device, small, profile = torch.device(args.device), args.small, args.profile
    fm, fm_what = dataset_for("fmnist", small)
    cf, cf_what = dataset_for("cifar10", small)
    out = []
    # (a)
    clients, per_round = (20, 10) if small else (1000, 100)
    model_a = {"name": "convnet", "channels": [8, 16], "hidden": 32} if small else {"name": "convnet"}
    cfg = config(args, "a", fm, clients, per_round, model_a, {"local_epochs": 1, "batch_size": 64}, "fedavg")
    a = f"(a) FedAvg convnet, {fm_what}, {per_round}/{clients} clients, E=1, B=64"
    out += runners(args, feds, a, cfg, profile=profile)
    out.append((a, "bare torch", key(cfg), lambda: bare_torch(cfg, feds.get(key(cfg), cfg), device, profile)))
    flower = (a, "flower", key(cfg), lambda: flower_run(cfg, feds.get(key(cfg), cfg), device, args.client_gpus))
    # (b)
    clients, per_round, epochs = (20, 4, 2) if small else (100, 10, 10)
    for algo in ("fedavg", "scaffold"):
        cfg_b = config(
            args,
            f"b-{algo}",
            fm,
            clients,
            per_round,
            {"name": "mlp", "hidden": [200, 200]},
            {"local_epochs": epochs, "batch_size": 10},
            algo,
        )
        b = f"(b) {algo} 2NN, {fm_what}, {per_round}/{clients} clients, E={epochs}, B=10"
        out += runners(args, feds, b, cfg_b)
    # (c)
    clients, per_round, epochs = (10, 4, 1) if small else (100, 10, 5)
    model_c = {"name": "resnet18", "width": 4 if small else 64}
    for prec in ("fp32", "bf16"):
        cfg_c = config(
            args,
            f"c-{prec}",
            cf,
            clients,
            per_round,
            model_c,
            {"local_epochs": epochs, "batch_size": 50, "precision": prec, "momentum": 0.9},
            "fedavg",
        )
        c_name = f"(c) FedAvg ResNet-18-GN, {cf_what}, {per_round}/{clients} clients, E={epochs}, B=50"
        out += runners(args, feds, c_name, cfg_c, label=prec)
    out += changed_losses(args, feds, cf, cf_what, model_c) + sweep(args, feds, fm, fm_what, cf, cf_what, model_c)
    return out + ([flower] if args.flower else [])  # last: Ray's start is the slowest and least predictable part


def changed_losses(args, feds: Federations, cf: str, cf_what: str, model_c: dict) -> list[Case]:
    """(d) methods whose client loss is not plain cross-entropy (the batched executor's functional losses): MOON
    (a second and third forward pass, the previous and the global model) and FedRCL (supervised contrastive terms
    over the batch's features), on (c)'s ResNet-18-GN."""
    clients, per_round, epochs = (10, 4, 1) if args.small else (100, 10, 1)
    out = []
    for algo in ("moon", "fedrcl"):
        cfg = config(
            args, f"d-{algo}", cf, clients, per_round, model_c,
            {"local_epochs": epochs, "batch_size": 50, "momentum": 0.9}, algo,
        )  # fmt: skip
        name = f"(d) {algo} ResNet-18-GN, {cf_what}, {per_round}/{clients} clients, E={epochs}, B=50"
        out += runners(args, feds, name, cfg)
    return out


def sweep(args, feds: Federations, fm: str, fm_what: str, cf: str, cf_what: str, model_c: dict) -> list[Case]:
    """(e) where batching starts to pay (the rule of ``run.executor = "auto"``): 2, 4, 8, 16 and 32 clients a round
    of 100 (Dirichlet 0.5), one epoch, for the 2NN (batch 10), ``convnet`` (batch 64) and ResNet-18-GN (batch 50)."""
    ks = (2, 4) if args.small else (2, 4, 8, 16, 32)
    models = [
        ("2NN", fm, fm_what, {"name": "mlp", "hidden": [200, 200]}, 10),
        (
            "convnet",
            fm,
            fm_what,
            {"name": "convnet"} if not args.small else {"name": "convnet", "channels": [8, 16]},
            64,
        ),
        ("ResNet-18-GN", cf, cf_what, model_c, 50),
    ]
    out = []
    for label, data, what, model, batch in models:
        cfg0 = config(args, f"e-{label}", data, 20 if args.small else 100, 2, model, {"batch_size": batch}, "fedavg")
        for k in ks:
            cfg = cfg0.model_copy(update={"train": cfg0.train.model_copy(update={"clients_per_round": k})})
            name = f"(e) FedAvg {label}, {what}, {k}/{cfg.partition.num_clients} clients, E=1, B={batch}"
            out += runners(
                args, feds, name, cfg.model_copy(update={"run": cfg.run.model_copy(update={"name": f"e-{label}-{k}"})})
            )
    return out


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"


def table(results: list[dict]) -> str:
    lines = [
        "| case | runner | s / round | rounds / h | resident MiB | peak MiB | GPU util % | executor |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['runner']} | failed: {r['error']} | | | | | |")
            continue
        resident, peak = (f"{r[k]:.0f}" if r.get(k) is not None else "-" for k in ("resident_mib", "peak_mib"))
        util = r["gpu_util"] if r["gpu_util"] is not None else "-"
        lines.append(
            f"| {r['case']} | {r['runner']} | {r['s_per_round']:.3f} | {r['rounds_per_hour']:.0f} | {resident} |"
            f" {peak} | {util} | {r['executor']} |"
        )
    return "\n".join(lines)


def speedups(results: list[dict]) -> list[dict]:
    """Each case's sequential / batched seconds per round at the same precision, from the unrounded medians."""
    done = {(r["case"], r["runner"]): r for r in results if "error" not in r}
    out = []
    for (case, runner), bat in done.items():
        kind, *rest = runner.split()
        seq = done.get((case, " ".join(["sequential", *(w for w in rest if w != "compiled")])))
        if kind == "batched" and seq is not None:
            ratio = seq["s_per_round"] / bat["s_per_round"]
            out.append({"case": case, "runner": runner, "sequential": seq["runner"], "speedup": ratio})
    return out


def profile_table(results: list[dict]) -> str:
    """What case (a)'s runners launch in a round (``--profile``), per client and per step."""
    lines = [
        "| runner | clients | steps | ops / round | ops / client | ops / step | CUDA kernels / step | top ops |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "profile" not in r:
            continue
        p = r["profile"]
        kernels = f"{p['cuda_kernels_per_step']:.0f}" if p["cuda_kernels_per_step"] is not None else "-"
        top = ", ".join(f"{name} {n}" for name, n in list(p["top_ops"].items())[:4])
        lines.append(
            f"| {r['runner']} | {p['clients']} | {p['steps']} ({p['step']}) | {p['ops_per_round']} |"
            f" {p['ops_per_client']:.1f} | {p['ops_per_step']:.1f} | {kernels} | {top} |"
        )
    return "\n".join(lines) if len(lines) > 2 else ""


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="tiny shapes, 3 rounds: runs on a CPU in seconds")
    ap.add_argument("--flower", action="store_true", help="also Flower's Ray simulation in case (a)")
    ap.add_argument("--client-gpus", type=float, default=0.1, help="Flower: num_gpus of each ClientApp actor")
    ap.add_argument("--rounds", type=int, default=None, help="default 6 (3 with --small); rounds 2-6 are timed")
    ap.add_argument("--only", default="", help="run only the cases whose title contains this text, e.g. '(a)'")
    ap.add_argument("--profile", action="store_true", help="count what case (a)'s runners launch in a round")
    ap.add_argument("--before", action="store_true", help="also each case's runners as before the launch work")
    ap.add_argument(
        "--compile", default="off", choices=["off", "default", "reduce-overhead", "max-autotune"],
        help="also a batched runner with run.compile = this, in the cases --compile-only names",
    )  # fmt: skip
    ap.add_argument("--compile-only", default="(a),(b)", help="cases with a compiled runner (comma-separated)")
    ap.add_argument(
        "--compile-sequential", default="", help="cases with a compiled sequential runner too (comma-separated)"
    )
    ap.add_argument("--out", type=Path, default=Path("runs/gpu-bench"))
    args = ap.parse_args(argv)
    args.rounds = args.rounds or (3 if args.small else 6)
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as work:
        args.work = Path(work)
        results, report, feds = [], write(args, device, []), Federations()
        for case, runner, fed_key, fn in cases(args, feds):
            if args.only not in case:
                continue
            print(f"{case}: {runner} ...", flush=True)
            feds.keep(fed_key)  # another case's data goes before the reading
            try:
                results.append({"case": case, "runner": runner, **measure(device, fn)})
            except Exception as err:  # one failing runner (e.g. Flower's Ray) must not lose the others' numbers
                results.append({"case": case, "runner": runner, "error": f"{type(err).__name__}: {err}"[:200]})
            print(table(results[-1:]).splitlines()[-1], flush=True)
            report = write(args, device, results)  # after every runner: a timeout keeps what finished
    print((args.out / "gpu.md").read_text())
    return report


def write(args, device: torch.device, results: list[dict]) -> dict:
    report = {
        "device": device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "small": args.small,
        "results": results,
        "speedups": speedups(results),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu.json").write_text(json.dumps(report, indent=1))
    timed = f"rounds 2-{min(args.rounds, 6)}" if args.rounds > 1 else "round 1"
    cuda = f", CUDA {report['cuda']}" if report["cuda"] and device.type == "cuda" else ""
    md = f"Device: {report['device']}; torch {report['torch']}{cuda}; median of {timed}.\n\n{table(results)}\n"
    if report["speedups"]:
        rows = "".join(
            f"| {r['case']} | {r['runner']} | {r['sequential']} | {r['speedup']:.2f}x |\n" for r in report["speedups"]
        )
        head = "| case | batched runner | against | speed-up |\n|---|---|---|---|\n"
        md += f"\nSequential / batched seconds per round (from the unrounded times):\n\n{head}{rows}"
    if profile_table(results):
        md += f"\nWhat a round launches (an extra, untimed round):\n\n{profile_table(results)}\n"
    (args.out / "gpu.md").write_text(md)
    return report


if __name__ == "__main__":
    main()

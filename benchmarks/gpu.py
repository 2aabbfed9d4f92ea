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
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
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
from fedhet.toolkit.local import batch_indices, derive_seed  # noqa: E402

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
    """Wall seconds of each round's phases, the device synchronised before each clock reading."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.round_s: dict[int, float] = {}

    def run_phase(self, rnd, phase_idx, phase, cids, budgets=None):
        sync(self.flat.params.device)
        start = time.perf_counter()
        result = super().run_phase(rnd, phase_idx, phase, cids, budgets)
        sync(self.flat.params.device)
        self.round_s[rnd] = self.round_s.get(rnd, 0.0) + time.perf_counter() - start
        return result


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def measure(device: torch.device, fn) -> dict:
    """Run ``fn() -> (round seconds, extra)`` and add the median of rounds 2-6, peak memory and utilisation."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    with Utilisation(device) as util:
        rounds, extra = fn()
    later = rounds[1:6] or rounds
    s = statistics.median(later)
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    return {
        "s_per_round": s,
        "rounds_per_hour": 3600 / s,
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


def fedhet_run(cfg, fed) -> tuple[list[float], dict]:
    sim = TimedSimulation(cfg, fed=fed)
    summary = sim.run(overwrite=True)
    rounds = [sim.round_s[r] for r in sorted(sim.round_s)]
    return rounds, {"executor": sim.executor_kind, "final_test_acc": summary["final"]["test_acc"]}


def bare_torch(cfg, fed, device: torch.device) -> tuple[list[float], dict]:
    """The floor: each round's clients one after another, plain torch SGD steps on device-resident data, their
    models averaged by size; no hooks, messages, state store or checks."""
    model = build_model(cfg.model.name, fed.input_shape, fed.num_classes, **cfg.model.params()).to(device)
    glob = [p.detach().clone() for p in model.parameters()]
    rng, t, rounds = np.random.default_rng(0), cfg.train, []
    n_per = cfg.clients_per_round()
    for rnd in range(cfg.run.rounds):
        sync(device)
        start = time.perf_counter()
        cids = rng.choice(fed.num_clients, n_per, replace=False)
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
        glob = total
        sync(device)
        rounds.append(time.perf_counter() - start)
    return rounds, {"executor": "bare torch"}


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


def with_executor(cfg, executor: str, name: str):
    """``cfg`` run by ``executor`` ("sequential" | "batched") under the run name ``name``."""
    return cfg.model_copy(update={"run": cfg.run.model_copy(update={"executor": executor, "name": name})})


# ---------------------------------------------------------------------- the cases
def cases(args) -> list[tuple[str, str, callable]]:
    device, small = torch.device(args.device), args.small
    fm, fm_what = dataset_for("fmnist", small)
    cf, cf_what = dataset_for("cifar10", small)
    out = []
    # (a)
    clients, per_round = (20, 10) if small else (1000, 100)
    model_a = {"name": "convnet", "channels": [8, 16], "hidden": 32} if small else {"name": "convnet"}
    cfg = config(args, "a", fm, clients, per_round, model_a, {"local_epochs": 1, "batch_size": 64}, "fedavg")
    fed = build_federation(cfg)
    a = f"(a) FedAvg convnet, {fm_what}, {per_round}/{clients} clients, E=1, B=64"
    for ex in ("sequential", "batched"):
        c = with_executor(cfg, ex, f"a-{ex}")
        out.append((a, ex, lambda c=c: fedhet_run(c, fed)))
    out.append((a, "bare torch", lambda: bare_torch(cfg, fed, device)))
    flower = (a, "flower", lambda: flower_run(cfg, fed, device, args.client_gpus))
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
        fed_b = build_federation(cfg_b)
        b = f"(b) {algo} 2NN, {fm_what}, {per_round}/{clients} clients, E={epochs}, B=10"
        for ex in ("sequential", "batched"):
            c = with_executor(cfg_b, ex, f"b-{algo}-{ex}")
            out.append((b, ex, lambda c=c, f=fed_b: fedhet_run(c, f)))
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
        fed_c = build_federation(cfg_c)
        c_name = f"(c) FedAvg ResNet-18-GN, {cf_what}, {per_round}/{clients} clients, E={epochs}, B=50"
        for ex in ("sequential", "batched"):
            c = with_executor(cfg_c, ex, f"c-{prec}-{ex}")
            out.append((c_name, f"{ex} {prec}", lambda c=c, f=fed_c: fedhet_run(c, f)))
    out += changed_losses(args, cf, cf_what, model_c) + sweep(args, fm, fm_what, cf, cf_what, model_c)
    return out + ([flower] if args.flower else [])  # last: Ray's start is the slowest and least predictable part


def changed_losses(args, cf: str, cf_what: str, model_c: dict) -> list[tuple[str, str, callable]]:
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
        fed = build_federation(cfg)
        name = f"(d) {algo} ResNet-18-GN, {cf_what}, {per_round}/{clients} clients, E={epochs}, B=50"
        for ex in ("sequential", "batched"):
            c = with_executor(cfg, ex, f"d-{algo}-{ex}")
            out.append((name, ex, lambda c=c, f=fed: fedhet_run(c, f)))
    return out


def sweep(args, fm: str, fm_what: str, cf: str, cf_what: str, model_c: dict) -> list[tuple[str, str, callable]]:
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
        fed = build_federation(cfg0)
        for k in ks:
            cfg = cfg0.model_copy(update={"train": cfg0.train.model_copy(update={"clients_per_round": k})})
            name = f"(e) FedAvg {label}, {what}, {k}/{cfg.partition.num_clients} clients, E=1, B={batch}"
            for ex in ("sequential", "batched"):
                c = with_executor(cfg, ex, f"e-{ex}")
                out.append((name, ex, lambda c=c, f=fed: fedhet_run(c, f)))
    return out


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"


def table(results: list[dict]) -> str:
    lines = [
        "| case | runner | s / round | rounds / h | peak MiB | GPU util % | executor |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['runner']} | failed: {r['error']} | | | | |")
            continue
        peak = f"{r['peak_mib']:.0f}" if r["peak_mib"] is not None else "-"
        util = r["gpu_util"] if r["gpu_util"] is not None else "-"
        lines.append(
            f"| {r['case']} | {r['runner']} | {r['s_per_round']:.3f} | {r['rounds_per_hour']:.0f} | {peak} | {util} |"
            f" {r['executor']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="tiny shapes, 3 rounds: runs on a CPU in seconds")
    ap.add_argument("--flower", action="store_true", help="also Flower's Ray simulation in case (a)")
    ap.add_argument("--client-gpus", type=float, default=0.1, help="Flower: num_gpus of each ClientApp actor")
    ap.add_argument("--rounds", type=int, default=None, help="default 6 (3 with --small); rounds 2-6 are timed")
    ap.add_argument("--only", default="", help="run only the cases whose title contains this text, e.g. '(a)'")
    ap.add_argument("--out", type=Path, default=Path("runs/gpu-bench"))
    args = ap.parse_args(argv)
    args.rounds = args.rounds or (3 if args.small else 6)
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as work:
        args.work = Path(work)
        results, report = [], write(args, device, [])
        for case, runner, fn in cases(args):
            if args.only not in case:
                continue
            print(f"{case}: {runner} ...", flush=True)
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
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu.json").write_text(json.dumps(report, indent=1))
    timed = f"rounds 2-{min(args.rounds, 6)}" if args.rounds > 1 else "round 1"
    cuda = f", CUDA {report['cuda']}" if report["cuda"] and device.type == "cuda" else ""
    md = f"Device: {report['device']}; torch {report['torch']}{cuda}; median of {timed}.\n\n{table(results)}\n"
    (args.out / "gpu.md").write_text(md)
    return report


if __name__ == "__main__":
    main()

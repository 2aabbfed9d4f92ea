"""Issue 29 on the CPU: no per-step host sync in either executor, batched models against the sequential loop, the
group size from memory, and train.precision = "bf16".

A host sync is any call that makes the host wait for a device value: ``Tensor.item``/``tolist``/``__float__``/
``__int__``/``__bool__``/``nonzero``/``cpu``/``numpy``. On the CPU nothing waits, so the test counts those calls
instead and asserts that a client's local training makes as many with 4 local steps as with 16: what is read per
client (its reply's checks, its loss sum once) stays, what would be read per step would grow. tests/test_cuda.py
checks the same with ``torch.cuda.set_sync_debug_mode("error")`` where a GPU exists.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedhet.config import RESUMABLE_CHANGES
from fedhet.data.datasets.base import DATASETS, image_dataset
from fedhet.engine import batched
from fedhet.engine.batched import BatchedExecutor, group_size, model_unbatchable
from fedhet.engine.client import LocalExecutor
from fedhet.engine.simulation import Simulation

REL = 1e-5
SYNCS = ("item", "tolist", "__float__", "__int__", "__bool__", "nonzero", "cpu", "numpy")
TRAIN = {"participation": 1.0, "momentum": 0.9, "weight_decay": 1e-3, "grad_clip": 2.0}


@pytest.fixture
def count_syncs(monkeypatch):
    counts = {"n": 0}
    for name in SYNCS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            counts["n"] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return counts


def phase_syncs(tiny_config, counts, executor: str, steps: int, algorithm: str) -> int:
    sim = Simulation(
        tiny_config(
            run={"name": f"{executor}{steps}"}, train={**TRAIN, "local_steps": steps}, algorithm={"name": algorithm}
        )
    )
    runner = sim.executor.runner
    msgs = sim.algo.configure(1, list(range(sim.fed.num_clients)), "train")
    ex = (
        LocalExecutor(runner, sim.fed.clients) if executor == "sequential" else BatchedExecutor(runner, sim.fed.clients)
    )
    before = counts["n"]
    replies, failures = ex.run_phase(1, 0, "train", msgs)
    assert not failures and all(r.metrics["steps"] == steps for r in replies.values())
    return counts["n"] - before


@pytest.mark.parametrize("executor", ["sequential", "batched"])
@pytest.mark.parametrize("algorithm", ["fedavg", "scaffold"])
def test_local_training_reads_nothing_per_step(tiny_config, count_syncs, executor, algorithm):
    few = phase_syncs(tiny_config, count_syncs, executor, 4, algorithm)
    many = phase_syncs(tiny_config, count_syncs, executor, 16, algorithm)
    assert few == many


# ---------------------------------------------------------------------- models
def generated_images(data_dir=None, **params) -> object:
    """48 training and 24 test images of shape (3, 32, 32), each class a fixed pattern plus noise."""
    rng = np.random.default_rng(0)
    pattern = rng.integers(0, 256, (4, 3, 32, 32))
    y_tr, y_te = np.arange(48) % 4, np.arange(24) % 4

    def draw(y):
        return np.clip(pattern[y] * 0.5 + rng.integers(0, 128, (len(y), 3, 32, 32)), 0, 255).astype(np.uint8)

    return image_dataset("images32", (draw(y_tr), y_tr), (draw(y_te), y_te), 4, source="generated in the test")


@pytest.fixture
def images(monkeypatch):
    monkeypatch.setattr(DATASETS, "_entries", dict(DATASETS._entries))  # the registration ends with the test
    DATASETS.register("images32", "generated CIFAR-shaped images")(generated_images)
    return {"name": "images32"}


MODELS = {
    "2nn": {"name": "mlp", "hidden": [200, 200]},  # FedUFO's and McMahan et al.'s 2NN
    "logreg": {"name": "logreg"},
    "lenet5": {"name": "lenet5"},
    "cnn": {"name": "cnn", "hidden": [32, 16]},
    "convnet": {"name": "convnet", "channels": [8, 16], "hidden": 32},
    "resnet18-gn": {"name": "resnet18", "width": 4},  # FedRCL's model, GroupNorm(2)
}
# ResNet-18-GN: a grouped convolution's gradient differs from the plain one by about 3e-6 of its largest entry
# (measured, width 4), but one client of this federation (16 samples) gets an update that differs by 6e-3 of its
# largest entry after a single step (loss identical), before and after issue 29's changes: consistent with a
# pre-activation that rounding moves across a ReLU's kink. So the ResNet is held to 1e-3 of the parameters over 2
# steps, the loss to 1e-4; the other models to 1e-5 over a full pass.
TOLERANCE = {"resnet18-gn": (1e-3, 1e-4)}
STEPS = {"resnet18-gn": 2}


@pytest.mark.parametrize("name", MODELS)
def test_batched_models_give_the_sequential_replies(tiny_config, images, name):
    model, steps = MODELS[name], STEPS.get(name)
    rel, rel_loss = TOLERANCE.get(name, (REL, REL))
    sim = Simulation(
        tiny_config(
            dataset=images,
            partition={"name": "dirichlet", "alpha": 0.5, "num_clients": 4, "min_size": 5},
            model=model,
            train={**TRAIN, "batch_size": 8, "lr": 0.05, "local_steps": steps},
            algorithm={"name": "fedavg"},
        )
    )
    assert model_unbatchable(sim.flat) is None
    runner = sim.executor.runner
    msgs = sim.algo.configure(1, list(range(sim.fed.num_clients)), "train")
    seq, _ = LocalExecutor(runner, sim.fed.clients).run_phase(1, 0, "train", msgs)
    bat_ex = BatchedExecutor(runner, sim.fed.clients)
    bat, failures = bat_ex.run_phase(1, 0, "train", msgs)
    assert bat_ex.last_phase_batched and not failures and seq.keys() == bat.keys()
    for cid, reply in seq.items():
        assert bat[cid].metrics["train_loss"] == pytest.approx(reply.metrics["train_loss"], rel=rel_loss)
        t = reply.tensors["params"]
        torch.testing.assert_close(bat[cid].tensors["params"], t, rtol=rel, atol=rel * float(t.abs().max()))


def test_dropout_stays_sequential_with_its_reason(tiny_config):
    sim = Simulation(tiny_config(model={"name": "mlp", "hidden": [32], "dropout": 0.5}))
    assert "dropout" in model_unbatchable(sim.flat)


# ---------------------------------------------------------------------- group size
def test_group_size_from_free_memory():
    gib = 1 << 30
    assert group_size(40 * gib, 100 << 20) == 204  # half of 40 GiB at 100 MiB a client
    assert group_size(1 * gib, 4 * gib) == 1  # never fewer than one client
    assert group_size(0, 1) == 1


def test_auto_group_reads_the_devices_free_memory(tiny_config, monkeypatch):
    sim = Simulation(tiny_config(train={"participation": 1.0}, run={"executor": "batched"}))
    ex = sim.executor
    assert isinstance(ex, BatchedExecutor) and ex.max_group == 0
    assert ex.auto_group() == batched.CPU_GROUP  # off a GPU: 32 as before
    per_client = batched.client_footprint(ex.runner, sim.fed.clients[0], sim.cfg.train.batch_size)
    assert per_client > batched.ROW_COPIES * sim.flat.num_params * 4
    monkeypatch.setattr(batched, "MEMORY_DEVICES", ("cpu",))  # pretend the CPU reports free memory like a GPU
    monkeypatch.setattr(batched, "available_memory", lambda device: (3 * per_client, "patched"))
    assert ex.auto_group() == 1
    monkeypatch.setattr(batched, "available_memory", lambda device: (10 * per_client, "patched"))
    assert ex.auto_group() == 5
    sim.run()  # groups of 5 for 6 clients: two groups, the same run as with any group size
    assert ex.max_group == 5 and ex.last_phase_batched


def test_explicit_max_group_is_used(tiny_config):
    sim = Simulation(tiny_config(run={"executor": "batched", "max_group": 2}))
    assert sim.executor.max_group == 2


# ---------------------------------------------------------------------- precision
def test_bf16_trains_in_both_executors_close_to_each_other(tiny_config):
    def run(executor, precision):
        sim = Simulation(
            tiny_config(
                run={"name": f"{executor}-{precision}", "rounds": 2, "executor": executor},
                train={**TRAIN, "precision": precision},
            )
        )
        sim.run()
        return sim.algo.global_params.clone(), sim

    fp32, _ = run("sequential", "fp32")
    seq, sim = run("sequential", "bf16")
    bat, sim_b = run("batched", "bf16")
    assert sim_b.executor.last_phase_batched
    assert not torch.equal(seq, fp32)  # the option acts
    scale = float(fp32.abs().max())
    assert float((seq - fp32).abs().max()) < 0.05 * scale  # and stays near fp32 training
    assert float((bat - seq).abs().max()) < 0.05 * scale
    assert torch.isfinite(seq).all() and seq.dtype == torch.float32  # weights stay fp32


def test_precision_is_not_a_resumable_change():
    assert "train.precision" not in RESUMABLE_CHANGES and "run.max_group" in RESUMABLE_CHANGES


def test_gpu_rule_batches_from_eight_clients_for_every_model(tiny_config):
    """The CUDA rule of "auto", from the H200 sweep (docs/performance.md): batched from 8 clients a round whatever
    the (batchable) model and batch size, here a fully connected and a convolutional one, sequential below; the CPU
    rule is not changed by it."""
    assert batched.AUTO_GPU_MIN_CLIENTS == 8
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for model in ({"name": "mlp", "hidden": [200, 200]}, {"name": "convnet", "channels": [8, 16], "hidden": 32}):
        sim = Simulation(tiny_config(model=model))
        assert batched.batching_pays_off(sim.flat, 64, 8, cuda) and batched.batching_pays_off(sim.flat, 10, 100, cuda)
        assert not batched.batching_pays_off(sim.flat, 64, 7, cuda) and not batched.batching_pays_off(
            sim.flat, 10, 2, cuda
        )
    assert not batched.batching_pays_off(sim.flat, 64, 100, cpu)  # the conv net (the last model) on a CPU: slower


def test_to_device_leaves_a_tensor_where_it_is_already():
    from fedhet.data.device import to_device

    t = torch.arange(5)
    assert to_device(t, None) is t and to_device(t, "cpu") is t and to_device(t, torch.device("cpu")) is t


def test_a_clients_global_seed_draws_what_torch_manual_seed_draws():
    """``seed_global`` (each client's context) seeds the CPU's global stream as ``torch.manual_seed`` does, so
    dropout and other global draws are what they were, without the per-call cost of queueing every accelerator's."""
    from fedhet.toolkit.local import seed_global

    torch.manual_seed(123)
    expected = torch.rand(5), torch.randn(3), torch.initial_seed()
    torch.manual_seed(0)
    seed_global(123, torch.device("cpu"))
    got = torch.rand(5), torch.randn(3), torch.initial_seed()
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]) and got[2] == expected[2]


def test_all_finite_reads_every_tensor_at_once_and_sees_what_isfinite_sees():
    from fedhet.engine.client import all_finite

    big = torch.full((1000,), 3e38)  # finite, though its sum (and norm) overflow to inf
    cases = [
        torch.ones(5),
        torch.tensor([1.0, float("nan")]),
        torch.tensor([float("inf"), 0.0]),
        torch.tensor([-float("inf")]),
        big,
        torch.empty(0),
        torch.tensor([1.0, 2.0], dtype=torch.bfloat16),
        torch.tensor([float("nan")], dtype=torch.float64),
    ]
    assert all_finite(cases) == [bool(torch.isfinite(t).all()) for t in cases]
    assert all_finite(cases) == [True, False, False, False, True, True, True, False]
    assert all_finite([]) == []

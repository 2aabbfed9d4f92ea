"""The clients' local optimisers (``train.optimizer``: sgd, adam, adamw) and their state across rounds
(``train.optimizer_state``): torch.optim's steps, hand-computed ones, reset vs kept, both executors, resume."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_algorithms_math import step_both
from torch.nn.utils import vector_to_parameters

from fedhet.algorithms import ALGORITHMS, Setup
from fedhet.algorithms.base import ClientContext, ClientData
from fedhet.api import make_config
from fedhet.config import TrainSection
from fedhet.engine.batched import BatchedExecutor
from fedhet.engine.client import LocalExecutor
from fedhet.engine.simulation import Simulation
from fedhet.engine.training import resolve_config
from fedhet.errors import ConfigError
from fedhet.models import build_model
from fedhet.results.store import read_metrics
from fedhet.toolkit.flat import FlatModel
from fedhet.toolkit.local import AdamSettings, FlatAdam, batch_indices, local_optimizer

KEYS = {"adam": {"exp_avg", "exp_avg_sq", "step"}, "adamw": {"exp_avg", "exp_avg_sq", "step"}, "sgd": {"momentum"}}


def vector(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


# ------------------------------------------------------------------------------------------------ the update itself
@pytest.mark.parametrize(("decoupled", "weight_decay"), [(False, 0.0), (False, 0.1), (True, 0.1)])
def test_first_adam_step_by_hand(decoupled, weight_decay):
    """Step 1 from zero moments: m = (1 - b1) g, v = (1 - b2) g^2, so the bias-corrected step is lr g / (|g| + eps);
    Adam adds wd w to g first, AdamW multiplies w by 1 - lr wd first."""
    w0 = torch.tensor([1.0, -2.0, 0.5])
    g = torch.tensor([0.3, -0.02, 4.0])
    lr, eps = 0.1, 1e-3
    view = type("View", (), {"params": w0.clone(), "grad": g.clone()})()
    FlatAdam(view, lr, (0.9, 0.99), eps, weight_decay, decoupled).step()
    if decoupled:
        expected = w0 * (1 - lr * weight_decay) - lr * g / (g.abs() + eps)
    else:
        g_l2 = g + weight_decay * w0
        expected = w0 - lr * g_l2 / (g_l2.abs() + eps)
    torch.testing.assert_close(view.params, expected)


@pytest.mark.parametrize(
    ("name", "weight_decay"), [("adam", 0.0), ("adam", 0.01), ("adamw", 0.01), ("adamw", 0.0)], ids=str
)
def test_adam_and_adamw_take_torch_steps_bit_for_bit(name, weight_decay):
    torch.manual_seed(0)
    model = build_model("mlp", (4,), 3, hidden=[37])
    ref = build_model("mlp", (4,), 3, hidden=[37])
    ref.load_state_dict(model.state_dict())
    flat = FlatModel(model)
    train = TrainSection(optimizer=name, lr=0.01, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=weight_decay)
    opt = local_optimizer(flat, 0.01, train)
    torch_cls = torch.optim.AdamW if name == "adamw" else torch.optim.Adam
    ref_opt = torch_cls(ref.parameters(), lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=weight_decay)
    step_both(model, flat, opt, ref, ref_opt, steps=5)
    assert torch.equal(flat.params, vector(ref))
    state = opt.state_dict()
    assert int(state["step"]) == 5
    ref_state = [ref_opt.state[p] for p in ref.parameters()]
    assert torch.equal(state["exp_avg_sq"], torch.cat([s["exp_avg_sq"].reshape(-1) for s in ref_state]))


def test_rows_with_their_own_step_counts_and_rates_step_as_each_alone():
    """The batched executor's form (one (m, 1) column of coefficients) equals each row's own vector step."""
    hp = AdamSettings((0.9, 0.999), 1e-8, 0.05, decoupled=True)
    gen = torch.Generator().manual_seed(0)
    params, grad = torch.randn(3, 50, generator=gen), torch.randn(3, 50, generator=gen)
    exp_avg, exp_avg_sq = torch.randn(3, 50, generator=gen), torch.rand(3, 50, generator=gen)
    lrs, steps = [0.01, 0.02, 0.01], [4, 1, 9]
    rows = [(p.clone(), a.clone(), s.clone()) for p, a, s in zip(params, exp_avg, exp_avg_sq, strict=True)]
    table = torch.tensor([hp.coefficients(lr, t) for lr, t in zip(lrs, steps, strict=True)])
    hp.update(params, grad, exp_avg, exp_avg_sq, tuple(table[:, i, None] for i in range(3)))
    for k, (p, a, s) in enumerate(rows):
        hp.update(p, grad[k], a, s, hp.coefficients(lrs[k], steps[k]))
        assert torch.equal(params[k], p) and torch.equal(exp_avg[k], a) and torch.equal(exp_avg_sq[k], s)


# ------------------------------------------------------------------------------------ state: reset or kept per client
def client_round(train: TrainSection, params: torch.Tensor, state: dict, seed: int):
    """One fedavg client update of a logistic regression on 10 fixed samples, from ``params``."""
    torch.manual_seed(0)
    model = build_model("logreg", (4,), 3)
    flat = FlatModel(model)
    x, y = torch.randn(10, 4), torch.randint(0, 3, (10,))
    setup = Setup(num_clients=1, num_classes=3, train=train, build_model=lambda: build_model("logreg", (4,), 3))
    entry = ALGORITHMS.get("fedavg")
    algo = entry.obj(entry.params(), setup)
    algo.init_server(params, flat.get_buffers())
    msg = algo.configure(1, [0], "train")[0]
    ctx = ClientContext(0, 1, "train", msg, ClientData(x, y, 3), state, model, flat, train, torch.Generator())
    ctx.generator.manual_seed(seed)
    return algo.client_update(ctx), ctx.state, (x, y)


def torch_steps(ref: torch.nn.Module, opt: torch.optim.Optimizer, data, seed: int, train: TrainSection) -> None:
    """The same mini-batches as the loop draws from the client's generator, stepped by torch.optim."""
    x, y = data
    for idx in batch_indices(len(y), train.batch_size, train.local_steps, torch.Generator().manual_seed(seed)):
        opt.zero_grad()
        F.cross_entropy(ref(x[idx]), y[idx]).backward()
        opt.step()


@pytest.mark.parametrize(
    "settings",
    [
        {"optimizer": "adam", "weight_decay": 0.01},
        {"optimizer": "adamw", "weight_decay": 0.1},
        {"optimizer": "sgd", "momentum": 0.9, "nesterov": True},
    ],
    ids=lambda s: s["optimizer"],
)
@pytest.mark.parametrize("kept", ["reset", "client"])
def test_state_is_reset_or_kept_across_two_rounds(settings, kept):
    """Two rounds of one client. Reset: round 2 is a fresh torch optimiser from the new global model; client: the
    same torch optimiser continues from where round 1 left it, and its state is in the client's state dict."""
    train = TrainSection(lr=0.05, batch_size=4, local_steps=3, optimizer_state=kept, **settings)
    gen = torch.Generator().manual_seed(7)
    w1, w2 = torch.randn(15, generator=gen), torch.randn(15, generator=gen)  # the two rounds' global models
    reply1, state, data = client_round(train, w1, {}, seed=1)
    reply2, state, _ = client_round(train, w2, state, seed=2)

    ref = build_model("logreg", (4,), 3)
    vector_to_parameters(w1, ref.parameters())

    def make_opt():
        if settings["optimizer"] == "sgd":
            return torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, nesterov=True)
        torch_cls = torch.optim.AdamW if settings["optimizer"] == "adamw" else torch.optim.Adam
        return torch_cls(ref.parameters(), lr=0.05, weight_decay=settings["weight_decay"])

    opt = make_opt()
    torch_steps(ref, opt, data, 1, train)
    assert torch.equal(reply1.tensors["params"], vector(ref))
    with torch.no_grad():  # the next round's global model, into the parameters the optimiser holds
        for p, new in zip(ref.parameters(), w2.split([p.numel() for p in ref.parameters()]), strict=True):
            p.copy_(new.view_as(p))
    torch_steps(ref, opt if kept == "client" else make_opt(), data, 2, train)
    assert torch.equal(reply2.tensors["params"], vector(ref))
    if kept == "reset":
        assert state == {}
        return
    assert set(state) == {f"optimizer.train.{k}" for k in KEYS[settings["optimizer"]]}
    if settings["optimizer"] != "sgd":
        assert int(state["optimizer.train.step"]) == 6  # 3 steps in each round


# ------------------------------------------------------------------------------------------------------ the config
@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"train.optimizer": "adam", "train.momentum": 0.9}, "train.momentum is sgd's"),
        ({"train.beta2": 0.99}, "train.beta2=0.99 (default 0.999) is a setting of optimizer 'adam' and 'adamw'"),
        ({"train.optimizer_state": "client"}, "sgd without momentum has none"),
        ({"train.optimizer": "rmsprop"}, "must be 'sgd', 'adam' or 'adamw'"),
        ({"train.optimizer": "adam", "algorithm.name": "scaffold"}, "scaffold estimates each client's mean"),
        ({"train.optimizer": "adamw", "algorithm.name": "fednova"}, "fednova divides each client's update by a_i"),
        ({"train.optimizer": "adam", "algorithm.name": "qfedavg"}, "qfedavg reads a client's update as a gradient"),
        (
            {"train.optimizer": "adam", "algorithm.name": "fedmeta", "algorithm.meta_momentum": 0.9},
            "algorithm.meta_momentum=0.9 is sgd's momentum",
        ),
    ],
    ids=["momentum-adam", "beta-sgd", "kept-plain-sgd", "unknown", "scaffold", "fednova", "qfedavg", "fedmeta"],
)
def test_settings_that_do_not_fit_are_one_line(overrides, words):
    with pytest.raises(ConfigError) as err:
        resolve_config(make_config(None, overrides=overrides))
    assert words in str(err.value) and "\n" not in str(err.value)


def test_algorithms_that_run_their_math_on_any_local_solver_accept_adam():
    for name in ("fedavg", "fedprox", "feddyn", "moon", "fml", "fedufo", "ditto", "pfedme", "fedmeta"):
        resolve_config(make_config(None, overrides={"train.optimizer": "adam", "algorithm.name": name}))


def test_the_cli_refuses_an_sgd_only_algorithm_with_adam(tmp_path, monkeypatch, capsys):
    """``fedhet run`` (the console script's ``main``): one ``error:`` line, exit 2, nothing written."""
    import sys

    from fedhet.cli import main

    args = ["run", "-d", "digits", "-a", "scaffold", "-s", "train.optimizer=adam", "-o", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", ["fedhet", *args])
    with pytest.raises(SystemExit) as info:
        main()
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert info.value.code == 2 and len(lines) == 1, err
    assert lines[0].startswith("error: train.optimizer='adam': scaffold"), err
    assert not any(tmp_path.iterdir())  # refused before anything is written


# ------------------------------------------------------------------------------------------------- runs on digits
ADAM = {"optimizer": "adam", "lr": 0.01, "weight_decay": 1e-4, "local_epochs": 2}


def test_adam_learns_and_resumes_bit_exact_with_states_kept(tiny_config, kill_and_resume):
    def make(name):
        return tiny_config(run={"name": name, "rounds": 4}, train={**ADAM, "optimizer_state": "client"})

    full, resumed = kill_and_resume(make)
    records = read_metrics(full.run_dir / "metrics.jsonl")
    assert records[-1]["test_acc"] > 0.8, records[-1]  # chance is 0.1; FedAvg with SGD at lr 0.1: 0.73
    assert records == [
        {**r, "elapsed_s": f["elapsed_s"]}
        for r, f in zip(read_metrics(resumed.run_dir / "metrics.jsonl"), records, strict=True)
    ]
    assert torch.equal(full.algo.global_params, resumed.algo.global_params)
    states = dict(full.executor.store.items())
    assert states and states.keys() == dict(resumed.executor.store.items()).keys()
    for cid, state in states.items():
        assert set(state) == {f"optimizer.train.{k}" for k in KEYS["adam"]}
        for name, t in state.items():
            assert torch.equal(t, resumed.executor.store.get(cid)[name]), (cid, name)
    counts = {int(s["optimizer.train.step"]) for s in states.values()}
    assert len(counts) > 1  # the clients took different numbers of steps (sizes, participation)


@pytest.mark.parametrize("kept", ["reset", "client"])
@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_batched_executor_trains_as_the_sequential_one(tiny_config, name, kept):
    """Three rounds, half the clients each (so kept states have different step counts in one group), unequal
    client sizes; the same tolerance as tests/test_batched.py (vmapped gradients round differently)."""
    sims = {}
    for executor in ("sequential", "batched"):
        train = {**ADAM, "optimizer": name, "optimizer_state": kept, "grad_clip": 2.0}
        sims[executor] = Simulation(tiny_config(run={"name": executor, "executor": executor}, train=train))
        sims[executor].run()
    seq, bat = sims["sequential"], sims["batched"]
    assert type(seq.executor) is LocalExecutor and type(bat.executor) is BatchedExecutor
    assert bat.executor.phase_batched == {"train": True}
    scale = float(seq.algo.global_params.abs().max())
    torch.testing.assert_close(bat.algo.global_params, seq.algo.global_params, rtol=1e-5, atol=1e-5 * scale)
    states_seq, states_bat = dict(seq.executor.store.items()), dict(bat.executor.store.items())
    assert states_seq.keys() == states_bat.keys()
    for cid, state in states_seq.items():
        assert state.keys() == states_bat[cid].keys()
        for key, t in state.items():
            atol = 1e-5 * float(t.abs().max()) if t.is_floating_point() else 0
            torch.testing.assert_close(states_bat[cid][key], t, rtol=1e-5, atol=atol)


def test_batched_adam_resumes_bit_exact(tiny_config, kill_and_resume):
    def make(name):
        run = {"name": name, "rounds": 3, "executor": "batched"}
        return tiny_config(run=run, train={**ADAM, "optimizer_state": "client"})

    full, resumed = kill_and_resume(make, stop_after=1)
    assert type(resumed.executor) is BatchedExecutor
    assert torch.equal(full.algo.global_params, resumed.algo.global_params)
    for cid, state in full.executor.store.items():
        for name, t in state.items():
            assert torch.equal(t, resumed.executor.store.get(cid)[name]), (cid, name)


def test_fml_private_optimiser_is_the_chosen_one_and_kept(tiny_config):
    """FML's private model steps with train.optimizer too, its state kept across rounds as its momentum was."""
    sim = Simulation(tiny_config(run={"rounds": 2}, train={**ADAM, "local_epochs": 1}, algorithm={"name": "fml"}))
    sim.run()
    states = dict(sim.executor.store.items())
    assert states
    for state in states.values():
        assert {"private_exp_avg", "private_exp_avg_sq", "private_step"} <= set(state)
        assert not any(k.startswith("optimizer.") for k in state)  # the meme model's optimiser: reset (default)


@pytest.mark.slow
def test_worker_processes_keep_the_states_as_in_process_clients(tiny_config):
    """A kept state goes out with a worker's task and comes back with the reply: the same bits as in-process."""
    sims = {}
    for workers in (1, 2):
        run = {"name": f"w{workers}", "workers": workers}
        sims[workers] = Simulation(tiny_config(run=run, train={**ADAM, "optimizer_state": "client"}))
        sims[workers].run()
    assert type(sims[2].executor).__name__ == "ProcessExecutor"
    assert torch.equal(sims[1].algo.global_params, sims[2].algo.global_params)
    states = {w: dict(sim.executor.store.items()) for w, sim in sims.items()}
    assert states[1].keys() == states[2].keys()
    for cid, state in states[1].items():
        assert all(torch.equal(t, states[2][cid][name]) for name, t in state.items())

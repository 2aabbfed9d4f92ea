"""q-FedAvg: the client's Delta_k and h_k, the h-normalised server step, q = 0 is FedAvg, and it learns."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fedhet.algorithms import Reply, Setup
from fedhet.algorithms.base import ClientContext, ClientData
from fedhet.algorithms.fedavg import FedAvg, FedAvgConfig
from fedhet.algorithms.qfedavg import QFedAvg, QFedAvgConfig
from fedhet.config import TrainSection
from fedhet.engine.simulation import Simulation
from fedhet.models import build_model
from fedhet.results.store import read_metrics
from fedhet.toolkit.flat import FlatModel

TRAIN = TrainSection(batch_size=8, local_steps=3, lr=0.2)


def make(cls, cfg):
    setup = Setup(4, num_classes=3, train=TRAIN, build_model=lambda: build_model("logreg", (4,), 3))
    return cls(cfg, setup)


def run_client(algo, x, data):
    algo.init_server(x.clone(), torch.zeros(0))
    model = build_model("logreg", (4,), 3)
    ctx = ClientContext(
        cid=0,
        round=1,
        phase="train",
        message=algo.configure(1, [0], "train")[0],
        data=data,
        state={},
        model=model,
        flat=FlatModel(model),
        train=TRAIN,
        generator=torch.Generator().manual_seed(7),
    )
    return algo.client_update(ctx), model


@pytest.mark.parametrize(("q", "h_norm"), [(1.0, "scaled"), (2.0, "scaled"), (1.0, "unscaled")])
def test_client_reply_matches_hand_computation(q, h_norm):
    torch.manual_seed(0)
    data = ClientData(torch.randn(20, 4), torch.randint(0, 3, (20,)), 3)
    x = torch.randn(FlatModel(build_model("logreg", (4,), 3)).num_params)
    reply, model = run_client(make(QFedAvg, QFedAvgConfig(q=q, h_norm=h_norm)), x, data)
    fedavg_reply, _ = run_client(make(FedAvg, FedAvgConfig()), x, data)  # same seed: the same local model x_k
    FlatModel(model).set_params(x)
    with torch.no_grad():
        loss = float(F.cross_entropy(model(data.x), data.y)) + 1e-10  # F_k at the received model
    lip = 1 / 0.2
    grad = lip * (x - fedavg_reply.tensors["params"])
    norm2 = float(grad.square().sum()) if h_norm == "scaled" else float((grad / lip).square().sum())
    torch.testing.assert_close(reply.tensors["delta"], loss**q * grad)
    assert reply.scalars["h"] == pytest.approx(q * loss ** (q - 1) * norm2 + lip * loss**q, rel=1e-5)
    assert "params" not in reply.tensors


@pytest.mark.parametrize(("weighting", "w"), [("uniform", (1.0, 1.0)), ("samples", (10.0, 30.0))])
def test_server_step_is_weighted_delta_sum_over_weighted_h_sum(weighting, w):
    algo = make(QFedAvg, QFedAvgConfig(weighting=weighting))
    algo.init_server(torch.tensor([1.0, -1.0]), torch.zeros(0))
    d0, d1 = torch.tensor([2.0, 0.0]), torch.tensor([-1.0, 4.0])
    replies = {
        0: Reply({"delta": d0}, {"h": 5.0}, num_examples=10),
        3: Reply({"delta": d1}, {"h": 3.0}, num_examples=30),
    }
    algo.aggregate(1, replies, "train")
    expected = torch.tensor([1.0, -1.0]) - (w[0] * d0 + w[1] * d1) / (w[0] * 5.0 + w[1] * 3.0)
    torch.testing.assert_close(algo.global_params, expected)


@pytest.mark.parametrize("weighting", ["uniform", "samples"])
def test_q_zero_is_fedavg(tiny_config, weighting):
    q = Simulation(
        tiny_config(run={"name": "q", "rounds": 2}, algorithm={"name": "qfedavg", "q": 0.0, "weighting": weighting})
    )
    f = Simulation(tiny_config(run={"name": "f", "rounds": 2}, algorithm={"name": "fedavg", "weighting": weighting}))
    q.run(), f.run()
    torch.testing.assert_close(q.algo.global_params, f.algo.global_params, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("h_norm", "threshold"), [("scaled", 0.35), ("unscaled", 0.75)])
def test_qfedavg_learns_on_digits(tiny_config, h_norm, threshold):
    # The q-FFL h (||L (x - x_k)||^2 with L = 1/lr) takes much shorter steps than the FedBC code's unscaled one.
    sim = Simulation(tiny_config(run={"rounds": 6}, algorithm={"name": "qfedavg", "q": 1.0, "h_norm": h_norm}))
    sim.run()
    accs = [r["test_acc"] for r in read_metrics(sim.run_dir / "metrics.jsonl")]
    assert accs[-1] > threshold and accs[-1] > accs[0] + 0.1, accs

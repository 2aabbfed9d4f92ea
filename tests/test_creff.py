"""CReFF: the clients' per-class head gradients, the gradient-matching distance, the server's aggregation of the
gradients, the re-trained classifier, FedAvg-identical local models, learning and resume."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from quadratic import client_context

from fedhet.algorithms import Reply, Setup
from fedhet.algorithms.base import ClientData
from fedhet.algorithms.creff import CReFF, CReFFConfig, HeadLayout, as_rows, head_grads, match_distance
from fedhet.algorithms.fedavg import FedAvg, FedAvgConfig
from fedhet.config import TrainSection
from fedhet.engine.client import ClientRunner
from fedhet.engine.simulation import Simulation
from fedhet.models import build_model
from fedhet.results.store import read_metrics
from fedhet.toolkit.flat import FlatModel

FAST = {"match_epochs": 20, "retrain_epochs": 30}  # the official 100 / 300 cost seconds per round on tiny runs


def logreg_algo(config: CReFFConfig, train: TrainSection | None = None) -> CReFF:
    """CReFF around multinomial logistic regression on 2 inputs, 3 classes: the body is the identity (flatten)."""
    train = train or TrainSection(batch_size=4, local_steps=1, lr=0.1)
    algo = CReFF(config, Setup(4, 3, train, lambda: build_model("logreg", (2,), 3)))
    torch.manual_seed(0)
    algo.init_server(FlatModel(build_model("logreg", (2,), 3)).get_params(), torch.zeros(0))
    return algo


def run_client(algo: CReFF, data: ClientData, train: TrainSection) -> tuple[Reply, torch.Tensor]:
    model = build_model("logreg", (2,), 3)
    ctx = client_context(algo.configure(1, [0], "train")[0], model, train, data=data)
    reply = algo.client_update(ctx)
    return reply, ctx.message.tensors["params"]


# ------------------------------------------------------------------------------------------- client side
X = torch.tensor([[1.0, 2.0], [3.0, -1.0], [0.5, 0.5], [-2.0, 1.0], [1.0, 1.0]])
Y = torch.tensor([0, 0, 2, 2, 2])  # class 1 absent


@pytest.mark.parametrize("weighting", ["uniform", "class_counts"])
def test_client_gradient_at_a_zero_head_is_the_class_mean_times_softmax_error(weighting):
    """At W = 0, b = 0 the softmax is 1/3 everywhere, so for class c: dW[i] = (1/3 - [i == c]) * mean(x of c) and
    db[i] = 1/3 - [i == c], whatever the model's own head (the clients use the head the server sends)."""
    train = TrainSection(batch_size=4, local_steps=1, lr=0.1)
    algo = logreg_algo(CReFFConfig(batch_real=32, real_repeats=3, grad_weighting=weighting), train)
    algo.head = torch.zeros(9)
    reply, _ = run_client(algo, ClientData(X, Y, 3), train)
    grads = reply.tensors["creff_grads"]
    assert grads.shape == (3, 9)  # [W (3x2) row-major, b (3)] per class
    mean0, mean2 = torch.tensor([2.0, 0.5]), torch.tensor([-0.5 / 3, 2.5 / 3])
    third = 1 / 3
    want0 = [(third - 1) * mean0, third * mean0, third * mean0, torch.tensor([third - 1, third, third])]
    want2 = [third * mean2, third * mean2, (third - 1) * mean2, torch.tensor([third, third, third - 1])]
    torch.testing.assert_close(grads[0], torch.cat(want0))
    torch.testing.assert_close(grads[1], torch.zeros(9))  # a class the client does not hold
    torch.testing.assert_close(grads[2], torch.cat(want2))
    want_weight = [2.0, 0.0, 3.0] if weighting == "class_counts" else [1.0, 0.0, 1.0]
    assert reply.tensors["creff_weight"].tolist() == want_weight


def test_client_gradient_at_any_head_is_the_per_sample_average():
    """A general head: (softmax(W x + b) - e_c) x^T averaged over the class's samples, written out per sample."""
    train = TrainSection(batch_size=4, local_steps=1, lr=0.1)
    algo = logreg_algo(CReFFConfig(batch_real=32, real_repeats=2), train)
    w = torch.tensor([[0.3, -0.2], [0.1, 0.4], [-0.5, 0.2]])
    b = torch.tensor([0.1, 0.0, -0.3])
    algo.head = torch.cat([w.reshape(-1), b])
    reply, _ = run_client(algo, ClientData(X, Y, 3), train)
    for c in (0, 2):
        rows = [(i, x) for i, x in enumerate(X) if Y[i] == c]
        g_w, g_b = torch.zeros(3, 2), torch.zeros(3)
        for _, x in rows:
            z = [float(w[k] @ x + b[k]) for k in range(3)]
            p = torch.tensor([math.exp(v) for v in z]) / sum(math.exp(v) for v in z)
            err = p - F.one_hot(torch.tensor(c), 3).float()
            g_w += torch.outer(err, x) / len(rows)
            g_b += err / len(rows)
        torch.testing.assert_close(reply.tensors["creff_grads"][c], torch.cat([g_w.reshape(-1), g_b]))


def test_client_gradient_samples_batch_real_per_class_and_leaves_the_model_alone():
    """batch_real = 1: each repeat takes one sample per class, so the average lies between the samples' own
    gradients; the received model is trained exactly as without the gradient computation."""
    train = TrainSection(batch_size=4, local_steps=2, lr=0.1)
    algo = logreg_algo(CReFFConfig(batch_real=1, real_repeats=4), train)
    reply, _ = run_client(algo, ClientData(X, Y, 3), train)
    head = algo.head
    singles = [HeadLayout.join(*head_grads(X[i : i + 1], Y[i : i + 1], *algo.layout.split(head))) for i in (0, 1)]
    low, high = torch.minimum(*singles), torch.maximum(*singles)
    g0 = reply.tensors["creff_grads"][0]
    assert bool(((g0 >= low - 1e-6) & (g0 <= high + 1e-6)).all())

    ref = FedAvg(FedAvgConfig(), algo.setup)
    ref.init_server(algo.broadcast_params, torch.zeros(0))
    model = build_model("logreg", (2,), 3)
    ref_reply = ref.client_update(
        client_context(ref.configure(1, [0], "train")[0], model, train, data=ClientData(X, Y, 3))
    )
    assert torch.equal(reply.tensors["params"], ref_reply.tensors["params"])


def test_closed_form_head_gradient_equals_autograd_of_cross_entropy():
    g = torch.Generator().manual_seed(3)
    f, w, b = torch.randn(7, 5, generator=g), torch.randn(4, 5, generator=g), torch.randn(4, generator=g)
    y = torch.tensor([0, 3, 3, 1, 2, 0, 3])
    wl, bl = w.clone().requires_grad_(), b.clone().requires_grad_()
    want = torch.autograd.grad(F.cross_entropy(F.linear(f, wl, bl), y), [wl, bl])
    got = head_grads(f, y, w, b)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    assert head_grads(f, y, w, None)[1] is None


# ------------------------------------------------------------------------------------------- matching distance
def test_match_distance_is_the_official_rowwise_cosine_distance():
    """Weights row by row, the bias as one row, each term 1 - <s, r> / (|s| |r| + 1e-6), summed."""
    syn_w, real_w = torch.tensor([[1.0, 0.0], [0.0, 2.0]]), torch.tensor([[3.0, 0.0], [1.0, 1.0]])
    syn_b, real_b = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 5.0])
    want = (1 - 3 / (3 + 1e-6)) + (1 - 2 / (2 * math.sqrt(2) + 1e-6)) + (1 - 0.0)
    got = match_distance(as_rows(syn_w, syn_b), as_rows(real_w, real_b))
    assert float(got) == pytest.approx(want, rel=1e-6)
    # leading dimensions are independent problems (the server matches all classes at once)
    both = match_distance(
        as_rows(torch.stack([syn_w, real_w]), torch.stack([syn_b, real_b])),
        as_rows(torch.stack([real_w, real_w]), torch.stack([real_b, real_b])),
    )
    assert both.shape == (2,) and float(both[0]) == pytest.approx(want, rel=1e-6)
    assert float(both[1]) == pytest.approx(0.0, abs=1e-5)
    assert float(match_distance(as_rows(syn_w, None), as_rows(real_w, None))) == pytest.approx(
        (1 - 3 / (3 + 1e-6)) + (1 - 2 / (2 * math.sqrt(2) + 1e-6)), rel=1e-6
    )


# ------------------------------------------------------------------------------------------- server side
def grads_reply(rows: dict[int, list[float]], weight: list[float], params: torch.Tensor) -> Reply:
    g = torch.zeros(3, 9)
    for c, v in rows.items():
        g[c] = torch.tensor(v)
    return Reply({"params": params, "creff_grads": g, "creff_weight": torch.tensor(weight)}, num_examples=4)


def test_server_averages_class_gradients_over_holders_or_by_class_counts():
    algo = logreg_algo(CReFFConfig())
    p = algo.broadcast_params
    a = grads_reply({0: [1.0] * 9, 1: [2.0] * 9}, [3.0, 1.0, 0.0], p)  # client A: 3 of class 0, 1 of class 1
    b = grads_reply({0: [5.0] * 9}, [1.0, 0.0, 0.0], p)  # client B: 1 of class 0
    mean, held = algo.aggregate_class_grads({0: a, 1: b})
    assert held.tolist() == [True, True, False]
    torch.testing.assert_close(mean[0], torch.full((9,), (3 * 1.0 + 1 * 5.0) / 4))  # weighted by class counts
    torch.testing.assert_close(mean[1], torch.full((9,), 2.0))
    a.tensors["creff_weight"], b.tensors["creff_weight"] = torch.tensor([1.0, 1.0, 0.0]), torch.tensor([1.0, 0, 0])
    mean, _ = algo.aggregate_class_grads({0: a, 1: b})  # "uniform": the presence flags the clients send
    torch.testing.assert_close(mean[0], torch.full((9,), 3.0))


def test_matching_lowers_the_distance_and_touches_only_reported_classes():
    algo = logreg_algo(CReFFConfig(num_features=5, match_epochs=50))
    before = algo.features.clone()
    g = torch.Generator().manual_seed(1)
    real = torch.randn(3, 9, generator=g)
    held = torch.tensor([True, False, True])
    weight, bias = algo.layout.split(algo.head)

    def distance(feats):
        blocks, labels = algo.class_blocks(feats)
        syn = as_rows(*head_grads(blocks[held], labels[held], weight, bias))
        return float(match_distance(syn, as_rows(*algo.layout.split(real[held]))).sum())

    start = distance(before)
    last = algo.match_features(real, held)
    assert distance(algo.features) < last <= start
    torch.testing.assert_close(algo.features[5:10], before[5:10], rtol=0, atol=0)  # class 1: no gradient this round
    assert not torch.equal(algo.features[:5], before[:5])


@pytest.mark.parametrize("init", ["random", "fedavg"])
def test_retrained_classifier_fits_the_federated_features(init):
    algo = logreg_algo(CReFFConfig(num_features=20, retrain_epochs=50, lr_retrain=0.1, retrain_init=init))
    g = torch.Generator().manual_seed(2)
    centres = torch.tensor([[2.0, 0.0], [-1.0, 2.0], [-1.0, -2.0]])
    algo.features = (centres.repeat_interleave(20, 0) + 0.3 * torch.randn(60, 2, generator=g)).contiguous()
    labels = torch.arange(3).repeat_interleave(20)
    start = algo.layout.take(algo.broadcast_params)
    w0, b0 = algo.layout.split(start)
    head, loss = algo.retrain_head(torch.Generator().manual_seed(0))
    w, b = algo.layout.split(head)
    assert loss == pytest.approx(float(F.cross_entropy(algo.features @ w.T + b, labels)))
    assert loss < 0.5 * float(F.cross_entropy(algo.features @ w0.T + b0, labels))
    assert ((algo.features @ w.T + b).argmax(1) == labels).float().mean() > 0.95
    again, _ = algo.retrain_head(torch.Generator().manual_seed(0))
    assert torch.equal(head, again)  # deterministic given the round's generator


def test_aggregate_reports_fedavg_body_with_the_retrained_head_and_broadcasts_fedavg():
    algo = logreg_algo(CReFFConfig(num_features=4, **FAST))
    p0 = algo.broadcast_params.clone()
    pa, pb = p0 + 1.0, p0 - 3.0
    replies = {
        0: grads_reply({0: [0.1] * 9}, [1.0, 0.0, 0.0], pa),
        1: Reply(grads_reply({2: [-0.2] * 9}, [0.0, 0.0, 1.0], pb).tensors, num_examples=12),
    }
    algo.aggregate(1, replies, "train")
    fedavg = (4 * pa + 12 * pb) / 16
    torch.testing.assert_close(algo.broadcast_params, fedavg)
    lay = algo.layout
    torch.testing.assert_close(lay.take(algo.global_params), algo.head)
    body = torch.ones_like(fedavg, dtype=torch.bool)
    body[lay.weight], body[lay.bias] = False, False
    torch.testing.assert_close(algo.global_params[body], fedavg[body])
    msg = algo.configure(2, [0], "train")[0]
    assert msg.tensors["params"] is algo.broadcast_params and msg.tensors["creff_head"] is algo.head
    assert set(algo.round_metrics(1)) == {"creff_match_loss", "creff_retrain_loss"}


# ------------------------------------------------------------------------------------------- end to end
def test_local_models_are_fedavgs_bit_for_bit(tiny_config, monkeypatch):
    """Same seed: every client's trained model equals FedAvg's in every round (FedACD Tables 3 and 9), with
    augmentation and dropout on, so neither the client's generator nor the global one may be touched."""
    trained: dict[tuple[str, int, int], torch.Tensor] = {}
    run = ClientRunner.run

    def spy(self, cid, rnd, phase_idx, phase, msg, data, state):
        reply, new_state = run(self, cid, rnd, phase_idx, phase, msg, data, state)
        trained[(self.algo.name, rnd, cid)] = reply.tensors["params"].clone()
        return reply, new_state

    monkeypatch.setattr(ClientRunner, "run", spy)
    for algo in ({"name": "fedavg"}, {"name": "creff", **FAST}):
        cfg = tiny_config(
            run={"rounds": 3, "name": algo["name"]},
            model={"dropout": 0.2},
            train={"augment": "crop_flip"},
            algorithm=algo,
        )
        Simulation(cfg).run()
    keys = sorted((r, c) for a, r, c in trained if a == "fedavg")
    assert keys == sorted((r, c) for a, r, c in trained if a == "creff") and len({r for r, _ in keys}) == 3
    for r, c in keys:
        assert torch.equal(trained[("fedavg", r, c)], trained[("creff", r, c)]), (r, c)


def test_creff_learns_on_digits_and_reports_the_retrained_model(tiny_config):
    sim = Simulation(tiny_config(run={"rounds": 6}, algorithm={"name": "creff", **FAST}))
    summary = sim.run()
    assert summary["final"]["test_acc"] > 0.7, summary["final"]  # 10 classes: chance is 0.1
    last = read_metrics(sim.run_dir / "metrics.jsonl")[-1]
    assert last["creff_retrain_loss"] < math.log(10) and last["creff_match_loss"] >= 0
    algo = sim.algo
    torch.testing.assert_close(algo.global_params, algo.layout.put(algo.broadcast_params, algo.head))
    assert not torch.equal(algo.global_params, algo.broadcast_params)


def records(run_dir) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "elapsed_s"} for r in read_metrics(run_dir / "metrics.jsonl")]


def test_creff_kill_and_resume_is_bit_exact(tiny_config, kill_and_resume):
    algo = {"name": "creff", **FAST}
    full, resumed = kill_and_resume(lambda name: tiny_config(run={"name": name, "rounds": 4}, algorithm=algo))
    assert records(full.run_dir) == records(resumed.run_dir)
    for key in ("global_params", "broadcast_params", "head", "features"):
        assert torch.equal(getattr(full.algo, key), getattr(resumed.algo, key)), key
    assert full.algo.seed == resumed.algo.seed


def test_a_head_without_bias_is_matched_and_retrained_on_its_weight_only():
    """FedNH's CNN drops the classifier bias: the head is the weight alone, on the client and on the server."""
    build = lambda: build_model("cnn", (1, 28, 28), 3, head_bias=False)  # noqa: E731
    train = TrainSection(batch_size=4, local_steps=1, lr=0.01)
    algo = CReFF(CReFFConfig(num_features=4, **FAST), Setup(2, 3, train, build))
    torch.manual_seed(0)
    algo.init_server(FlatModel(build()).get_params(), torch.zeros(0))
    assert algo.layout.bias is None and algo.head.shape == (3 * 192,)
    g = torch.Generator().manual_seed(0)
    data = ClientData(torch.randn(6, 1, 28, 28, generator=g), torch.tensor([0, 0, 1, 1, 1, 2]), 3)
    reply = algo.client_update(client_context(algo.configure(1, [0], "train")[0], build(), train, data=data))
    assert reply.tensors["creff_grads"].shape == (3, 3 * 192)
    algo.aggregate(1, {0: reply}, "train")
    torch.testing.assert_close(algo.layout.take(algo.global_params), algo.head)
    assert algo.round_metrics(1)["creff_retrain_loss"] < math.log(3)

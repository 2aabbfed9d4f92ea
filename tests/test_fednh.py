"""FedNH: prototype init, the scaled-cosine head, the client's class means and the smoothed server update by hand,
frozen prototypes, any head bias dropped, learning, resuming and personalised evaluation."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fedhet.algorithms import ALGORITHMS, Reply, Setup
from fedhet.algorithms.base import ClientContext, ClientData
from fedhet.algorithms.fednh import PrototypeHead, class_prototype_sums, init_prototypes
from fedhet.config import TrainSection
from fedhet.engine.simulation import Simulation
from fedhet.models import build_model
from fedhet.models.base import FedModel
from fedhet.results.store import read_metrics
from fedhet.toolkit.flat import FlatModel


def unit(*v: float) -> list[float]:
    n = math.sqrt(sum(a * a for a in v))
    return [a / n for a in v]


# ---------------------------------------------------------------------------- initialisation
def test_prototypes_are_orthonormal_and_seeded():
    p = init_prototypes(10, 32, torch.Generator().manual_seed(3))
    torch.testing.assert_close(p @ p.T, torch.eye(10), atol=1e-5, rtol=0)  # unit rows, pairwise orthogonal
    assert torch.equal(p, init_prototypes(10, 32, torch.Generator().manual_seed(3)))
    assert not torch.allclose(p, init_prototypes(10, 32, torch.Generator().manual_seed(4)))


def test_more_classes_than_dimensions_still_gives_unit_prototypes():
    p = init_prototypes(12, 4, torch.Generator().manual_seed(0))
    torch.testing.assert_close(p.norm(dim=1), torch.ones(12))


def test_run_seed_decides_the_prototypes(tiny_config):
    def protos(name, seed):
        return Simulation(tiny_config(run={"name": name, "seed": seed}, algorithm={"name": "fednh"})).algo.prototypes()

    a, b, c = protos("a", 0), protos("b", 0), protos("c", 1)
    assert a.shape == (10, 32) and torch.equal(a, b) and not torch.allclose(a, c)
    torch.testing.assert_close(a @ a.T, torch.eye(10), atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------- the head
def test_logits_are_scale_times_cosine():
    head = PrototypeHead(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]]), 2.5, learn_scale=True)
    z = torch.tensor([[3.0, 4.0], [0.0, -2.0]])
    # cosines by hand: (3,4)/5 = (0.6, 0.8) against the rows; (0,-1) likewise
    expected = 2.5 * torch.tensor([[0.6, 0.8, 0.36 + 0.64], [0.0, -1.0, -0.8]])
    torch.testing.assert_close(head(z), expected)


@pytest.mark.parametrize("head_bias", [True, False])
def test_any_head_bias_is_replaced_by_the_prototype_head(head_bias):
    entry = ALGORITHMS.get("fednh")
    model = entry.obj.prepare_model(entry.params(), build_model("cnn", (1, 28, 28), 10, head_bias=head_bias))
    names = [n for n, _ in model.named_parameters()]
    assert [n for n in names if n.startswith("head.")] == ["head.scale"]
    assert [n for n, _ in model.named_buffers()] == ["head.prototypes"]
    assert model(torch.zeros(2, 1, 28, 28)).shape == (2, 10)


def test_a_constant_scale_is_no_parameter():
    entry = ALGORITHMS.get("fednh")
    model = entry.obj.prepare_model(entry.params(learn_scale=False, scale=30.0), build_model("logreg", (2,), 3))
    assert list(model.parameters()) == []
    z = torch.tensor([[1.0, 0.0]])
    torch.testing.assert_close(model(z), 30.0 * model.head.prototypes[:, 0][None])


# ---------------------------------------------------------------------------- client side
def test_client_class_means_by_hand():
    model = build_model("logreg", (2,), 3)  # body = flatten: the embedding is the input itself
    x = torch.tensor([[3.0, 4.0], [0.0, 2.0], [5.0, 0.0]])
    y = torch.tensor([0, 0, 1])
    sums, counts = class_prototype_sums(model, x, y, 3)
    # class 0: mean of (0.6, 0.8) and (0, 1) = (0.3, 0.9), normalised, times its count 2; class 2: absent
    expected = torch.tensor([[2 * a for a in unit(0.3, 0.9)], [1.0, 0.0], [0.0, 0.0]])
    torch.testing.assert_close(sums, expected)
    assert counts.tolist() == [2.0, 1.0, 0.0]


def make_fednh(build, num_classes, **params):
    entry = ALGORITHMS.get("fednh")
    cfg = entry.params(**params)
    setup = Setup(2, num_classes, TrainSection(batch_size=4, local_steps=3, lr=0.5, momentum=0.9, weight_decay=0.1),
                  lambda: entry.obj.prepare_model(cfg, build()))  # fmt: skip
    algo = entry.obj(cfg, setup)
    torch.manual_seed(0)
    model = setup.build_model()
    flat = FlatModel(model)
    algo.init_server(flat.get_params(), flat.get_buffers())
    return algo, model, flat


def test_local_training_moves_the_body_and_scale_but_not_the_prototypes():
    algo, model, flat = make_fednh(lambda: build_model("mlp", (4,), 3, hidden=[5]), 3)
    msg = algo.configure(1, [0], "train")[0]
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    ctx = ClientContext(0, 1, "train", msg, ClientData(x, y, 3), {}, model, flat, algo.setup.train,
                        torch.Generator().manual_seed(1))  # fmt: skip
    reply = algo.client_update(ctx)
    assert torch.equal(reply.tensors["buffers"], msg.tensors["buffers"])  # momentum and weight decay included
    assert torch.equal(model.head.prototypes.flatten(), msg.tensors["buffers"])
    moved = (reply.tensors["params"] - msg.tensors["params"]).abs()
    assert moved[flat.slices()["head.scale"]].item() > 0 and moved.sum() > 0
    assert reply.tensors["class_counts"].tolist() == torch.bincount(y, minlength=3).float().tolist()


# ---------------------------------------------------------------------------- server side
P0 = [[1.0, 0.0], [0.0, 1.0], [0.28, -0.96]]  # unit rows; class 2 is held by nobody


def hand_update(rho: float) -> list[list[float]]:
    # class 0: client A 3 samples with normalised mean (0.6, 0.8), client B 1 with (0.6, -0.8)
    m0 = unit((3 * 0.6 + 0.6) / 4, (3 * 0.8 - 0.8) / 4)
    # class 1: only client A, mean direction (1, 0)
    m1 = [1.0, 0.0]
    new0 = unit(*(rho * p + (1 - rho) * m for p, m in zip(P0[0], m0, strict=True)))
    new1 = unit(*(rho * p + (1 - rho) * m for p, m in zip(P0[1], m1, strict=True)))
    return [new0, new1, P0[2]]


def reply(params, buffers, sums, counts, n):
    tensors = {"params": params, "buffers": buffers, "proto_sums": torch.tensor(sums),
               "class_counts": torch.tensor(counts)}  # fmt: skip
    return Reply(tensors=tensors, num_examples=n)


@pytest.mark.parametrize(("rho", "weighting", "scale"), [(0.9, "uniform", 3.0), (0.5, "samples", 2.4)])
def test_server_update_by_hand(rho, weighting, scale):
    algo, _, _ = make_fednh(lambda: build_model("logreg", (2,), 3), 3, smoothing=rho, weighting=weighting)
    algo.global_buffers = torch.tensor(P0).flatten()
    b = algo.global_buffers
    replies = {
        0: reply(torch.tensor([2.0]), b, [[1.8, 2.4], [1.0, 0.0], [0.0, 0.0]], [3.0, 1.0, 0.0], 4),
        1: reply(torch.tensor([4.0]), b, [[0.6, -0.8], [0.0, 0.0], [0.0, 0.0]], [1.0, 0.0, 0.0], 1),
    }
    algo.aggregate(1, replies, "train")
    torch.testing.assert_close(algo.prototypes(), torch.tensor(hand_update(rho)))
    assert torch.equal(algo.prototypes()[2], torch.tensor(P0[2]))  # nobody holds class 2: kept bit for bit
    # the scale (the only parameter of logreg + FedNH) is averaged uniformly (official): (2 + 4) / 2 = 3,
    # or by samples: 4/5 * 2 + 1/5 * 4 = 2.4
    assert algo.global_params.item() == pytest.approx(scale)
    assert algo.round_metrics(1)["scale"] == pytest.approx(scale)


def test_smoothing_one_never_moves_the_prototypes():
    algo, _, _ = make_fednh(lambda: build_model("logreg", (2,), 3), 3, smoothing=1.0)
    before = algo.prototypes().clone()
    r = reply(algo.global_params, algo.global_buffers, [[0.0, 3.0], [0.0, 0.0], [0.0, 0.0]], [3.0, 0.0, 0.0], 3)
    algo.aggregate(1, {0: r}, "train")
    torch.testing.assert_close(algo.prototypes(), before, rtol=0, atol=1e-7)


def test_prototypes_are_found_among_batchnorm_buffers():
    body = {"fc": nn.Sequential(nn.Linear(4, 2), nn.BatchNorm1d(2))}
    algo, _, flat = make_fednh(lambda: FedModel(body, 2, 3), 3)
    protos = algo.prototypes().clone()
    bn = [torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([3.0, 4.0, 5.0, 6.0])]  # running mean, running var
    sums = [[2.0, 0.0], [0.0, 0.0], [0.0, 0.0]]
    replies = {i: reply(algo.global_params, torch.cat([bn[i], protos.flatten()]), sums, [2.0, 0, 0], 2) for i in (0, 1)}
    algo.aggregate(1, replies, "train")
    torch.testing.assert_close(algo.global_buffers[:4], torch.tensor([2.0, 3.0, 4.0, 5.0]))  # averaged
    expected0 = torch.nn.functional.normalize(0.9 * protos[0] + 0.1 * torch.tensor([1.0, 0.0]), dim=0)
    torch.testing.assert_close(algo.prototypes()[0], expected0)
    torch.testing.assert_close(algo.prototypes()[1:], protos[1:], rtol=0, atol=0)


# ---------------------------------------------------------------------------- end to end
def test_fednh_learns_on_digits_and_resumes_bit_exact(tiny_config, kill_and_resume):
    full, resumed = kill_and_resume(
        lambda name: tiny_config(
            run={"name": name, "rounds": 5}, train={"participation": 1.0}, algorithm={"name": "fednh"}
        )
    )
    keys = ("round", "test_acc", "test_loss", "train_loss", "scale", "proto_max_cos")
    r_full, r_cut = (read_metrics(s.run_dir / "metrics.jsonl") for s in (full, resumed))
    assert [{k: r[k] for k in keys} for r in r_full] == [{k: r[k] for k in keys} for r in r_cut]
    assert r_full[-1]["test_acc"] > 0.8, r_full[-1]  # 10 classes: chance is 0.1
    assert r_full[-1]["proto_max_cos"] > r_full[0]["proto_max_cos"]  # prototypes moved from orthogonal
    torch.testing.assert_close(full.algo.global_params, resumed.algo.global_params, rtol=0, atol=0)
    torch.testing.assert_close(full.algo.global_buffers, resumed.algo.global_buffers, rtol=0, atol=0)


def test_personal_eval_reports_the_last_local_models(tiny_config):
    algo = {"name": "fednh", "personal_eval": True}
    sim = Simulation(tiny_config(run={"name": "pm"}, partition={"local_test_fraction": 0.2}, algorithm=algo))
    sim.run()
    final = read_metrics(sim.run_dir / "metrics.jsonl")[-1]
    assert final["personal_acc_micro"] > 0.3, final
    states = dict(sim.executor.store.items())
    assert states and all(set(s) == {"personal"} for s in states.values())
    split = {"local_test_fraction": 0.2}
    plain = Simulation(tiny_config(run={"name": "gm"}, partition=split, algorithm={"name": "fednh"}))
    plain.run()
    assert "personal_acc_micro" not in read_metrics(plain.run_dir / "metrics.jsonl")[-1]
    assert not dict(plain.executor.store.items())

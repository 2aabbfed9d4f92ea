"""Frozen layers (model.freeze), LoRA adapters (model.lora_*) and the federated LoRA aggregation rules
(server.lora_aggregation): the rules against hand computations, the bad inputs' one-line errors, and runs."""

from __future__ import annotations

import json
import math
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch
from torch import nn

from fedhet.algorithms import ALGORITHMS
from fedhet.config import build_config
from fedhet.engine.simulation import Simulation, resolve_config
from fedhet.errors import ConfigError
from fedhet.models import build_model
from fedhet.models.adapt import LoraSpec, adapt
from fedhet.results.store import read_metrics
from fedhet.toolkit.lora import LoraPair, fedit, ffa, flexlora, flora_stack, slot_average, slot_mask

# find_spec, not importorskip: peft (with transformers) is slow to import, and only the tests that build adapters do
pytestmark = pytest.mark.skipif(find_spec("peft") is None, reason="LoRA needs peft: pip install 'fedhet[pretrained]'")

LORA = {"name": "mlp", "hidden": [32], "lora_rank": 2}
W = [0.25, 0.75]


# ----------------------------------------------------------------------------- the rules, by hand
def two_clients():
    """Two rank-1 clients on a 3 x 2 layer: A_i is 1 x 2, B_i is 3 x 1."""
    a = [torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]])]
    b = [torch.tensor([[1.0], [2.0], [0.0]]), torch.tensor([[0.0], [1.0], [1.0]])]
    return a, b


def test_fedit_averages_a_and_b_separately():
    a, b = two_clients()
    new_a, new_b = fedit(a, b, W)
    assert torch.equal(new_a, torch.tensor([[0.25, 0.75]]))
    assert torch.equal(new_b, torch.tensor([[0.25], [1.25], [0.75]]))
    # the product of the averages is not the average of the products (FLoRA's point)
    assert torch.equal(new_b @ new_a, torch.tensor([[0.0625, 0.1875], [0.3125, 0.9375], [0.1875, 0.5625]]))


def test_ffa_keeps_a_and_averages_b_so_the_product_is_exact():
    a = torch.tensor([[1.0, 2.0]])
    _, b = two_clients()
    new_a, new_b = ffa(a, b, W)
    assert new_a is a
    assert torch.equal(new_b, torch.tensor([[0.25], [1.25], [0.75]]))
    assert torch.equal(new_b @ new_a, W[0] * b[0] @ a + W[1] * b[1] @ a)


def test_flora_stacking_gives_the_weighted_sum_of_products_exactly():
    a, b = two_clients()
    stacked_a, stacked_b = flora_stack(a, b, W)
    assert stacked_a.shape == (2, 2) and stacked_b.shape == (3, 2)  # rank r_1 + r_2
    # sum w_i B_i A_i = 0.25 [[1,0],[2,0],[0,0]] + 0.75 [[0,0],[0,1],[0,1]]
    assert torch.equal(stacked_b @ stacked_a, torch.tensor([[0.25, 0.0], [0.5, 0.75], [0.0, 0.75]]))
    # heterogeneous ranks: a rank-2 client beside a rank-1 one
    a2 = [torch.tensor([[1.0, 0.0], [0.0, 2.0]]), a[1]]
    b2 = [torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]), b[1]]
    sa, sb = flora_stack(a2, b2, W)
    assert sa.shape == (3, 2) and sb.shape == (3, 3)
    assert torch.equal(sb @ sa, W[0] * b2[0] @ a2[0] + W[1] * b2[1] @ a2[1])


def test_flexlora_is_the_truncated_svd_of_the_averaged_products():
    # 0.25 B_1 A_1 + 0.75 B_2 A_2 = diag(1, 0.5) on a 3 x 2 layer: singular values 1 and 0.5
    a = [torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]])]
    b = [torch.tensor([[4.0], [0.0], [0.0]]), torch.tensor([[0.0], [2.0 / 3.0], [0.0]])]
    new_a, new_b = flexlora(a, b, W, rank=1)
    assert new_a.shape == (1, 2) and new_b.shape == (3, 1)
    torch.testing.assert_close(new_b @ new_a, torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 0.0]]))
    torch.testing.assert_close(new_a.abs(), torch.tensor([[1.0, 0.0]]))  # A = v_1^T, B = u_1 s_1 (signs free)
    torch.testing.assert_close(new_b.abs(), torch.tensor([[1.0], [0.0], [0.0]]))
    # rank 2 keeps the whole average
    new_a, new_b = flexlora(a, b, W, rank=2)
    torch.testing.assert_close(new_b @ new_a, torch.tensor([[1.0, 0.0], [0.0, 0.5], [0.0, 0.0]]))


def test_flexlora_rank_one_error_is_the_second_singular_value_by_hand():
    a, b = two_clients()
    m = torch.tensor([[0.25, 0.0], [0.5, 0.75], [0.0, 0.75]])  # the averaged products (above)
    # M^T M = [[0.3125, 0.375], [0.375, 1.125]]: trace 1.4375, determinant 0.2109375
    small = (1.4375 - math.sqrt(1.4375**2 - 4 * 0.2109375)) / 2
    new_a, new_b = flexlora(a, b, W, rank=1)
    error = torch.linalg.matrix_norm((m - new_b @ new_a).double())
    assert error.item() == pytest.approx(math.sqrt(small), rel=1e-6)  # Eckart-Young: the best rank-1 error
    u, s, vh = torch.linalg.svd(m.double())
    torch.testing.assert_close((new_b @ new_a).double(), s[0] * u[:, :1] @ vh[:1], rtol=1e-6, atol=1e-7)


def test_heterogeneous_fedit_averages_each_slot_over_the_clients_that_hold_it():
    # client 1 has rank 2, client 2 rank 1: slot 0 is averaged over both (0.25, 0.75), slot 1 is client 1's alone
    a = [torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([[5.0, 6.0], [9.0, 9.0]])]  # client 2's row 1: unused
    got = slot_average(a, W, [2, 1], 0, current=torch.zeros(2, 2))
    assert torch.equal(got, torch.tensor([[4.0, 5.0], [3.0, 4.0]]))
    b = [torch.tensor([[1.0, 2.0], [0.0, 4.0], [4.0, 0.0]]), torch.tensor([[5.0, 9.0], [4.0, 9.0], [0.0, 9.0]])]
    got = slot_average(b, W, [2, 1], 1, current=torch.zeros(3, 2))
    assert torch.equal(got, torch.tensor([[4.0, 2.0], [3.0, 4.0], [1.0, 0.0]]))
    # a slot no client of the round holds keeps the global value
    kept = slot_average(a, W, [1, 1], 0, current=torch.full((2, 2), 7.0))
    assert torch.equal(kept[1], torch.tensor([7.0, 7.0]))


def test_heterogeneous_flexlora_uses_each_clients_own_slots_only():
    a = [torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([[1.0, 0.0], [5.0, 5.0]])]
    b = [torch.tensor([[2.0, 0.0], [0.0, 2.0], [0.0, 0.0]]), torch.tensor([[4.0, 7.0], [0.0, 7.0], [0.0, 7.0]])]
    new_a, new_b = flexlora(a, b, W, rank=2, ranks=[2, 1])
    # 0.25 [[2,0],[0,2],[0,0]] + 0.75 [[4,0],[0,0],[0,0]] = [[3.5, 0], [0, 0.5], [0, 0]]
    torch.testing.assert_close(new_b @ new_a, torch.tensor([[3.5, 0.0], [0.0, 0.5], [0.0, 0.0]]))


def test_slot_mask_marks_the_slots_past_a_clients_rank():
    pairs = [LoraPair("l", slice(0, 6), slice(6, 12), (3, 2), (2, 3))]  # A 3 x 2, B 2 x 3, then a head entry
    mask = slot_mask(pairs, 13, rank=1)
    assert mask.tolist() == [False, False, True, True, True, True] + [False, True, True] * 2 + [False]


# ----------------------------------------------------------------------------- freezing and adapters
def mlp(**params):
    torch.manual_seed(0)
    return build_model("mlp", (1, 8, 8), 10, hidden=[16, 12], **params)


def trainable(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def test_freeze_body_leaves_only_the_head():
    assert trainable(adapt(mlp(), "mlp", "body")) == ["head.weight", "head.bias"]
    assert trainable(adapt(mlp(), "mlp", ["body.fc1"])) == [
        "body.fc2.0.weight",
        "body.fc2.0.bias",
        *["head.weight", "head.bias"],
    ]
    assert len(trainable(adapt(mlp(), "mlp", "none"))) == 6


def test_lora_adapts_the_body_linear_layers_and_the_head_trains():
    model = adapt(mlp(), "mlp", lora=LoraSpec(rank=2, alpha=4.0))
    assert trainable(model) == [
        "body.fc1.1.lora_A.default.weight",
        "body.fc1.1.lora_B.default.weight",
        "body.fc2.0.lora_A.default.weight",
        "body.fc2.0.lora_B.default.weight",
        "head.weight",
        "head.bias",
    ]
    ffa_model = adapt(mlp(), "mlp", lora=LoraSpec(rank=2, alpha=4.0, train_a=False))
    assert not [n for n in trainable(ffa_model) if "lora_A" in n]
    # B starts at zero: the adapted model computes the model it was built from
    x = torch.randn(5, 1, 8, 8)
    torch.testing.assert_close(model(x), mlp()(x))


def test_bad_freeze_and_lora_settings_are_one_line_each():
    cases = [
        (
            lambda: adapt(mlp(), "mlp", ["body.fc9"]),
            "model.freeze: model 'mlp' has no module 'body.fc9'; its modules: body, head",
        ),
        (lambda: adapt(mlp(), "mlp", ["body", "head"]), "leaves model 'mlp' no parameter to train"),
        (
            lambda: adapt(mlp(), "mlp", lora=LoraSpec(2, 2.0, targets=("body.fc3",))),
            "model.lora_targets: model 'mlp' has no module 'body.fc3'; its Linear and Conv2d layers: body.fc1.1, "
            "body.fc2.0, head",
        ),
        (lambda: adapt(mlp(), "mlp", lora=LoraSpec(2, 2.0, targets=("body.fc1",))), "'body.fc1' is a Sequential"),
        (
            lambda: adapt(mlp(), "mlp", lora=LoraSpec(13, 13.0)),
            "model.lora_rank=13 exceeds the rank of layer 'body.fc2.0' (Linear, 16 in, 12 out): "
            "at most min(in, out) = 12",
        ),
        (
            lambda: adapt(build_model("logreg", (1, 8, 8), 10), "logreg", lora=LoraSpec(2, 2.0)),
            "model 'logreg' has none; name the layers to adapt in model.lora_targets "
            "(its Linear and Conv2d layers: head)",
        ),
    ]
    for make, message in cases:
        with pytest.raises(ConfigError) as err:
            make()
        assert message in str(err.value) and "\n" not in str(err.value)


def test_lora_on_named_conv_layers():
    model = build_model("cnn_bn", (1, 8, 8), 10, channels=[4, 4, 8], hidden=[16])
    conv = next(n for n, m in model.named_modules() if isinstance(m, nn.Conv2d))
    adapted = adapt(model, "cnn_bn", lora=LoraSpec(2, 2.0, targets=(conv,)))
    assert f"{conv}.lora_A.default.weight" in trainable(adapted)
    assert f"{conv}.base_layer.weight" not in trainable(adapted)


def test_lora_settings_need_lora_and_the_config_errors_are_one_line(tiny_config):
    for section, values, message in [
        ("model", {"lora_alpha": 4.0}, "model.lora_alpha applies only with LoRA: set model.lora_rank > 0"),
        ("model", {"lora_targets": ["head"]}, "model.lora_targets applies only with LoRA"),
        ("model", {"freeze": "all"}, "model.freeze"),
        (
            "server",
            {"lora_aggregation": "ffa"},
            "server.lora_aggregation='ffa' aggregates LoRA adapters; set model.lora_rank",
        ),
        ("server", {"lora_aggregation": "flora2"}, "server.lora_aggregation"),
        (
            "model",
            {**LORA, "lora_ranks": [2, 3]},
            "model.lora_ranks must list client ranks from 1 to model.lora_rank=2",
        ),
        ("model", {"lora_ranks": [1]}, "model.lora_ranks applies only with LoRA"),
    ]:
        with pytest.raises(ConfigError) as err:
            tiny_config(**{section: values})
        assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        (
            {"algorithm": {"name": "fedrod"}, "model": {"freeze": ["head"]}},
            "model.freeze names the head ('head'), and fedrod splits",
        ),
        (
            {"algorithm": {"name": "fedbabu"}, "model": {**LORA, "lora_targets": ["head"]}},
            "model.lora_targets names the head ('head'), and fedbabu freezes the head itself",
        ),
        (
            {"algorithm": {"name": "scaffold"}, "model": LORA, "server": {"lora_aggregation": "flexlora"}},
            "changes how the weighted average of the client models treats their adapters, which scaffold's server "
            "does not take",
        ),
        (
            {"model": LORA, "server": {"name": "fedadam", "lr": 0.01, "lora_aggregation": "flexlora"}},
            "use server.name='sgd' with lr=1",
        ),
        (
            {"model": LORA, "server": {"aggregation": "median", "lora_aggregation": "flexlora"}},
            "unset server.aggregation='median'",
        ),
        (
            {"model": {**LORA, "lora_ranks": [2, 1]}, "privacy": {"mode": "central", "noise_multiplier": 0.5}},
            "model.lora_ranks forms the adapters from each client's own with the algorithm's weights; unset "
            "privacy.mode='central'",
        ),
        (
            {"algorithm": {"name": "feddyn"}, "model": {**LORA, "lora_ranks": [2, 1]}},
            "model.lora_ranks changes how the weighted average of the client models treats their adapters, which "
            "feddyn's server does not take",
        ),
    ],
)
def test_algorithms_and_rules_that_cannot_take_it_are_refused_in_one_line(tiny_config, sections, message):
    with pytest.raises(ConfigError) as err:
        resolve_config(tiny_config(**sections))
    assert message in str(err.value) and "\n" not in str(err.value)


# ----------------------------------------------------------------------------- runs
def capture_replies(sim):
    seen = []
    aggregate = sim.algo.aggregate

    def spy(rnd, replies, phase):
        seen.append(
            {
                cid: {**{k: v.clone() for k, v in r.tensors.items()}, "num_examples": r.num_examples}
                for cid, r in replies.items()
            }
        )
        return aggregate(rnd, replies, phase)

    sim.algo.aggregate = spy
    return seen


def trainable_count(sim) -> int:
    return sum(p.numel() for p in sim.model.parameters() if p.requires_grad)


def frozen_copy(sim) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in sim.model.named_parameters() if not p.requires_grad}


def test_linear_probing_trains_the_head_only(tiny_config):
    train = {"weight_decay": 0.1, "momentum": 0.9}
    sim = Simulation(tiny_config(run={"rounds": 2}, model={"freeze": "body"}, train=train))
    before = frozen_copy(sim)
    start = sim.algo.global_params.clone()
    sim.run()
    assert sim.flat.num_params == 32 * 10 + 10  # the head of mlp hidden=[32]
    for name, p in sim.model.named_parameters():
        if name in before:
            assert torch.equal(p, before[name]), name  # no gradient, weight decay or momentum moved it
    assert not torch.equal(sim.algo.global_params, start)


def test_a_lora_run_sends_only_the_trainable_parameters(tiny_config):
    sim = Simulation(tiny_config(run={"rounds": 1}, model=LORA, system={"profiles": "constant"}))
    seen = capture_replies(sim)
    assert sim.run()["status"] == "finished"
    count = trainable_count(sim)
    assert count == 2 * 64 + 32 * 2 + 32 * 10 + 10  # A, B of the one hidden layer, and the head
    assert all(r["params"].numel() == count for r in seen[0].values())
    profiles = json.loads((sim.run_dir / "system_profiles.json").read_text())
    assert profiles["model_bytes"] == 4 * count  # the simulated clock moves 4 bytes per trainable float32


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", [n for n in ALGORITHMS.names() if n not in ("centralized", "fedbn")])
def test_every_algorithm_runs_with_lora_and_sends_the_trainable_subset(tiny_config, algorithm):
    params = {"pfedme": {"inner_steps": 2}}.get(algorithm, {})
    cfg = tiny_config(
        run={"rounds": 1, "name": algorithm},
        partition={"local_test_fraction": 0.2},
        train={"clients_per_round": 3},
        algorithm={"name": algorithm, **params},
        model=LORA,
        system={"profiles": "constant"},
    )
    sim = Simulation(cfg)
    seen = capture_replies(sim)
    assert sim.run()["status"] == "finished"
    count, full = trainable_count(sim), sum(p.numel() for p in sim.model.parameters())
    for reply in seen[0].values():  # the model's vectors (params, SCAFFOLD's deltas, FedNova's update) are the subset
        sizes = [t.numel() for k, t in reply.items() if k != "num_examples"]
        assert count in sizes and full not in sizes
    exchanged = count + sim.flat.buffers.numel()  # FedNH's and SphereFed's head buffers travel beside
    assert json.loads((sim.run_dir / "system_profiles.json").read_text())["model_bytes"] == 4 * exchanged


def test_fedbn_and_centralized_take_lora(tiny_config):
    model = {"name": "cnn_bn", "channels": [4, 4, 8], "hidden": [16], "lora_rank": 2}
    for algorithm in ("fedbn", "centralized"):
        sim = Simulation(tiny_config(run={"rounds": 1, "name": algorithm}, algorithm={"name": algorithm}, model=model))
        assert sim.run()["status"] == "finished"


def test_frozen_parameters_are_the_same_in_every_copy_of_the_model(tiny_config):
    # MOON's teachers are other copies of the architecture run at the flat parameters: their frozen weights must be
    # the global model's, or the teacher would be another function
    sim = Simulation(tiny_config(run={"rounds": 1}, model=LORA, algorithm={"name": "moon"}))
    frozen = frozen_copy(sim)
    copy = sim.setup.build_model()
    for name, p in copy.named_parameters():
        if name in frozen:
            assert torch.equal(p, frozen[name]), name
    other = Simulation(tiny_config(run={"rounds": 1, "name": "again"}, model=LORA, algorithm={"name": "moon"}))
    assert all(torch.equal(frozen[n], p) for n, p in frozen_copy(other).items())  # rebuilt from the seed


def test_ffa_keeps_every_a_at_its_initialisation(tiny_config):
    sim = Simulation(tiny_config(run={"rounds": 2}, model=LORA, server={"lora_aggregation": "ffa"}))
    a = {n: p.clone() for n, p in sim.model.named_parameters() if "lora_A" in n}
    assert a and not any(p.requires_grad for n, p in sim.model.named_parameters() if "lora_A" in n)
    sim.run()
    assert sim.flat.num_params == 32 * 2 + 32 * 10 + 10  # B and the head
    assert all(torch.equal(p, a[n]) for n, p in sim.model.named_parameters() if "lora_A" in n)


def test_flexlora_run_sets_the_global_adapters_to_the_svd_of_the_averaged_products(tiny_config):
    sim = Simulation(tiny_config(run={"rounds": 2}, model=LORA, server={"lora_aggregation": "flexlora"}))
    seen = capture_replies(sim)
    sim.run()
    slices = sim.flat.slices()
    a_span, b_span = slices["body.fc1.1.lora_A.default.weight"], slices["body.fc1.1.lora_B.default.weight"]
    replies = list(seen[-1].values())
    total = sum(r["num_examples"] for r in replies)
    weights = [r["num_examples"] / total for r in replies]
    a = [r["params"][a_span].view(2, 64) for r in replies]
    b = [r["params"][b_span].view(32, 2) for r in replies]
    want_a, want_b = flexlora(a, b, weights, 2)
    g = sim.algo.global_params
    # the server optimiser's x + 1 (target - x) rounds in the last bits
    torch.testing.assert_close(g[a_span].view(2, 64), want_a, rtol=0, atol=1e-7)
    torch.testing.assert_close(g[b_span].view(32, 2), want_b, rtol=0, atol=1e-7)
    head = slices["head.weight"]  # what is not an adapter: the plain weighted average
    torch.testing.assert_close(g[head], sum(w * r["params"][head] for w, r in zip(weights, replies, strict=True)))


@pytest.mark.parametrize("aggregation", ["fedit", "flexlora"])
def test_a_lora_run_resumes_bit_for_bit(tiny_config, kill_and_resume, aggregation):
    full, resumed = kill_and_resume(
        lambda name: tiny_config(
            run={"name": name, "rounds": 3},
            model=LORA,
            server={"lora_aggregation": aggregation},
            train={"momentum": 0.9},
        )
    )
    torch.testing.assert_close(full.algo.global_params, resumed.algo.global_params, rtol=0, atol=0)
    drop = ("elapsed_s",)
    strip = [
        [{k: v for k, v in r.items() if k not in drop} for r in read_metrics(s.run_dir / "metrics.jsonl")]
        for s in (full, resumed)
    ]
    assert strip[0] == strip[1]


def test_the_run_folder_records_lora_and_a_changed_rank_does_not_resume(tiny_config):
    sim = Simulation(tiny_config(run={"rounds": 1}, model=LORA))
    sim.run()
    saved = json.loads((sim.run_dir / "config.json").read_text())
    assert saved["model"]["lora_rank"] == 2 and saved["server"]["lora_aggregation"] == "fedit"
    with pytest.raises(ConfigError, match="model.lora_rank: 2 -> 4"):
        Simulation(tiny_config(run={"rounds": 2, "name": sim.run_dir.name}, model={**LORA, "lora_rank": 4})).run(
            resume=True
        )


def test_lora_with_the_batched_executor_matches_the_sequential_one(tiny_config):
    runs = {}
    for executor in ("sequential", "batched"):
        cfg = tiny_config(
            run={"rounds": 2, "name": executor, "executor": executor}, model=LORA, train={"participation": 1.0}
        )
        sim = Simulation(cfg)
        sim.run()
        runs[executor] = sim.algo.global_params
    torch.testing.assert_close(runs["batched"], runs["sequential"], rtol=1e-5, atol=1e-5)


def test_build_config_keeps_freeze_lists(tmp_path):
    cfg = build_config({"dataset": {"name": "digits"}, "model": {"name": "mlp", "freeze": ["body.fc1"]}})
    assert cfg.model.freeze == ["body.fc1"] and cfg.model.params() == {}


# ----------------------------------------------------------------------------- over Flower
def flower_run(cfg, nodes, secure=None):
    pytest.importorskip("flwr")
    from fedhet.flower.app import RunOptions, run_server
    from fedhet.flower.client import make_client_app
    from fedhet.flower.loopback import LoopbackGrid

    grid = LoopbackGrid(make_client_app(lambda _: cfg), nodes)
    return run_server(grid, cfg, RunOptions(secure_aggregation=secure))


def last_params(cfg) -> torch.Tensor:
    from fedhet.engine.checkpoint import read_checkpoint

    return read_checkpoint(Path(cfg.run.out_dir) / cfg.run.name / "checkpoints" / "last.pt")["algo"]["global_params"]


@pytest.mark.slow
@pytest.mark.parametrize("model", [LORA, {**LORA, "lora_ranks": [2, 1]}], ids=["lora", "ranks"])
def test_lora_over_flower_matches_the_simulation(tiny_config, model):
    # every node rebuilds the frozen weights from the run's seed (and each client's rank from its global id): the
    # same function as the simulation's model
    def make(name):
        return tiny_config(run={"rounds": 2, "name": name}, partition={"num_clients": 4}, model=model)

    Simulation(make("local")).run()
    assert flower_run(make("flower"), {101: {"partition-ids": "0,1"}, 202: {"partition-ids": "2-3"}})["status"] == (
        "finished"
    )
    assert torch.equal(last_params(make("flower")), last_params(make("local")))


def test_lora_with_secaggplus_sums_the_trainable_subset(tiny_config):
    from fedhet.flower.secagg import SecAggSettings

    def make(name):
        return tiny_config(
            run={"rounds": 1, "name": name}, partition={"num_clients": 3}, train={"participation": 1.0}, model=LORA
        )

    nodes = {10 + c: {"partition-id": c} for c in range(3)}
    flower_run(make("plain"), nodes)
    assert flower_run(make("secure"), nodes, SecAggSettings())["status"] == "finished"
    plain, secure = last_params(make("plain")), last_params(make("secure"))
    assert secure.numel() == 2 * 64 + 32 * 2 + 32 * 10 + 10
    assert 0 < (secure - plain).abs().max() < 1e-4  # SecAgg+'s quantisation only


CENTRAL = {"mode": "central", "noise_multiplier": 0.5, "clip": 1.0}
LOCAL = {"mode": "local", "noise_multiplier": 0.5}


# heterogeneous ranks refuse central DP (their slot averages are not DP-FedAvg's clipped mean)
@pytest.mark.parametrize(
    ("privacy", "model"), [(CENTRAL, LORA), (LOCAL, LORA), (LOCAL, {**LORA, "lora_ranks": [2, 1]})]
)
def test_dp_clips_the_trainable_subset(tiny_config, privacy, model):
    sim = Simulation(tiny_config(run={"rounds": 1}, model=model, privacy=privacy))
    seen = capture_replies(sim)
    assert sim.run()["status"] == "finished"
    assert all(r["params"].numel() == trainable_count(sim) for r in seen[0].values())
    assert torch.isfinite(sim.algo.global_params).all()


# ----------------------------------------------------------------------------- heterogeneous ranks
HETERO = {**LORA, "lora_ranks": [2, 1]}  # even clients rank 2, odd clients rank 1


def test_heterogeneous_ranks_train_each_clients_slots_and_average_slot_by_slot(tiny_config):
    sim = Simulation(tiny_config(run={"rounds": 1}, model=HETERO, train={"participation": 1.0}))
    start = sim.algo.global_params.clone()
    seen = capture_replies(sim)
    sim.run()
    slices = sim.flat.slices()
    a_span, b_span = slices["body.fc1.1.lora_A.default.weight"], slices["body.fc1.1.lora_B.default.weight"]
    replies = seen[0]
    for cid, r in replies.items():  # a rank-1 client's slot 1 got no gradient: it replies what it received
        a, a0 = r["params"][a_span].view(2, 64), start[a_span].view(2, 64)
        assert torch.equal(a[1], a0[1]) == (cid % 2 == 1)
    held = {cid: r for cid, r in replies.items() if cid % 2 == 0}
    total = sum(r["num_examples"] for r in held.values())
    want = sum(r["num_examples"] / total * r["params"][a_span].view(2, 64)[1] for r in held.values())
    torch.testing.assert_close(sim.algo.global_params[a_span].view(2, 64)[1], want)
    b = sim.algo.global_params[b_span].view(32, 2)
    want_b = sum(r["num_examples"] / total * r["params"][b_span].view(32, 2)[:, 1] for r in held.values())
    torch.testing.assert_close(b[:, 1], want_b)


def test_heterogeneous_ranks_move_fewer_bytes_on_the_clock(tiny_config):
    sim = Simulation(tiny_config(run={"rounds": 1}, model=HETERO, system={"profiles": "constant"}))
    sim.run()
    profiles = json.loads((sim.run_dir / "system_profiles.json").read_text())
    count = trainable_count(sim)
    assert profiles["model_bytes"] == 4 * count
    # a rank-1 client leaves row 1 of A (64 entries) and column 1 of B (32 entries)
    assert [c["model_bytes"] for c in profiles["clients"][:2]] == [4 * count, 4 * (count - 64 - 32)]


@pytest.mark.parametrize("aggregation", ["fedit", "flexlora"])
def test_a_heterogeneous_lora_run_resumes_bit_for_bit(tiny_config, kill_and_resume, aggregation):
    full, resumed = kill_and_resume(
        lambda name: tiny_config(
            run={"name": name, "rounds": 3}, model=HETERO, server={"lora_aggregation": aggregation}
        )
    )
    torch.testing.assert_close(full.algo.global_params, resumed.algo.global_params, rtol=0, atol=0)


def test_heterogeneous_ranks_run_with_ffa_and_score_personal_models(tiny_config):
    sim = Simulation(
        tiny_config(
            run={"rounds": 2, "eval_local_models": True},
            partition={"local_test_fraction": 0.2},
            model=HETERO,
            server={"lora_aggregation": "ffa"},
            algorithm={"name": "ditto"},
        )
    )
    assert sim.run()["status"] == "finished"


@pytest.mark.slow
def test_lora_in_worker_processes_gives_the_same_bits(tiny_config):
    # each worker rebuilds the model, its frozen weights and the rank mask from the config
    params = {}
    for name, workers in (("local", 1), ("parallel", 2)):
        cfg = tiny_config(
            run={"rounds": 2, "name": name, "workers": workers}, model=HETERO, train={"participation": 1.0}
        )
        sim = Simulation(cfg)
        sim.run()
        params[name] = sim.algo.global_params
    torch.testing.assert_close(params["local"], params["parallel"], rtol=0, atol=0)


def test_lora_under_fedbuff(tiny_config):
    sim = Simulation(
        tiny_config(
            run={"rounds": 3},
            model=LORA,
            server={"name": "sgd", "mode": "fedbuff", "buffer_size": 2},
            system={"profiles": "uniform"},
        )
    )
    assert sim.run()["status"] == "finished"
    assert sim.algo.global_params.numel() == trainable_count(sim)


def test_ranks_by_device_tier(tiny_config):
    from fedhet.engine.system import client_lora_ranks, client_tiers

    tiers = [[0.5, 200.0, 2e6], [0.5, 50.0, 5e5]]
    cfg = tiny_config(
        run={"rounds": 1},
        model={**LORA, "lora_ranks": [2, 1], "lora_ranks_by": "tier"},
        system={"profiles": "tiers", "tiers": tiers},
    )
    tier = client_tiers(cfg.system, 6, cfg.run.seed)
    assert sorted(tier.tolist()) == [0, 0, 0, 1, 1, 1]
    assert client_lora_ranks(cfg, 6) == [2 if t == 0 else 1 for t in tier]
    sim = Simulation(cfg)
    sim.run()
    profiles = json.loads((sim.run_dir / "system_profiles.json").read_text())
    count = trainable_count(sim)
    for c, client in enumerate(profiles["clients"]):  # the slow tier moves the rank-1 share
        assert client["model_bytes"] == 4 * (count if tier[c] == 0 else count - 64 - 32)
        assert client["speed"] == tiers[tier[c]][1]
    with pytest.raises(ConfigError, match="model.lora_ranks_by='tier' gives each device tier a rank"):
        tiny_config(model={**LORA, "lora_ranks": [2, 1], "lora_ranks_by": "tier"})


def test_the_rank_mask_truncates_linear_and_conv_adapters():
    from fedhet.models.adapt import RankMask

    model = build_model("cnn_bn", (1, 8, 8), 10, channels=[4, 4, 8], hidden=[16])
    model = adapt(model, "cnn_bn", lora=LoraSpec(2, 2.0, targets=("body.conv1.0", "body.fc1.1"))).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_()
    x = torch.randn(3, 1, 8, 8)
    mask = RankMask(model)
    whole = model(x)
    mask.rank = 1
    masked = model(x)
    with torch.no_grad():  # the same as zeroing slot 1 of every adapter
        for name, p in model.named_parameters():
            if "lora_A" in name:
                p[1:] = 0
    mask.rank = None
    torch.testing.assert_close(masked, model(x))
    assert not torch.allclose(whole, masked)

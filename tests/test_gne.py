"""GNE (FedRANE's Nash-bargaining aggregation): both solvers against each other and against G^T G p = 1/p, hand
cases (identical, orthogonal and zero deltas), scale options, jitter, fallback, buffers, diagnostics, and fedavg with
server.aggregation = "gne" end to end (learns, resumes bit-exact, default path unchanged, config errors)."""

from __future__ import annotations

import math
import os

import pytest
import torch

from fedhet.algorithms import ALGORITHMS, Reply, Setup
from fedhet.algorithms.gne import GNE, NashSolveError, gram_matrix, nash_weights
from fedhet.config import TrainSection, load_config
from fedhet.engine.simulation import Simulation, build_algorithm, config_changes, resolve_config
from fedhet.errors import ConfigError
from fedhet.models import build_model
from fedhet.results.store import read_metrics


def random_deltas(k: int, d: int, seed: int, shared: float = 0.3) -> torch.Tensor:
    """d x K: a shared direction plus client noise, as clients' updates from one global model look."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(d, k, generator=g, dtype=torch.float64) + shared


# ---------------------------------------------------------------------------- the solvers
@pytest.mark.parametrize(
    ("k", "d", "seed", "shared"),
    [(2, 30, 0, 0.3), (5, 100, 1, 0.3), (10, 60, 2, 0.3), (20, 400, 3, 0.3), (20, 25, 4, 0.3), (20, 25, 0, 0.0)],
)
def test_newton_and_ccp_agree_and_solve_the_nash_equation(k, d, seed, shared):
    # the last case has conflicting deltas: M p < 0 somewhere at the uniform warm start, so CCP starts from phase I
    g = random_deltas(k, d, seed, shared)
    gram = g.T @ g
    p_newton, info_n = nash_weights(gram, "newton")
    p_ccp, info_c = nash_weights(gram, "ccp")
    assert info_n["converged"] and info_c["converged"] and not info_n["jittered"]
    torch.testing.assert_close(p_ccp, p_newton, rtol=1e-6, atol=0)
    for p in (p_newton, p_ccp):
        assert bool((p > 0).all())
        torch.testing.assert_close(gram @ p, 1 / p, rtol=1e-9, atol=0)  # G^T G p = 1/p
        assert float((g @ p).pow(2).sum()) == pytest.approx(k, rel=1e-9)  # ||G p||^2 = K: the ball r = K


@pytest.mark.parametrize("seed", [142, 147, 188])
def test_newton_converges_quadratically_on_ill_conditioned_deltas(seed):
    # a shared drift plus client deltas of very different sizes (as after a round of local SGD): before the full
    # Newton steps near the solution, these stalled at residuals ~1e-9 for 100 iterations on rounding noise
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(5000, 10, generator=gen) * torch.rand(10, generator=gen) * 0.1
    g = g + torch.randn(5000, 1, generator=gen) * 0.02
    p, info = nash_weights(gram_matrix([g[:, i].contiguous() for i in range(10)]))
    assert info["iterations"] <= 15 and info["residual"] <= 1e-12, info


def test_scale_of_the_deltas_scales_p_inversely():
    g = random_deltas(4, 50, 5)
    p1, _ = nash_weights(g.T @ g)
    p2, _ = nash_weights((3 * g).T @ (3 * g))
    torch.testing.assert_close(p2, p1 / 3, rtol=1e-10, atol=0)


def test_orthogonal_deltas_by_hand():
    # G^T G = diag(a^2, b^2): p_k a_k^2 = 1/p_k, so p = (1/a, 1/b) and G p = (1, 1): each unit direction once
    gram = torch.diag(torch.tensor([4.0, 0.25], dtype=torch.float64))
    for solver in ("newton", "ccp"):
        p, info = nash_weights(gram, solver)
        torch.testing.assert_close(p, torch.tensor([0.5, 2.0], dtype=torch.float64), rtol=1e-10, atol=0)
        assert info["converged"]


def test_identical_deltas_by_hand():
    # two copies of delta (norm 2): G^T G = 4 [[1, 1], [1, 1]], p_k * 4 (p_1 + p_2) = 1 -> p = (1/sqrt 8, 1/sqrt 8);
    # the Gram matrix is singular, so jitter is added (it moves p by ~1e-8 relative)
    gram = torch.full((2, 2), 4.0, dtype=torch.float64)
    for solver in ("newton", "ccp"):
        p, info = nash_weights(gram, solver)
        assert info["jittered"] and info["converged"]
        torch.testing.assert_close(p, torch.full((2,), 1 / math.sqrt(8), dtype=torch.float64), rtol=1e-7, atol=0)


def test_near_singular_gram_is_jittered_and_solved():
    # 6 clients in a 3-dimensional parameter space: rank 3, so G^T G is singular
    g = random_deltas(6, 3, 6)
    gram = g.T @ g
    p, info = nash_weights(gram, "newton", jitter=1e-8)
    assert info["jittered"] and info["converged"] and bool(torch.isfinite(p).all())
    jittered = gram + 1e-8 * torch.linalg.matrix_norm(gram) * torch.eye(6, dtype=torch.float64)
    # the solution for the jittered matrix (condition number ~1e8, hence the tolerance)
    torch.testing.assert_close(jittered @ p, 1 / p, rtol=1e-6, atol=0)
    _, plain = nash_weights(random_deltas(3, 50, 7).T @ random_deltas(3, 50, 7))
    assert not plain["jittered"]


def test_bad_gram_matrices_are_refused():
    with pytest.raises(NashSolveError, match="float64"):
        nash_weights(torch.eye(2))
    with pytest.raises(NashSolveError, match="zero norm"):
        nash_weights(torch.diag(torch.tensor([1.0, 0.0], dtype=torch.float64)))
    with pytest.raises(ValueError, match="valid: newton, ccp"):
        nash_weights(torch.eye(2, dtype=torch.float64), "cvx")


def test_gram_matrix_accumulates_in_float64_by_chunks():
    deltas = [torch.randn(1000, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    exact = torch.stack(deltas).double() @ torch.stack(deltas).double().T
    torch.testing.assert_close(gram_matrix(deltas, chunk=97), exact, rtol=1e-12, atol=0)


# ---------------------------------------------------------------------------- the aggregation
def test_identical_deltas_reproduce_that_delta():
    # gotcha 1: + G p with Delta_k = theta_k - theta; sum_to_one gives the delta itself, "paper" sqrt(K) times its unit
    x = torch.tensor([1.0, -1.0, 0.5])
    delta = torch.tensor([0.2, 0.1, -0.2])  # norm 0.3
    params = [x + delta] * 3
    target = GNE().target(x, params, [0.2, 0.3, 0.5])
    torch.testing.assert_close(target, x + delta)
    literal = GNE(normalize="paper").target(x, params, [0.2, 0.3, 0.5])
    torch.testing.assert_close(literal - x, delta / 0.3 * math.sqrt(3), rtol=1e-6, atol=1e-7)


def test_sum_to_one_weights_by_hand():
    # orthogonal deltas of norms 2 and 0.5: p = (1/2, 2) -> sum_to_one (0.2, 0.8); the update is (0.4, 0.4)
    x = torch.zeros(2)
    params = [torch.tensor([2.0, 0.0]), torch.tensor([0.0, 0.5])]
    gne = GNE()
    torch.testing.assert_close(gne.target(x, params, [0.5, 0.5]), torch.tensor([0.4, 0.4]))
    m = gne.metrics()
    assert m["gne_weight_min"] == pytest.approx(0.2) and m["gne_weight_max"] == pytest.approx(0.8)
    # the update (0.4, 0.4) makes 45 degrees with both deltas (Fig. 3's cosine); FedAvg's (1, 0.25) does not
    assert m["gne_cos_mean"] == pytest.approx(math.sqrt(0.5)) and m["gne_cos_min"] == pytest.approx(math.sqrt(0.5))
    assert m["gne_update_norm"] == pytest.approx(0.4 * math.sqrt(2))
    assert m["gne_fedavg_update_norm"] == pytest.approx(math.hypot(1.0, 0.25))
    assert m["gne_fedavg_cos_min"] == pytest.approx(0.25 / math.hypot(1.0, 0.25))
    assert m["gne_dropped"] == 0 and m["gne_fallback"] == 0 and m["gne_fallbacks"] == 0


def test_paper_literal_and_fedavg_norm_scales():
    x = torch.zeros(2)
    params = [torch.tensor([2.0, 0.0]), torch.tensor([0.0, 0.5])]
    literal = GNE(normalize="paper").target(x, params, [0.5, 0.5])
    torch.testing.assert_close(literal, torch.tensor([1.0, 1.0]))  # G p with p = (1/2, 2): ||G p||^2 = 2 = K
    matched = GNE(normalize="match_fedavg_norm").target(x, params, [0.5, 0.5])
    torch.testing.assert_close(matched.norm(), torch.tensor(math.hypot(1.0, 0.25)))  # FedAvg's update norm
    torch.testing.assert_close(matched[0], matched[1])  # GNE's direction


def test_zero_delta_is_dropped():
    x = torch.zeros(2)
    params = [torch.tensor([2.0, 0.0]), x.clone(), torch.tensor([0.0, 0.5])]
    gne = GNE()
    torch.testing.assert_close(gne.target(x, params, [0.2, 0.6, 0.2]), torch.tensor([0.4, 0.4]))
    assert gne.metrics()["gne_dropped"] == 1
    everyone_stayed = GNE()
    torch.testing.assert_close(everyone_stayed.target(x, [x.clone(), x.clone()], [0.5, 0.5]), x)


@pytest.mark.parametrize("solver", ["newton", "ccp"])
def test_opposite_deltas_fall_back_to_the_algorithms_weights_without_jitter(solver):
    # Delta_2 = -Delta_1: no update helps both, so G^T G p = 1/p has no solution (Newton's objective is unbounded
    # along p = (1, 1), CCP's constraints cannot all hold)
    x = torch.zeros(2)
    params = [torch.tensor([1.0, 0.0]), torch.tensor([-1.0, 0.0])]
    gne = GNE(solver=solver, jitter=0.0)
    with pytest.warns(UserWarning, match="own weights"):
        target = gne.target(x, params, [0.75, 0.25])
    torch.testing.assert_close(target, torch.tensor([0.5, 0.0]))  # 0.75 * 1 + 0.25 * (-1)
    assert gne.metrics()["gne_fallback"] == 1 and gne.metrics()["gne_fallbacks"] == 1
    with pytest.warns(UserWarning):
        gne.target(x, params, [0.75, 0.25])
    assert gne.metrics()["gne_fallbacks"] == 2
    restored = GNE(solver=solver)
    restored.load_state_dict(gne.state_dict())
    assert restored.metrics() == gne.metrics()


@pytest.mark.parametrize("solver", ["newton", "ccp"])
def test_opposite_deltas_with_jitter_cancel_out(solver):
    # jitter eps I makes the problem solvable with p_1 = p_2 (large): the symmetric compromise, a zero update
    x = torch.zeros(2)
    params = [torch.tensor([1.0, 0.0]), torch.tensor([-1.0, 0.0])]
    gne = GNE(solver=solver)
    torch.testing.assert_close(gne.target(x, params, [0.75, 0.25]), x, rtol=0, atol=1e-6)
    assert gne.metrics()["gne_fallbacks"] == 0 and gne.metrics()["gne_jitters"] == 1


def test_options_are_checked():
    with pytest.raises(ValueError, match="valid: sum_to_one, paper, match_fedavg_norm"):
        GNE(normalize="unit")
    with pytest.raises(ValueError, match="valid: newton, ccp"):
        GNE(solver="ecos")


def test_buffers_are_sample_averaged_and_the_server_optimiser_steps():
    train = TrainSection(lr=0.1)
    entry = ALGORITHMS.get("fedavg")
    algo = entry.obj(entry.params(), Setup(2, 10, train, lambda: None))
    algo.use_gne(GNE())
    algo.init_server(torch.zeros(2), torch.zeros(2))
    replies = {
        0: Reply(tensors={"params": torch.tensor([2.0, 0.0]), "buffers": torch.tensor([1.0, 1.0])}, num_examples=30),
        1: Reply(tensors={"params": torch.tensor([0.0, 0.5]), "buffers": torch.tensor([5.0, 3.0])}, num_examples=10),
    }
    algo.aggregate(1, replies, "train")
    torch.testing.assert_close(algo.global_params, torch.tensor([0.4, 0.4]))  # GNE, not (1.5, 0.125)
    torch.testing.assert_close(algo.global_buffers, torch.tensor([2.0, 1.5]))  # 0.75 * b_0 + 0.25 * b_1
    assert algo.aggregation_metrics()["gne_fedavg_update_norm"] == pytest.approx(math.hypot(1.5, 0.125))


# ---------------------------------------------------------------------------- configuration and end to end
def test_algorithms_that_do_not_average_refuse_gne(tiny_config):
    for name in ("scaffold", "feddyn", "fednova", "qfedavg", "fedbc", "creff"):
        with pytest.raises(ConfigError, match=f"{name}'s server does not take; algorithms that accept it: .*fedavg"):
            resolve_config(tiny_config(algorithm={"name": name}, server={"aggregation": "gne"}))
    for name in ("fedavg", "fedprox", "moon", "fedrod", "fednh", "fedacd"):
        resolve_config(tiny_config(algorithm={"name": name}, server={"aggregation": "gne"}))


def test_gne_options_without_gne_are_refused(tiny_config):
    with pytest.raises(ConfigError, match="server.gne_solver applies only with server.aggregation='gne'"):
        tiny_config(server={"gne_solver": "ccp"})
    with pytest.raises(ConfigError, match="gne_normalize"):
        tiny_config(server={"aggregation": "gne", "gne_normalize": "unit"})
    overrides = ["server.name=fedadam", "server.aggregation=gne", "server.gne_normalize=paper"]
    assert load_config(None, overrides).server.gne_normalize == "paper"  # as `fedhet run -s ...` gives it
    cfg = tiny_config(server={"name": "fedadam", "aggregation": "gne", "gne_solver": "ccp"})
    algo = build_algorithm(cfg, Setup(6, 10, cfg.train, lambda: build_model("mlp", (64,), 10)))
    assert algo.gne.solver == "ccp" and type(algo.server_opt).__name__ == "FedAdam"


def test_a_run_saved_before_the_aggregation_setting_resumes(tiny_config):
    current = resolve_config(tiny_config())
    saved = {**current, "server": {k: v for k, v in current["server"].items() if not k.startswith(("agg", "gne"))}}
    assert config_changes(saved, current) == []
    assert config_changes(saved, resolve_config(tiny_config(server={"aggregation": "gne"})))


def test_default_aggregation_is_unchanged_bit_for_bit(tiny_config):
    from fedhet.algorithms.base import weighted_sum

    sim = Simulation(tiny_config(run={"name": "plain", "rounds": 2}))
    seen = []
    aggregate = sim.algo.aggregate

    def recording(rnd, replies, phase):
        before = sim.algo.global_params.clone()
        weights = sim.algo.aggregation_weights(replies)
        out = aggregate(rnd, replies, phase)
        expected = before + (weighted_sum([r.tensors["params"] for r in replies.values()], weights) - before)
        seen.append(torch.equal(sim.algo.global_params, expected))  # server sgd lr 1: x + 1 * (avg - x)
        return out

    sim.algo.aggregate = recording
    sim.run()
    assert seen == [True, True] and sim.algo.gne is None
    assert not any(k.startswith("gne") for k in read_metrics(sim.run_dir / "metrics.jsonl")[-1])
    assert "gne" not in sim.algo.state_dict()


def test_fedavg_with_gne_learns_on_digits_and_resumes_bit_exact(tiny_config, kill_and_resume):
    full, resumed = kill_and_resume(
        lambda name: tiny_config(
            run={"name": name, "rounds": 5}, train={"participation": 1.0}, server={"aggregation": "gne"}
        )
    )
    r_full, r_cut = (read_metrics(s.run_dir / "metrics.jsonl") for s in (full, resumed))
    keys = ("round", "test_acc", "test_loss", "train_loss", "gne_cos_mean", "gne_update_norm", "gne_fallbacks")
    assert [{k: r[k] for k in keys} for r in r_full] == [{k: r[k] for k in keys} for r in r_cut]
    last = r_full[-1]
    assert last["test_acc"] > 0.8, last  # 10 classes: chance is 0.1
    assert last["gne_fallbacks"] == 0 and last["gne_dropped"] == 0
    assert last["gne_cos_min"] > 0  # Delta_k^T G p = 1 / p_k > 0: the update agrees with every client
    torch.testing.assert_close(full.algo.global_params, resumed.algo.global_params, rtol=0, atol=0)
    assert full.algo.gne.state_dict() == resumed.algo.gne.state_dict()


def test_gne_on_flower_matches_the_simulation(tiny_config):
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # no calls home from Flower in tests (read when flwr loads)
    pytest.importorskip("flwr")
    from fedhet.engine.checkpoint import read_checkpoint
    from fedhet.flower.app import RunOptions, run_server
    from fedhet.flower.client import make_client_app
    from fedhet.flower.loopback import LoopbackGrid

    def cfg(name):
        return tiny_config(run={"rounds": 2, "name": name}, partition={"num_clients": 4}, server={"aggregation": "gne"})

    local = Simulation(cfg("local"))
    local.run()
    nodes = {101: {"partition-ids": "0,1"}, 202: {"partition-ids": "2-3"}}
    grid = LoopbackGrid(make_client_app(lambda _: cfg("flower")), nodes)
    assert run_server(grid, cfg("flower"), RunOptions())["status"] == "finished"
    flower_dir = local.run_dir.parent / "flower"
    drop = ("elapsed_s",)
    mine, theirs = (
        [{k: v for k, v in r.items() if k not in drop} for r in read_metrics(d / "metrics.jsonl")]
        for d in (local.run_dir, flower_dir)
    )
    assert mine == theirs and "gne_cos_mean" in mine[-1]
    saved = read_checkpoint(flower_dir / "checkpoints" / "last.pt")["algo"]
    assert torch.equal(saved["global_params"], local.algo.global_params) and saved["gne"]["fallbacks"] == 0

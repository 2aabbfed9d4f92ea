"""Robust aggregation and attacks (issue 31, parts 3-4): each rule against hand computations, norm bounding, the
config's refusals, and on digits an attack that breaks FedAvg next to aggregators that resist it, a backdoor's
attack success rate, and an attacked robust run resumed bit for bit."""

from __future__ import annotations

import json

import pytest
import torch

from fedhet.algorithms.privacy import clip_rows
from fedhet.algorithms.robust import (
    RobustAggregator,
    coordinate_median,
    geometric_median,
    krum_scores,
    krum_select,
    trimmed_mean,
)
from fedhet.engine.attack import attack_success_rate, malicious_clients, stamp
from fedhet.engine.simulation import Simulation, resolve_config
from fedhet.errors import ConfigError
from fedhet.results.store import read_metrics

D = torch.float64


# ---------------------------------------------------------------------------- the rules, by hand
def test_median_of_three_hand_made_updates():
    u = torch.tensor([[1.0, -2.0, 5.0], [3.0, 0.0, -1.0], [100.0, 1.0, 2.0]])
    assert coordinate_median(u).tolist() == [3.0, 0.0, 2.0]
    # an even count: the mean of the two middle values, whatever order the rows come in
    four = torch.tensor([[4.0], [1.0], [10.0], [2.0]])
    assert coordinate_median(four).tolist() == [3.0]


def test_trimmed_mean_drops_the_extremes_of_each_coordinate():
    u = torch.tensor([[1.0, 10.0], [2.0, -50.0], [3.0, 20.0], [4.0, 30.0], [1000.0, 40.0]])
    # beta = 0.2 of 5: one value off each end per coordinate
    assert trimmed_mean(u, 0.2).tolist() == [3.0, 20.0]  # (2+3+4)/3, (10+20+30)/3
    assert trimmed_mean(u, 0.0).tolist() == pytest.approx(u.double().mean(0).tolist())
    assert trimmed_mean(u, 0.1).tolist() == pytest.approx(u.double().mean(0).tolist())  # floor(0.5) = 0


def test_krum_picks_the_update_closest_to_its_neighbours():
    honest = torch.tensor([[1.0, 1.0], [1.1, 0.9], [0.9, 1.0], [1.0, 1.1], [0.95, 1.05]])
    u = torch.cat([honest, torch.tensor([[-10.0, -10.0], [8.0, -9.0]])])  # n = 7, f = 2: 3 neighbours each
    scores = krum_scores(u, 2)
    # by hand for the first: its 3 nearest others are (0.95, 1.05), (1.0, 1.1) and (1.1, 0.9)/(0.9, 1.0)
    assert float(scores[0]) == pytest.approx(0.005 + 0.01 + 0.01)
    assert krum_select(u, 2, 1) == [4]  # (0.95, 1.05) sits in the middle of the honest cluster
    assert krum_select(u, 2, 5) == [0, 1, 2, 3, 4]  # Multi-Krum's set: exactly the honest ones
    agg = RobustAggregator("multikrum", byzantine=2)  # m = n - f = 5
    out = agg.combine(u, torch.full((7,), 1 / 7, dtype=D))
    torch.testing.assert_close(out, honest.double().mean(0))


def test_multikrum_averages_with_the_algorithms_weights():
    u = torch.tensor([[0.0], [1.0], [2.0], [50.0], [-60.0], [1.5]])
    w = torch.tensor([1.0, 3.0, 1.0, 1.0, 1.0, 1.0], dtype=D)
    agg = RobustAggregator("multikrum", byzantine=1, multikrum_m=4)
    assert krum_select(u, 1, 4) == [0, 1, 2, 5]
    assert agg.combine(u, w).tolist() == pytest.approx([(0 + 3 + 2 + 1.5) / 6])


def test_geometric_median_of_symmetric_points_and_an_outlier():
    square = torch.tensor([[1.0, 1.0], [-1.0, 1.0], [1.0, -1.0], [-1.0, -1.0]])
    v, _ = geometric_median(square + torch.tensor([3.0, -2.0]), torch.ones(4), 1e-6, 100)
    torch.testing.assert_close(v, torch.tensor([3.0, -2.0], dtype=D))
    # three points on a line and a far outlier: the median is the middle point (by hand: the three unit vectors
    # from (1, 0) to the others sum to (0, 1), of length 1, so no direction lowers the sum), where the mean moves 250
    pts = torch.tensor([[0.0, 0.0], [1.0, 0.0], [2.0, 0.0], [1.0, 1000.0]])
    v, iters = geometric_median(pts, torch.ones(4), 1e-9, 1000)
    assert float((v - torch.tensor([1.0, 0.0], dtype=D)).norm()) < 0.1 and iters > 1


def test_geometric_median_minimises_the_weighted_distance_sum():
    gen = torch.Generator().manual_seed(0)
    pts = torch.randn(7, 5, generator=gen, dtype=D)
    w = torch.rand(7, generator=gen, dtype=D) + 0.1
    v, _ = geometric_median(pts, w, 1e-12, 1000)

    def cost(p):
        return float((w * (pts - p).norm(dim=1)).sum())

    for _ in range(50):  # no nearby point is better
        step = torch.randn(5, generator=gen, dtype=D) * 1e-3
        assert cost(v) <= cost(v + step) + 1e-12


def test_norm_bounding_scales_only_long_updates():
    u = torch.tensor([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0]])
    out, norms = clip_rows(u, 1.0)  # the clip central DP uses too
    assert norms.tolist() == [5.0, 0.5, 0.0]
    torch.testing.assert_close(out, torch.tensor([[0.6, 0.8], [0.3, 0.4], [0.0, 0.0]]))


def test_norm_bound_composes_with_the_algorithms_average():
    x = torch.tensor([1.0, 1.0])
    params = [x + torch.tensor([3.0, 4.0]), x + torch.tensor([0.0, 0.5])]
    agg = RobustAggregator("weights", norm_bound=1.0)
    seen = []

    def average(ps, ws):
        seen.append([p - x for p in ps])
        return sum(w * p for p, w in zip(ps, ws, strict=True))

    out = agg.target(x, params, [0.5, 0.5], average)
    torch.testing.assert_close(out, x + torch.tensor([0.3, 0.65]))
    torch.testing.assert_close(seen[0][0], torch.tensor([0.6, 0.8]))
    assert agg.metrics() == {"robust/bounded_fraction": 0.5}
    med = RobustAggregator("median", norm_bound=1.0).target(x, params, [0.5, 0.5], average)
    torch.testing.assert_close(med, x + torch.tensor([0.3, 0.65]))  # mean of two middles = mean of the two


# ---------------------------------------------------------------------------- attacks, by hand
def test_malicious_clients_are_seeded_and_sized(tiny_config):
    cfg = tiny_config(attack={"kind": "sign_flip", "fraction": 0.3}, partition={"num_clients": 10}).attack
    chosen = malicious_clients(cfg, 10, 0)
    assert len(chosen) == 3 and chosen == malicious_clients(cfg, 10, 0) and chosen != malicious_clients(cfg, 10, 1)
    assert malicious_clients(cfg.model_copy(update={"fraction": 0.01}), 10, 0) != []  # at least one


def test_stamp_puts_a_white_square_in_the_corner():
    x = torch.zeros(2, 1, 5, 5)
    out = stamp(x, 2, (7.0,))
    assert out[:, :, 3:, 3:].eq(7.0).all() and out[:, :, :3].eq(0).all() and out[:, :, :, :3].eq(0).all()
    assert x.eq(0).all()  # a copy


# ---------------------------------------------------------------------------- configuration
def test_config_errors(tiny_config):
    with pytest.raises(ConfigError, match="attack.kind.*'label_flip'.*'backdoor'"):
        tiny_config(attack={"kind": "poison"})
    with pytest.raises(ConfigError, match="server.aggregation.*'median'"):
        tiny_config(server={"aggregation": "mean"})
    with pytest.raises(ConfigError, match="server.trim_fraction applies only with server.aggregation='trimmed_mean'"):
        tiny_config(server={"trim_fraction": 0.2})
    with pytest.raises(ConfigError, match="attack.scale applies only with attack.kind='scale'"):
        tiny_config(attack={"kind": "sign_flip", "scale": 3})
    # 3 clients a round: Krum with f = 1 needs more than 4; refused before any data is loaded
    with pytest.raises(ConfigError, match="needs more than 2 f \\+ 2 = 4 clients per round, and the run has 3"):
        resolve_config(tiny_config(server={"aggregation": "krum"}))
    resolve_config(tiny_config(server={"aggregation": "krum", "byzantine": 0}))
    with pytest.raises(ConfigError, match="scaffold's server does not take"):
        resolve_config(tiny_config(algorithm={"name": "scaffold"}, server={"aggregation": "median"}))
    with pytest.raises(ConfigError, match="server.norm_bound replaces .*scaffold's server does not take"):
        resolve_config(tiny_config(algorithm={"name": "scaffold"}, server={"norm_bound": 1.0}))
    with pytest.raises(ConfigError, match="centralized trains one client holding every client's data"):
        resolve_config(tiny_config(algorithm={"name": "centralized"}, attack={"kind": "label_flip"}))
    with pytest.raises(ConfigError, match="attack.target=10 is not a class"):
        Simulation(tiny_config(attack={"kind": "backdoor", "target": 10}))
    with pytest.raises(ConfigError, match="stamps a pixel pattern on images; dataset 'synthetic'"):
        Simulation(
            tiny_config(
                dataset={"name": "synthetic"}, partition={"local_test_fraction": 0.2}, attack={"kind": "backdoor"}
            )
        )


# ---------------------------------------------------------------------------- end to end on digits
def attacked(tiny_config, name, aggregation="weights", kind="sign_flip", **server):
    attack = {"kind": kind, "fraction": 0.3} if kind != "none" else {}
    if kind == "sign_flip":
        attack["flip_scale"] = 4.0
    return tiny_config(
        run={"name": name, "rounds": 4},
        partition={"name": "iid", "num_clients": 10},
        train={"participation": 1.0},
        server={"aggregation": aggregation, **server},
        attack=attack,
    )


def final(sim):
    return read_metrics(sim.run_dir / "metrics.jsonl")[-1]


def test_sign_flipping_breaks_fedavg_and_robust_rules_resist(tiny_config):
    accs = {}
    for agg, extra in [
        ("weights", {}),
        ("median", {}),
        ("krum", {"byzantine": 3}),
        ("trimmed_mean", {"trim_fraction": 0.3}),
    ]:
        sim = Simulation(attacked(tiny_config, agg, agg, **extra))
        sim.run()
        accs[agg] = final(sim)["test_acc"]
    clean = Simulation(attacked(tiny_config, "clean", kind="none"))
    clean.run()
    accs["clean"] = final(clean)["test_acc"]
    # measured (seed 0): clean 0.89, fedavg 0.09, median 0.82, krum 0.81, trimmed mean 0.80; chance is 0.1
    assert accs["clean"] > 0.85 and accs["weights"] < 0.3, accs
    for agg in ("median", "krum", "trimmed_mean"):
        assert accs[agg] > 0.7, accs
    record = json.loads((sim.run_dir / "attack.json").read_text())
    assert record["malicious_clients"] == malicious_clients(sim.cfg.attack, 10, 0) and record["kind"] == "sign_flip"
    summary = json.loads((sim.run_dir / "summary.json").read_text())
    assert summary["attack"]["malicious_clients"] == record["malicious_clients"]


def test_backdoor_logs_its_success_rate(tiny_config):
    sim = Simulation(
        tiny_config(
            run={"name": "backdoor", "rounds": 4},
            partition={"name": "iid", "num_clients": 10},
            train={"participation": 1.0},
            attack={"kind": "backdoor", "fraction": 0.3, "target": 0, "poison_fraction": 0.5},
        )
    )
    sim.run()
    records = read_metrics(sim.run_dir / "metrics.jsonl")
    assert all(0 <= r["attack/asr"] <= 1 for r in records)
    clean = Simulation(attacked(tiny_config, "clean", kind="none"))
    clean.run()
    fed = clean.eval_fed
    clean.flat.set_params(clean.algo.global_params)
    before = attack_success_rate(sim.cfg.attack, clean.model, fed, 1024)
    assert records[-1]["attack/asr"] > before + 0.3, (records[-1]["attack/asr"], before)
    assert records[-1]["test_acc"] > 0.8  # the clean task still learns


def test_attacked_robust_run_resumes_bit_exact(tiny_config, kill_and_resume):
    def make(name):
        return attacked(tiny_config, name, "geomed", kind="gaussian", norm_bound=2.0)

    full, resumed = kill_and_resume(make)
    r_full, r_cut = (read_metrics(s.run_dir / "metrics.jsonl") for s in (full, resumed))
    drop = ("elapsed_s",)
    assert [{k: v for k, v in r.items() if k not in drop} for r in r_full] == [
        {k: v for k, v in r.items() if k not in drop} for r in r_cut
    ]
    assert "robust/geomed_iterations" in r_full[-1] and "robust/bounded_fraction" in r_full[-1]
    torch.testing.assert_close(full.algo.global_params, resumed.algo.global_params, rtol=0, atol=0)


def test_update_and_data_attacks_by_hand(tiny_config):
    from types import SimpleNamespace

    from fedhet.algorithms.contract import Message, Reply
    from fedhet.engine.attack import Attack

    fed = SimpleNamespace(name="toy", num_classes=10, num_clients=4, white_value=(2.0,), input_shape=(1, 4, 4))
    x = torch.tensor([1.0, 1.0])
    msg = Message(tensors={"params": x}, scalars={})

    def replied(kind, **extra):
        cfg = tiny_config(attack={"kind": kind, "fraction": 1.0, **extra}).attack
        reply = Reply(tensors={"params": x + torch.tensor([0.5, -1.0])}, num_examples=1, metrics={})
        Attack(cfg, fed, 0).corrupt(2, 3, 0, msg, reply)
        return reply.tensors["params"]

    torch.testing.assert_close(replied("sign_flip", flip_scale=2.0), x + torch.tensor([-1.0, 2.0]))
    torch.testing.assert_close(replied("scale", scale=3.0), x + torch.tensor([1.5, -3.0]))
    noise = replied("gaussian", std=0.5) - x
    assert not torch.equal(noise, torch.tensor([0.5, -1.0])) and torch.equal(replied("gaussian", std=0.5) - x, noise)
    flip = Attack(tiny_config(attack={"kind": "label_flip", "fraction": 1.0}).attack, fed, 0).poison(0)
    assert flip(torch.zeros(3, 1, 4, 4), torch.tensor([0, 3, 9]))[1].tolist() == [9, 6, 0]
    cfg = tiny_config(attack={"kind": "backdoor", "fraction": 0.5, "target": 7, "poison_fraction": 0.5}).attack
    attack = Attack(cfg, fed, 0)
    honest = next(c for c in range(4) if c not in attack.malicious)
    assert len(attack.malicious) == 2 and attack.poison(honest) is None
    xb, yb = attack.poison(min(attack.malicious))(torch.zeros(3, 1, 4, 4), torch.tensor([1, 2, 3]))
    assert yb.tolist() == [7, 7, 3]  # ceil(0.5 * 3) = 2 poisoned
    assert xb[:2, :, 1:, 1:].eq(2.0).all() and xb[2].eq(0).all() and xb[:, :, 0].eq(0).all()


def test_update_attacks_reach_methods_that_reply_with_their_update(tiny_config):
    """SCAFFOLD, FedNova and q-FedAvg send the update itself, not a model: the attack must act on it (it once
    skipped them silently, so a SCAFFOLD run under attack equalled the clean one), and their other tensors stay."""
    from types import SimpleNamespace

    from fedhet.algorithms.contract import Message, Reply
    from fedhet.engine.attack import UPDATE_TENSORS, Attack

    fed = SimpleNamespace(name="toy", num_classes=10, num_clients=4, white_value=(2.0,), input_shape=(1, 4, 4))
    msg = Message(tensors={"params": torch.ones(2), "c": torch.zeros(2)}, scalars={})
    cfg = tiny_config(attack={"kind": "sign_flip", "fraction": 1.0, "flip_scale": 2.0}).attack
    for key in UPDATE_TENSORS:
        reply = Reply(tensors={key: torch.tensor([0.5, -1.0]), "delta_c": torch.tensor([3.0, 4.0])}, num_examples=1)
        Attack(cfg, fed, 0).corrupt(1, 2, 0, msg, reply)
        torch.testing.assert_close(reply.tensors[key], torch.tensor([-1.0, 2.0]))
        torch.testing.assert_close(reply.tensors["delta_c"], torch.tensor([3.0, 4.0]))


def test_a_sign_flip_changes_a_scaffold_run(tiny_config):
    def final(name, **attack):
        cfg = tiny_config(run={"rounds": 2, "name": name}, algorithm={"name": "scaffold"}, attack=attack)
        Simulation(cfg).run()
        return read_metrics(Simulation(cfg).run_dir / "metrics.jsonl")[-1]["test_loss"]

    assert final("clean", kind="none") != final("flipped", kind="sign_flip", fraction=0.5, flip_scale=4.0)


def test_attacks_over_flower_match_the_simulation(tiny_config):
    import os

    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    pytest.importorskip("flwr")
    from fedhet.flower.app import RunOptions, run_server
    from fedhet.flower.client import make_client_app
    from fedhet.flower.loopback import LoopbackGrid

    def cfg(name):
        return tiny_config(
            run={"rounds": 2, "name": name},
            partition={"num_clients": 4},
            server={"aggregation": "median"},
            attack={"kind": "backdoor", "fraction": 0.5},
        )

    local = Simulation(cfg("local"))
    local.run()
    nodes = {101: {"partition-ids": "0,1"}, 202: {"partition-ids": "2-3"}}
    grid = LoopbackGrid(make_client_app(lambda _: cfg("flower")), nodes)
    assert run_server(grid, cfg("flower"), RunOptions())["status"] == "finished"
    flower_dir = local.run_dir.parent / "flower"
    mine, theirs = (
        [{k: v for k, v in r.items() if k != "elapsed_s"} for r in read_metrics(d / "metrics.jsonl")]
        for d in (local.run_dir, flower_dir)
    )
    assert mine == theirs and "attack/asr" in mine[-1]
    assert (flower_dir / "attack.json").read_text() == (local.run_dir / "attack.json").read_text()


def test_a_run_saved_before_robustness_and_attacks_resumes(tiny_config):
    from fedhet.engine.simulation import config_changes

    current = resolve_config(tiny_config())
    new_keys = ("trim_fraction", "byzantine", "multikrum_m", "geomed_iters", "geomed_eps", "norm_bound")
    saved = {k: v for k, v in current.items() if k != "attack"}
    saved["server"] = {k: v for k, v in current["server"].items() if k not in new_keys}
    assert config_changes(saved, current) == []
    assert config_changes(saved, resolve_config(tiny_config(attack={"kind": "label_flip"})))

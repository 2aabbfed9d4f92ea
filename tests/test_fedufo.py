"""FedUFO, FedUAD and the ablation presets: each loss by hand, one client's round by hand, cls == FedAvg, end to end."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fedhet.algorithms import ALGORITHMS, Setup
from fedhet.algorithms import fedufo as ufo
from fedhet.algorithms.base import ClientContext, ClientData
from fedhet.config import TrainSection
from fedhet.engine.simulation import Simulation, build_training
from fedhet.errors import ConfigError
from fedhet.models import build_model
from fedhet.results.store import read_metrics
from fedhet.toolkit.flat import FlatModel
from fedhet.toolkit.local import batch_indices

PRESETS = ["fedufo", "feduad", "fedufo_cls", "fedufo_cgr", "fedufo_cgl", "fedufo_uad_cgr", "fedufo_uad_cgl"]


# ---------------------------------------------------------------------------------------------- the losses
def test_class_proportions_sum_to_one_per_class_and_are_zero_for_a_class_absent_from_the_group():
    counts = torch.tensor([[2.0, 0.0, 1.0, 0.0], [6.0, 3.0, 0.0, 0.0]])
    p = ufo.class_proportions(counts)
    assert p.tolist() == [[0.25, 0.0, 1.0, 0.0], [0.75, 1.0, 0.0, 0.0]]
    assert p.sum(0).tolist() == [1.0, 1.0, 1.0, 0.0]  # class 3: nobody holds it, no 0/0


def test_group_fusion_by_hand():
    probs = torch.tensor([[[0.7, 0.2, 0.1]], [[0.1, 0.6, 0.3]]])  # (G=2, B=1, C=3)
    p = torch.tensor([[0.25, 0.0, 1.0], [0.75, 1.0, 0.0]])
    m = [0.25 * 0.7 + 0.75 * 0.1, 0.0 * 0.2 + 1.0 * 0.6, 1.0 * 0.1 + 0.0 * 0.3]  # 0.25, 0.6, 0.1
    z = sum(math.exp(v) for v in m)
    literal = ufo.fuse_group(probs, p, "softmax")
    torch.testing.assert_close(literal, torch.tensor([[math.exp(v) / z for v in m]]))
    l1 = ufo.fuse_group(probs, p, "l1")
    torch.testing.assert_close(l1, torch.tensor([[v / sum(m) for v in m]]))
    # the literal target is flat (notes 2.5.8): even a one-hot mixture gives at most e / (e + C - 1)
    onehot = ufo.fuse_group(torch.tensor([[[1.0, 0.0, 0.0]]]), torch.ones(1, 3), "softmax")
    assert onehot.max().item() == pytest.approx(math.e / (math.e + 2))


def test_kl_direction_and_reduction_by_hand():
    logits = torch.tensor([[1.0, 0.0, -1.0], [0.0, 0.5, 0.0]])
    target = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    pairs = list(zip(target.view(-1).tolist(), F.softmax(logits, 1).view(-1).tolist(), strict=True))
    forward = [t * math.log(t / q) for t, q in pairs if t]  # 0 log 0 = 0
    reverse = [q * math.log(q / max(t, ufo.PROB_FLOOR)) for t, q in pairs]
    assert ufo.kl_to_target(logits, target, "forward", "batchmean").item() == pytest.approx(sum(forward) / 2)
    assert ufo.kl_to_target(logits, target, "forward", "mean").item() == pytest.approx(sum(forward) / 6)
    assert ufo.kl_to_target(logits, target, "reverse", "batchmean").item() == pytest.approx(sum(reverse) / 2)
    expected = F.kl_div(F.log_softmax(logits, 1), target, reduction="batchmean")  # PyTorch's KLDivLoss
    torch.testing.assert_close(ufo.kl_to_target(logits, target, "forward", "batchmean"), expected)


def test_uniform_loss_by_hand_and_its_minimum_is_log_k():
    logits = torch.tensor([[0.0, math.log(2.0), 0.0]])  # probabilities 1/4, 1/2, 1/4
    expected = -(math.log(0.25) + math.log(0.5) + math.log(0.25)) / 3
    assert ufo.uniform_loss(logits).item() == pytest.approx(expected)
    assert ufo.uniform_loss(torch.zeros(4, 5)).item() == pytest.approx(math.log(5))


def test_discriminator_loss_by_hand():
    identity = torch.nn.Identity()  # the "features" are D's logits
    own = torch.tensor([[2.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    f1 = torch.tensor([[0.0, 1.0, 0.0], [0.0, 1.0, 0.0]])
    f2 = torch.tensor([[0.0, 0.0, 3.0], [1.0, 0.0, 0.0]])

    def ce(row, label):
        return math.log(sum(math.exp(v) for v in row)) - row[label]

    own_term = (ce([2, 0, 0], 0) + ce([0, 0, 0], 0)) / 2
    others = ((ce([0, 1, 0], 1) + ce([0, 1, 0], 1)) / 2 + (ce([0, 0, 3], 2) + ce([1, 0, 0], 2)) / 2) / 2
    loss = ufo.discriminator_loss(identity, own, 0, [(f1, 1), (f2, 2)])
    assert loss.item() == pytest.approx(own_term + others)
    assert ufo.discriminator_loss(identity, own, 0, []).item() == pytest.approx(own_term)  # a group of one


# ------------------------------------------------------------------------------------ one client, by hand
def build(**params):
    def make():
        model = build_model("mlp", (4,), 3, hidden=[5])
        return ufo.FedUFO.prepare_federated_model(config, model, 4)

    config = ufo.FedUFOConfig(**params)
    train = TrainSection(batch_size=6, local_steps=1, lr=0.1)
    return make, ufo.FedUFO(config, Setup(num_clients=4, num_classes=3, train=train, build_model=make)), train


def context(algo, make, train, cid, phase, msg, x, y, rnd=1, state=None):
    model = make()
    return ClientContext(
        cid=cid,
        round=rnd,
        phase=phase,
        message=msg,
        data=ClientData(x, y, 3),
        state={} if state is None else state,
        model=model,
        flat=FlatModel(model),
        train=train,
        generator=torch.Generator().manual_seed(cid),
    )


def data(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g)


def phase_a(algo, make, train, clients):
    """Both phases' messages: the priors of ``clients`` trained and relayed."""
    msgs = algo.configure(1, list(clients), "prior")
    replies = {c: algo.client_update(context(algo, make, train, c, "prior", msgs[c], *clients[c])) for c in clients}
    algo.aggregate(1, replies, "prior")
    return replies, algo.configure(1, list(clients), "posterior")


def test_the_discriminator_has_one_output_per_client_of_the_federation():
    make, algo, _ = build()
    disc = make().discriminator
    assert [m.out_features for m in disc.net if isinstance(m, torch.nn.Linear)] == [5, 4]  # hidden = embedding
    assert algo.phases == ("prior", "posterior")
    assert ufo.FedUFO(ufo.FedUFOClsConfig(), algo.setup).phases == ("train",)  # cls: FedAvg's single exchange


def test_one_round_of_one_client_by_hand():
    torch.manual_seed(0)
    make, algo, train = build(stage1_rounds=0)
    w0 = FlatModel(make()).get_params()
    algo.init_server(w0, torch.zeros(0))
    clients = {1: data(1), 3: data(3)}
    priors, msgs = phase_a(algo, make, train, clients)
    assert msgs[1] is msgs[3]  # one message for the group: the priors are not copied per client
    assert msgs[1].tensors["group"].tolist() == [1, 3]
    counts = torch.stack([torch.bincount(clients[c][1], minlength=3).float() for c in (1, 3)])
    torch.testing.assert_close(msgs[1].tensors["proportions"], counts / counts.sum(0))

    x, y = clients[1]
    reply = algo.client_update(context(algo, make, train, 1, "posterior", msgs[1], x, y))

    # by hand: one full-batch SGD step of the model on CE + UAD + CGR + 3 CGL, D frozen; then one step of D
    ref = make()
    flat = FlatModel(ref)
    disc = algo.disc_slice()

    def outputs(w):
        flat.set_params(w)
        with torch.no_grad():
            f = ref.body(x)
            return f, F.softmax(ref.head(f), 1)

    f3, _ = outputs(priors[3].tensors["params"])
    group_probs = torch.stack([outputs(priors[c].tensors["params"])[1] for c in (1, 3)])
    p = (counts / counts.sum(0))[:, None, :]
    cgr_target = F.softmax((p * group_probs).sum(0), 1)
    _, global_probs = outputs(w0)
    flat.set_params(w0)
    flat.zero_grad()
    f = ref.body(x)
    log_q = F.log_softmax(ref.head(f), 1)
    uad = -F.log_softmax(ref.discriminator(f), 1).sum(1).mean() / 4
    kl_group = (cgr_target * (cgr_target.log() - log_q)).sum() / 6
    kl_global = (global_probs * (global_probs.log() - log_q)).sum() / 6
    (F.nll_loss(log_q, y) + uad + kl_group + 3 * kl_global).backward()
    expected = w0 - 0.1 * flat.grad
    expected[disc] = w0[disc]
    flat.set_params(expected)
    flat.zero_grad()
    with torch.no_grad():
        own = ref.body(x)
    d_loss = F.cross_entropy(ref.discriminator(own), torch.full((6,), 1)) + F.cross_entropy(
        ref.discriminator(f3), torch.full((6,), 3)
    )
    d_loss.backward()
    expected[disc] -= 0.1 * flat.grad[disc]
    torch.testing.assert_close(reply.tensors["params"], expected)
    assert reply.metrics["disc_loss"] == pytest.approx(d_loss.item())


def test_step_schedule_alternates_model_and_discriminator_per_batch_by_hand():
    torch.manual_seed(0)
    make, algo, _ = build(stage1_rounds=0, cgr=False, cgl=False, disc_schedule="step")
    train = TrainSection(batch_size=3, local_steps=2, lr=0.1)
    algo.setup.train = train
    w0 = FlatModel(make()).get_params()
    algo.init_server(w0, torch.zeros(0))
    clients = {1: data(1), 3: data(3)}
    priors, msgs = phase_a(algo, make, train, clients)
    x, y = clients[1]
    reply = algo.client_update(context(algo, make, train, 1, "posterior", msgs[1], x, y))

    # by hand: model step on batch 1 (CE + UAD, D frozen), D step on batch 1's new features, the same on batch 2
    ref = make()
    flat = FlatModel(ref)
    disc = algo.disc_slice()
    flat.set_params(priors[3].tensors["params"])
    with torch.no_grad():
        f3 = ref.body(x)
    w = w0.clone()
    d_losses = []
    for idx in batch_indices(6, 3, 2, torch.Generator().manual_seed(1)):
        flat.set_params(w)
        flat.zero_grad()
        f = ref.body(x[idx])
        uad = -F.log_softmax(ref.discriminator(f), 1).sum(1).mean() / 4
        (F.cross_entropy(ref.head(f), y[idx]) + uad).backward()
        d = w[disc].clone()
        w = w - 0.1 * flat.grad
        w[disc] = d
        flat.set_params(w)
        flat.zero_grad()
        with torch.no_grad():
            own = ref.body(x[idx])
        d_loss = F.cross_entropy(ref.discriminator(own), torch.full((3,), 1)) + F.cross_entropy(
            ref.discriminator(f3[idx]), torch.full((3,), 3)
        )
        d_loss.backward()
        w[disc] -= 0.1 * flat.grad[disc]
        d_losses.append(d_loss.item())
    torch.testing.assert_close(reply.tensors["params"], w)
    assert reply.metrics["disc_loss"] == pytest.approx(sum(d_losses) / 2)


def test_the_discriminator_is_frozen_while_the_model_trains_and_priors_are_plain_cross_entropy():
    make, algo, _ = build(stage1_rounds=0, disc_epochs=0)
    train = TrainSection(batch_size=2, local_steps=3, lr=0.1, momentum=0.9, weight_decay=0.01)
    algo.setup.train = train
    w0 = FlatModel(make()).get_params()
    algo.init_server(w0, torch.zeros(0))
    priors, msgs = phase_a(algo, make, train, {0: data(0), 2: data(2)})
    disc = algo.disc_slice()
    reply = algo.client_update(context(algo, make, train, 0, "posterior", msgs[0], *data(0)))
    for params in (priors[0].tensors["params"], reply.tensors["params"]):
        assert torch.equal(params[disc], w0[disc])  # neither weight decay nor momentum moved D
        assert not torch.equal(params[: disc.start], w0[: disc.start])
    fedavg = ALGORITHMS.get("fedavg")
    plain = fedavg.obj(fedavg.params(), algo.setup)
    plain.init_server(w0, torch.zeros(0))
    msg = plain.configure(1, [0], "train")[0]
    same = plain.client_update(context(plain, make, train, 0, "train", msg, *data(0)))
    torch.testing.assert_close(priors[0].tensors["params"][: disc.start], same.tensors["params"][: disc.start])


def test_discriminator_labels_are_the_clients_ids(tiny_config, monkeypatch):
    calls = []
    original = ufo.discriminator_loss

    def spy(disc, own, own_id, others):
        calls.append((own_id, tuple(cid for _, cid in others)))
        return original(disc, own, own_id, others)

    monkeypatch.setattr(ufo, "discriminator_loss", spy)
    sim = Simulation(tiny_config(run={"name": "ids", "rounds": 1}, algorithm={"name": "feduad"}))
    sim.run()
    group = sorted(sim.sample_clients(1))
    assert {own for own, _ in calls} == set(group)
    assert all(others == tuple(c for c in group if c != own) for own, others in calls)  # j != k, labelled l_j
    assert sim.model.discriminator.num_clients == 6  # K: every client, not the round's group


def test_stage_one_has_no_consensus_terms_and_stage_two_has_them(tiny_config):
    sim = Simulation(tiny_config(run={"name": "stages", "rounds": 2}, algorithm={"name": "fedufo", "stage1_rounds": 1}))
    seen = []
    original = sim.executor.run_phase

    def record(rnd, phase_idx, phase, msgs):
        replies, failures = original(rnd, phase_idx, phase, msgs)
        seen.extend((rnd, phase, r.metrics) for r in replies.values())
        return replies, failures

    sim.executor.run_phase = record
    sim.run()
    posterior = [(rnd, m) for rnd, phase, m in seen if phase == "posterior"]
    assert all("cgr_loss" not in m and "cgl_loss" not in m and m["uad_loss"] > 0 for rnd, m in posterior if rnd == 1)
    assert all(m["cgr_loss"] > 0 and m["cgl_loss"] > 0 for rnd, m in posterior if rnd == 2)
    stages = [r["fedufo_stage"] for r in read_metrics(sim.run_dir / "metrics.jsonl")]
    assert stages == [1.0, 2.0]


def test_posterior_init_prior_needs_the_prior_phase():
    with pytest.raises(ConfigError, match="posterior_init='prior' needs the prior phase"):
        ALGORITHMS.parse("fedufo_cgl", {"posterior_init": "prior"})


# ---------------------------------------------------------------------------------------------- end to end
def test_cls_is_fedavg_bit_for_bit(tiny_config):
    runs = {}
    for name in ("fedavg", "fedufo_cls"):
        sim = Simulation(tiny_config(run={"name": name, "executor": "sequential"}, algorithm={"name": name}))
        sim.run()
        runs[name] = sim
    a, b = runs["fedavg"], runs["fedufo_cls"]
    assert torch.equal(a.algo.global_params, b.algo.global_params)
    keys = ("test_acc", "test_loss", "train_loss")
    ra, rb = (read_metrics(s.run_dir / "metrics.jsonl") for s in (a, b))
    assert [{k: r[k] for k in keys} for r in ra] == [{k: r[k] for k in keys} for r in rb]


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_learns_on_digits(tiny_config, name):
    algo = {"name": name} if name in ("fedufo_cls", "fedufo_cgr", "fedufo_cgl") else {"name": name, "stage1_rounds": 2}
    sim = Simulation(tiny_config(run={"name": name, "rounds": 5}, train={"participation": 1.0}, algorithm=algo))
    sim.run()
    records = read_metrics(sim.run_dir / "metrics.jsonl")
    assert records[-1]["test_acc"] > 0.8, records[-1]  # 10 classes: chance is 0.1
    assert records[-1]["test_acc"] > records[0]["test_acc"]


def test_fedufo_resumes_bit_exact_across_the_stage_boundary(tiny_config, kill_and_resume):
    algo = {"name": "fedufo", "stage1_rounds": 2}  # killed after round 2, the last of stage one
    full, resumed = kill_and_resume(lambda name: tiny_config(run={"name": name, "rounds": 4}, algorithm=algo))
    keys = ("round", "test_acc", "test_loss", "train_loss", "fedufo_stage")
    r_full, r_cut = (read_metrics(s.run_dir / "metrics.jsonl") for s in (full, resumed))
    assert [{k: r[k] for k in keys} for r in r_full] == [{k: r[k] for k in keys} for r in r_cut]
    torch.testing.assert_close(full.algo.global_params, resumed.algo.global_params, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize(
    "params",
    [{}, {"discriminator": "private", "posterior_init": "prior"}, {"disc_schedule": "step"}],
    ids=["fed", "priv", "step"],
)
def test_workers_give_the_same_bits_in_both_stages(tiny_config, params):
    def make(name, workers):  # with dropout: the lazily built layout and teacher models leave its stream alone
        return tiny_config(
            run={"name": name, "rounds": 2, "workers": workers},
            model={"dropout": 0.5},
            train={"participation": 1.0, "momentum": 0.5},
            algorithm={"name": "fedufo", "stage1_rounds": 1, **params},
        )

    local, parallel = Simulation(make("local", 1)), Simulation(make("parallel", 2))
    local.run()
    parallel.run()
    torch.testing.assert_close(local.algo.global_params, parallel.algo.global_params, rtol=0, atol=0)
    for cid, state in local.executor.store.items():
        assert sorted(state) == sorted(parallel.executor.store.get(cid))
        for key in state:
            assert torch.equal(state[key], parallel.executor.store.get(cid)[key])


def test_flower_matches_the_simulation_in_both_stages(tiny_config):
    loopback = pytest.importorskip("test_flower_loopback")

    def make(name):
        return tiny_config(
            run={"name": name, "rounds": 2},
            partition={"num_clients": 4},
            algorithm={"name": "fedufo", "stage1_rounds": 1, "discriminator": "private"},
        )

    _, local_dir = loopback.in_process(make("local"))
    summary = loopback.run_flower(make("flower"))
    assert summary["status"] == "finished"
    assert loopback.records(local_dir.parent / "flower") == loopback.records(local_dir)
    assert torch.equal(loopback.final_params(local_dir.parent / "flower"), loopback.final_params(local_dir))


def test_a_private_discriminator_stays_on_its_client(tiny_config):
    algo = {"name": "feduad", "discriminator": "private"}
    sim = Simulation(tiny_config(run={"name": "priv", "rounds": 2}, algorithm=algo))
    before = build_training(sim.cfg, sim.fed).algo.global_params
    sim.run()
    disc = sim.algo.disc_slice()
    assert torch.equal(sim.algo.global_params[disc], before[disc])  # the server's D is every client's initial D
    states = dict(sim.executor.store.items())
    assert states and all(set(s) == {"discriminator"} for s in states.values())
    assert not any(torch.equal(s["discriminator"], before[disc]) for s in states.values())


def test_cached_targets_are_the_per_batch_targets():
    make, algo, train = build(stage1_rounds=0)
    algo.init_server(FlatModel(make()).get_params(), torch.zeros(0))
    _, msgs = phase_a(algo, make, train, {0: data(0), 2: data(2)})
    x, y = data(0)
    ctx = context(algo, make, train, 0, "posterior", msgs[0], x, y)
    cached = algo.cached_targets(ctx)
    assert set(cached) == {"cgr", "cgl"}
    idx = torch.tensor([4, 1])
    torch.testing.assert_close(cached["cgr"][idx], algo.group_target(ctx, x[idx]))
    torch.testing.assert_close(cached["cgl"][idx], algo.global_target(ctx, x[idx]))
    ctx.augment = lambda batch, generator: batch  # new inputs every batch: nothing can be cached
    assert algo.cached_targets(ctx) == {}


def test_cgr_without_the_own_prior_fuses_the_others_with_their_own_proportions():
    make, algo, train = build(stage1_rounds=0, cgr_include_self=False)
    algo.init_server(FlatModel(make()).get_params(), torch.zeros(0))
    clients = {0: data(0), 2: data(2), 3: data(3)}
    _, msgs = phase_a(algo, make, train, clients)
    x, y = clients[2]
    ctx = context(algo, make, train, 2, "posterior", msgs[2], x, y)
    tensors = msgs[2].tensors
    probs = torch.stack([F.softmax(algo.teacher(tensors["prior_params"][r], None)(x)[1], 1) for r in (0, 2)])
    counts = tensors["counts"][[0, 2]]  # members 0 and 3: rows 0 and 2 of the group [0, 2, 3]
    expected = F.softmax((counts / counts.sum(0).clamp_min(1))[:, None, :].mul(probs).sum(0), 1)
    torch.testing.assert_close(algo.group_target(ctx, x), expected)


def test_prior_epochs_and_a_discriminator_frozen_in_stage_two():
    make, algo, train = build(stage1_rounds=0, prior_epochs=3, disc_in_stage_two=False)
    train = TrainSection(batch_size=2, local_epochs=1, lr=0.1)
    algo.setup.train = train
    w0 = FlatModel(make()).get_params()
    algo.init_server(w0, torch.zeros(0))
    priors, msgs = phase_a(algo, make, train, {0: data(0), 1: data(1)})
    assert priors[0].metrics["steps"] == 9  # 3 epochs of ceil(6 / 2) batches
    reply = algo.client_update(context(algo, make, train, 0, "posterior", msgs[0], *data(0)))
    assert reply.metrics["steps"] == 3 and reply.metrics["disc_loss"] == 0.0
    assert torch.equal(reply.tensors["params"][algo.disc_slice()], w0[algo.disc_slice()])


def test_the_loss_terms_are_logged_and_sum_to_the_train_loss(tiny_config):
    """metrics.jsonl carries each active term's sample-weighted mean (fedufo_<term>_loss); in stage two of fedufo
    the four model terms add up to train_loss, and the discriminator's own loss is logged beside them."""
    sim = Simulation(tiny_config(run={"name": "terms", "rounds": 2}, algorithm={"name": "fedufo", "stage1_rounds": 1}))
    sim.run()
    first, second = read_metrics(sim.run_dir / "metrics.jsonl")
    assert {"fedufo_ce_loss", "fedufo_uad_loss", "fedufo_disc_loss"} <= set(first)
    assert "fedufo_cgr_loss" not in first and "fedufo_cgl_loss" not in first  # stage one: no consensus terms
    terms = ("fedufo_ce_loss", "fedufo_uad_loss", "fedufo_cgr_loss", "fedufo_cgl_loss")
    assert sum(second[k] for k in terms) == pytest.approx(second["train_loss"], rel=1e-6)
    assert second["fedufo_disc_loss"] > 0


def test_a_single_phase_configuration_logs_its_cross_entropy(tiny_config):
    sim = Simulation(tiny_config(run={"name": "cls", "rounds": 1}, algorithm={"name": "fedufo_cls"}))
    sim.run()
    (record,) = read_metrics(sim.run_dir / "metrics.jsonl")
    assert record["fedufo_ce_loss"] == pytest.approx(record["train_loss"], rel=1e-6)


# ------------------------------------------------------------------------ disc_mode (issue 30)
def spy_phase_b_disc(monkeypatch):
    """(round, client, D's parameters at the start of phase B, D's parameters in the reply) for every posterior."""
    seen = []
    before, after = ufo.FedUFO.before_local, ufo.FedUFO.after_local

    def spy_before(self, ctx):
        before(self, ctx)
        if ctx.phase == "posterior":
            ctx.scratch["spy_start"] = ctx.flat.params[self.disc_slice()].clone()

    def spy_after(self, ctx):
        reply = after(self, ctx)
        if ctx.phase == "posterior":
            seen.append((ctx.round, ctx.cid, ctx.scratch["spy_start"], reply.tensors["params"][self.disc_slice()]))
        return reply

    monkeypatch.setattr(ufo.FedUFO, "before_local", spy_before)
    monkeypatch.setattr(ufo.FedUFO, "after_local", spy_after)
    return seen


def test_fresh_disc_mode_starts_every_phase_b_from_a_fresh_d_drawn_from_the_rounds_seed(tiny_config, monkeypatch):
    from fedhet.models.discriminator import ClientDiscriminator
    from fedhet.toolkit.local import derive_seed

    seen = spy_phase_b_disc(monkeypatch)
    algo = {"name": "fedufo", "stage1_rounds": 1, "disc_mode": "fresh"}
    cfg = tiny_config(run={"name": "fresh", "rounds": 3, "executor": "sequential"}, algorithm=algo)
    sim = Simulation(cfg)
    before = build_training(sim.cfg, sim.fed).algo.global_params
    sim.run()
    disc = sim.algo.disc_slice()
    model = sim.model
    assert len({rnd for rnd, *_ in seen}) == 3 and len(seen) > 3
    starts = []
    for rnd, cid, start, sent in seen:
        # by hand: the client's seed of the round (run seed, round, client, phase index 1), then D's own init
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(ufo.fresh_disc_seed(derive_seed(cfg.run.seed, rnd, cid, 1)))
            fresh = ClientDiscriminator(model.embedding_dim, 6)
        expected = torch.cat([p.detach().reshape(-1) for p in fresh.parameters()])
        assert torch.equal(start, expected), (rnd, cid)
        assert torch.equal(sent, before[disc])  # dropped: the reply carries the global D back
        starts.append(start)
    assert not any(torch.equal(a, b) for i, a in enumerate(starts) for b in starts[i + 1 :])  # per client, per round
    assert torch.equal(sim.algo.global_params[disc], before[disc])  # the server's D never moves
    records = read_metrics(sim.run_dir / "metrics.jsonl")
    assert all(r["fedufo_disc_loss"] > 0 for r in records)  # still trained after the model (Eq. 5), then dropped
    assert not torch.equal(sim.algo.global_params[: disc.start], before[: disc.start])


def test_frozen_disc_mode_leaves_d_unchanged_after_a_round(tiny_config, monkeypatch):
    seen = spy_phase_b_disc(monkeypatch)
    algo = {"name": "fedufo", "stage1_rounds": 1, "disc_mode": "frozen"}
    sim = Simulation(tiny_config(run={"name": "frozen", "rounds": 2, "executor": "sequential"}, algorithm=algo))
    before = build_training(sim.cfg, sim.fed).algo.global_params
    sim.run()
    disc = sim.algo.disc_slice()
    assert seen and all(torch.equal(s, before[disc]) and torch.equal(r, before[disc]) for _, _, s, r in seen)
    assert torch.equal(sim.algo.global_params[disc], before[disc])
    records = read_metrics(sim.run_dir / "metrics.jsonl")
    assert all(r["fedufo_disc_loss"] == 0.0 and r["fedufo_uad_loss"] > 0 for r in records)
    assert not torch.equal(sim.algo.global_params[: disc.start], before[: disc.start])


def test_federated_disc_mode_is_the_default_and_trains_the_averaged_d(tiny_config):
    assert ufo.FedUFOConfig().disc_mode == "federated"
    sim = Simulation(tiny_config(run={"name": "fed", "rounds": 1}, algorithm={"name": "feduad"}))
    before = build_training(sim.cfg, sim.fed).algo.global_params
    sim.run()
    disc = sim.algo.disc_slice()
    assert not torch.equal(sim.algo.global_params[disc], before[disc])


@pytest.mark.parametrize("mode", ["fresh", "frozen"])
def test_disc_mode_needs_a_federated_discriminator(mode):
    with pytest.raises(ConfigError, match="needs the discriminator"):
        ALGORITHMS.parse("fedufo_cgl", {"disc_mode": mode})
    with pytest.raises(ConfigError, match="keeps no D across rounds"):
        ALGORITHMS.parse("fedufo", {"disc_mode": mode, "discriminator": "private"})


def test_fresh_discriminator_leaves_the_global_stream_alone():
    torch.manual_seed(5)
    a = ufo.fresh_discriminator(7, 5, 4, None, 2)
    after = torch.rand(1)
    torch.manual_seed(5)
    assert torch.equal(torch.rand(1), after)
    assert torch.equal(a, ufo.fresh_discriminator(7, 5, 4, None, 2))
    assert a.numel() == 5 * 5 + 5 + 5 * 4 + 4

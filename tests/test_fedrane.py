"""FedRANE: the SLIM relation matrix against a direct solve of its constrained least squares, the neighbourhood and
attention, the CD loss against a naive loop, finite gradients on degenerate batches, evaluation that does not depend
on how the test set is cut, the presets, P-FL from the local models, and end-to-end learning that resumes bit for
bit."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedhet.algorithms import ALGORITHMS, Setup
from fedhet.algorithms.base import ClientContext, ClientData, Message, Reply
from fedhet.algorithms.fedacd import draw_mix
from fedhet.algorithms.fedrane import LOCAL
from fedhet.config import TrainSection
from fedhet.errors import ConfigError
from fedhet.models.base import FedModel
from fedhet.models.lra import (
    LRASettings,
    contrastive_discrimination,
    masked_softmax,
    neighbour_mask,
    oneshot_relation,
    pearson,
    relation_matrix,
    slim_solve,
)
from fedhet.results.store import read_metrics
from fedhet.toolkit.evaluate import evaluate, local_test_acc
from fedhet.toolkit.flat import FlatModel

D, C = 6, 3


def direct_slim(p: torch.Tensor, m: torch.Tensor, lam: float) -> torch.Tensor:
    """min_B ½||P - P B||² + (lam/2) Tr(Bᵀ M B) s.t. diag(B) = 0, column by column with the j-th entry removed:
    (P_{:,-j}ᵀ P_{:,-j} + lam M_{-j,-j}) b = P_{:,-j}ᵀ p_j."""
    n = len(p)
    out = torch.zeros_like(p)
    for j in range(n):
        keep = [i for i in range(n) if i != j]
        a = p[:, keep].T @ p[:, keep] + lam * m[keep][:, keep]
        out[keep, j] = torch.linalg.solve(a, p[:, keep].T @ p[:, j])
    return out


def random_pearson(n: int = 5, d: int = 4, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return pearson(torch.randn(n, d, generator=g, dtype=torch.float64))


# ------------------------------------------------------------------------------------------- relation matrix
def test_pearson_matrix_is_the_row_correlation():
    z = torch.randn(5, 7, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    expected = torch.tensor(np.corrcoef(z.numpy()))
    torch.testing.assert_close(pearson(z), expected, atol=1e-7, rtol=0)


def test_kkt_form_is_the_constrained_least_squares_solution_for_any_phi():
    p = random_pearson()
    g = torch.Generator().manual_seed(2)
    a = torch.randn(5, 5, generator=g, dtype=torch.float64)
    phi = a @ a.T + 0.5 * torch.eye(5, dtype=torch.float64)  # symmetric positive definite, not diagonal
    phi = phi + 0.3 * torch.triu(torch.ones(5, 5, dtype=torch.float64), 1)  # and not symmetric
    lam = 0.1
    bm = slim_solve(p, phi, lam, "kkt")
    torch.testing.assert_close(bm, direct_slim(p, phi + phi.T, lam), atol=1e-9, rtol=1e-9)
    assert torch.all(torch.diagonal(bm) == 0)
    # Eq. 4 as printed is exact only for a diagonal Phi + Phiᵀ: here it is a different matrix
    assert not torch.allclose(slim_solve(p, phi, lam, "eq4"), bm, atol=1e-3)


def test_eq4_is_the_constrained_least_squares_solution_when_phi_is_the_identity():
    p = random_pearson()
    eye = torch.eye(5, dtype=torch.float64)
    bm = slim_solve(p, eye, 0.1, "eq4")
    torch.testing.assert_close(bm, direct_slim(p, 2 * eye, 0.1), atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(bm, slim_solve(p, eye, 0.1, "kkt"), atol=1e-12, rtol=0)
    assert torch.all(torch.diagonal(bm) == 0)


def test_oneshot_relation_is_ease_on_the_correlation_matrix():
    """The official code's graph: min ||X - X B||² + lam ||B||² s.t. diag 0 with XᵀX = P, i.e. per column
    (P_{-j,-j} + lam I) b = P_{-j,j}."""
    p, lam = random_pearson(), 0.1
    bm = oneshot_relation(p, lam)
    for j in range(5):
        keep = [i for i in range(5) if i != j]
        b = torch.linalg.solve(p[keep][:, keep] + lam * torch.eye(4, dtype=torch.float64), p[keep, j])
        torch.testing.assert_close(bm[keep, j], b, atol=1e-9, rtol=1e-9)
    assert torch.all(torch.diagonal(bm) == 0)


@pytest.mark.parametrize("form", ["eq4", "kkt", "oneshot"])
def test_every_relation_form_has_a_zero_diagonal_after_the_phi_iterations(form):
    bm = relation_matrix(random_pearson(8, 5), LRASettings(relation_form=form, slim_iters=4, slim_tol=0.0))
    assert torch.all(torch.diagonal(bm) == 0) and bool(torch.isfinite(bm).all())


# ------------------------------------------------------------------------------------------- neighbourhood
def test_topk_neighbourhood_takes_the_strongest_relations_and_never_the_sample_itself():
    a = torch.tensor([[0.0, 0.9, 0.1, 0.5], [0.9, 0.0, 0.2, 0.3], [0.1, 0.2, 0.0, 0.8], [0.5, 0.3, 0.8, 0.0]])
    mask = neighbour_mask(a, LRASettings(topk=2))
    expected = torch.tensor([[0, 1, 0, 1], [1, 0, 0, 1], [0, 1, 0, 1], [1, 0, 1, 0]], dtype=torch.bool)
    assert torch.equal(mask, expected)
    assert torch.equal(neighbour_mask(a, LRASettings(topk=10)), ~torch.eye(4, dtype=torch.bool))  # k capped at B-1
    assert torch.equal(neighbour_mask(a, LRASettings(topk=1, self_loop=True)).diagonal(), torch.ones(4, dtype=bool))


def test_full_neighbourhood_is_every_positive_relation():
    a = torch.tensor([[0.0, 0.4, 0.0], [0.4, 0.0, 0.2], [0.0, 0.2, 0.0]])
    mask = neighbour_mask(a, LRASettings(neighbourhood="all"))
    assert torch.equal(mask, a > 0)


def test_attention_rows_sum_to_one_over_the_neighbourhood_and_are_zero_elsewhere():
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(6, 6, generator=g) * 5
    mask = torch.rand(6, 6, generator=g) > 0.5
    mask.fill_diagonal_(False)
    mask[0] = False  # a node without neighbours: an empty sum in Eq. 5
    alpha = masked_softmax(scores, mask)
    assert torch.all(alpha[~mask] == 0)
    rows = mask.any(1)
    torch.testing.assert_close(alpha[rows].sum(1), torch.ones(int(rows.sum())))
    i, j = torch.nonzero(mask)[0].tolist()
    expected = math.exp(scores[i, j]) / sum(math.exp(scores[i, k]) for k in range(6) if mask[i, k])
    assert alpha[i, j].item() == pytest.approx(expected, rel=1e-5)


def test_message_passing_matches_equations_5_and_6_by_hand():
    lra = lra_module(LRASettings(topk=2))
    z = torch.randn(5, D, generator=torch.Generator().manual_seed(4))
    from fedhet.models.lra import adjacency

    mask = neighbour_mask(adjacency(z, lra.settings), lra.settings)
    w, wm, wn = lra.message[0].weight, lra.receive[0].weight, lra.send[0].weight
    expected = torch.zeros_like(z)
    for i in range(5):
        nbrs = [j for j in range(5) if mask[i, j]]
        scores = torch.stack([(wm @ z[i]) @ (wn @ z[j]) / math.sqrt(D) for j in nbrs])
        alpha = torch.softmax(scores, 0)
        expected[i] = sum(a * (w @ z[j]) for a, j in zip(alpha, nbrs, strict=True))
    torch.testing.assert_close(lra(z), expected, atol=1e-6, rtol=1e-5)


# ------------------------------------------------------------------------------------------- CD loss
def naive_cd(z, z_aug, tau, similarity, symmetric):
    both = torch.cat([z, z_aug]).double()
    if similarity == "pearson":
        both = both - both.mean(1, keepdim=True)
    b = len(z)
    sim = [[float(both[i] @ both[j] / (both[i].norm() * both[j].norm())) for j in range(2 * b)] for i in range(2 * b)]
    total = 0.0
    anchors = range(2 * b) if symmetric else range(b)
    for i in anchors:
        pos = (i + b) % (2 * b)
        denom = sum(math.exp(sim[i][j] / tau) for j in range(2 * b) if j != i)
        total += -math.log(math.exp(sim[i][pos] / tau) / denom)
    return total / len(anchors)


@pytest.mark.parametrize("similarity", ["pearson", "cosine"])
@pytest.mark.parametrize("symmetric", [False, True])
def test_cd_loss_matches_a_naive_loop(similarity, symmetric):
    g = torch.Generator().manual_seed(5)
    z, z_aug = torch.randn(4, D, generator=g), torch.randn(4, D, generator=g)
    got = contrastive_discrimination(z, z_aug, 0.8, similarity, symmetric)
    assert got.item() == pytest.approx(naive_cd(z, z_aug, 0.8, similarity, symmetric), rel=1e-5)


# ------------------------------------------------------------------------------------------- algorithm
def hidden_model() -> FedModel:
    return FedModel({"fc": nn.Sequential(nn.Linear(4, D), nn.ReLU())}, D, C)


def lra_module(settings: LRASettings):
    from fedhet.models.lra import LRA

    torch.manual_seed(0)
    return LRA(D, settings)


def make_fedrane(name="fedrane", clients=2, **params):
    entry = ALGORITHMS.get(name)
    cfg = entry.params(**params)

    def build():
        return entry.obj.prepare_model(cfg, hidden_model())

    algo = entry.obj(cfg, Setup(clients, C, TrainSection(batch_size=8, local_steps=1, lr=0.1), build))
    torch.manual_seed(0)
    model = build()
    flat = FlatModel(model)
    algo.init_server(flat.get_params(), flat.get_buffers())
    return algo, model, flat


def context(algo, model, flat, data, state, rnd=1, cid=0) -> ClientContext:
    msg = algo.configure(rnd, [cid], "train")[cid]
    return ClientContext(
        cid, rnd, "train", msg, data, state, model, flat, algo.setup.train, torch.Generator().manual_seed(rnd)
    )


def test_local_loss_is_ce_on_the_augmented_representation_plus_weighted_cd():
    algo, model, flat = make_fedrane(lambda_cd=0.2)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(6))
    y = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    ctx = context(algo, model, flat, ClientData(x, y, C), {})
    with torch.no_grad():
        z = model.body(x)
        z_aug = model.head.lra(z)
        expected = F.cross_entropy(model.head.predictor(z_aug), y).item() + 0.2 * naive_cd(
            z, z_aug, 0.8, "pearson", False
        )
        assert algo.local_loss(ctx, x, y).item() == pytest.approx(expected, rel=1e-5)
        model.eval()  # at evaluation the model predicts from z~ of the whole (small) batch too
        torch.testing.assert_close(model(x), model.head.predictor(z_aug))


@pytest.mark.parametrize("attention", ["dot", "gat"])
@pytest.mark.parametrize("batch", ["identical", "two", "one", "constant"])
def test_gradients_stay_finite_on_degenerate_batches(batch, attention):
    algo, model, flat = make_fedrane(attention=attention)
    row = torch.randn(1, 4, generator=torch.Generator().manual_seed(7))
    x = {
        "identical": row.repeat(8, 1),  # a rank-one correlation matrix
        "two": torch.randn(2, 4, generator=torch.Generator().manual_seed(8)),
        "one": row,  # below min_batch: LRA passes it through
        "constant": torch.full((5, 4), -3.0),  # ReLU features all zero: no correlation at all
    }[batch]
    y = torch.arange(len(x)) % C
    ctx = context(algo, model, flat, ClientData(x, y, C), {})
    flat.zero_grad()
    loss = algo.local_loss(ctx, x, y)
    loss.backward()
    assert math.isfinite(loss.item()) and bool(torch.isfinite(flat.grad).all())


def test_one_local_step_is_sgd_on_the_loss_and_the_local_model_is_kept_for_p_fl():
    algo, model, flat = make_fedrane()
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(9))
    y = torch.arange(8) % C
    data = ClientData(x, y, C)
    start = algo.global_params.clone()
    flat.set_params(start)
    flat.zero_grad()
    algo.local_loss(context(algo, model, flat, data, {}), x, y).backward()  # batch = whole data (8 = batch size)
    expected = start - 0.1 * flat.grad
    state: dict[str, torch.Tensor] = {}
    reply = algo.client_update(context(algo, model, flat, data, state))
    torch.testing.assert_close(reply.tensors["params"], expected, atol=1e-7, rtol=0)
    torch.testing.assert_close(state[LOCAL], expected, atol=1e-7, rtol=0)
    assert torch.equal(algo.personalize(context(algo, model, flat, data, state, rnd=2)), state[LOCAL])
    assert algo.personalize(context(algo, model, flat, data, {}, rnd=2)) is None  # never trained: no P-FL model


def test_the_lra_parameters_are_exchanged_and_averaged_by_sample_ratio_without_gne():
    algo, model, flat = make_fedrane("fedrane_wo_gne")
    names = [n for n, _ in model.named_parameters()]
    assert any(n.startswith("head.lra.") for n in names) and any(n.startswith("head.predictor.") for n in names)
    a, b = torch.randn(flat.num_params), torch.randn(flat.num_params)
    replies = {0: Reply({"params": a}, num_examples=1), 1: Reply({"params": b}, num_examples=3)}
    algo.aggregate(1, replies, "train")
    torch.testing.assert_close(algo.global_params, 0.25 * a + 0.75 * b)


# ------------------------------------------------------------------------------------------- official-code head
def test_official_head_reads_unit_vectors_through_a_fixed_orthonormal_predictor():
    algo, model, flat = make_fedrane(normalize=True, predictor="fixed", lambda_cd=0.2)
    w = model.head.predictor.weight
    assert "head.predictor.weight" not in dict(model.named_parameters())  # a buffer: never trained or averaged
    torch.testing.assert_close(w @ w.T, torch.eye(C), atol=1e-6, rtol=0)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(13))
    y = torch.arange(8) % C
    ctx = context(algo, model, flat, ClientData(x, y, C), {})
    with torch.no_grad():
        z = model.body(x)
        z = z / z.norm(dim=1, keepdim=True)
        z_aug = model.head.lra(z)
        z_aug = z_aug / z_aug.norm(dim=1, keepdim=True)
        logits = z_aug @ w.T  # unit rows of W against unit z~: every logit is a cosine
        assert float(logits.abs().max()) <= 1 + 1e-6
        expected = F.cross_entropy(logits, y).item() + 0.2 * naive_cd(z, z_aug, 0.8, "pearson", False)
        assert algo.local_loss(ctx, x, y).item() == pytest.approx(expected, rel=1e-5)
    before = w.clone()
    algo.client_update(context(algo, model, flat, ClientData(x, y, C), {}))
    assert torch.equal(model.head.predictor.weight, before)


def test_mse_prediction_loss_is_the_mean_squared_error_to_the_one_hot_label():
    algo, model, flat = make_fedrane(normalize=True, predictor="fixed", pred_loss="mse", lambda_cd=0.0)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(14))
    y = torch.tensor([0, 1, 2, 2, 1, 0])
    ctx = context(algo, model, flat, ClientData(x, y, C), {})
    with torch.no_grad():
        logits = model(x).tolist()  # train mode: the whole batch's z~
        naive = sum((logits[i][c] - float(c == int(y[i]))) ** 2 for i in range(6) for c in range(C)) / (6 * C)
        assert algo.local_loss(ctx, x, y).item() == pytest.approx(naive, rel=1e-5)


def test_without_lra_the_normalised_head_reads_the_unit_representation():
    _, model, _ = make_fedrane("fedrane_wo_lra", normalize=True)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(15))
    with torch.no_grad():
        z = model.body(x)
        torch.testing.assert_close(model(x), model.head.head(z / z.norm(dim=1, keepdim=True)))
        assert not torch.allclose(model(x), model.head.head(z))  # the ReLU features are not unit vectors


def naive_gat(lra, z, mask):
    """The official GAT layer as graph_models.Attention writes it: the concatenation [W h_i ; W h_j] scored by a,
    LeakyReLU 0.1, softmax over the neighbours, ELU; heads averaged (no dropout: evaluation)."""
    heads = []
    for head in lra.gat[0]:
        wh = z @ head.w.weight.T
        out = torch.zeros_like(z)
        for i in range(len(z)):
            nbrs = [j for j in range(len(z)) if mask[i, j]]
            e = torch.stack([F.leaky_relu(head.a.weight[0] @ torch.cat([wh[i], wh[j]]), 0.1) for j in nbrs])
            out[i] = F.elu(sum(a * wh[j] for a, j in zip(torch.softmax(e, 0), nbrs, strict=True)))
        heads.append(out)
    return sum(heads) / len(heads)


@pytest.mark.parametrize("neighbourhood", ["topk", "all"])
def test_gat_attention_matches_the_official_layer_written_out(neighbourhood):
    from fedhet.models.lra import adjacency

    lra = lra_module(LRASettings(topk=2, neighbourhood=neighbourhood, attention="gat", gat_heads=2)).eval()
    assert len(lra.gat[0]) == 2 and not hasattr(lra, "message")
    z = torch.randn(5, D, generator=torch.Generator().manual_seed(16))
    mask = neighbour_mask(adjacency(z, lra.settings), lra.settings)
    with torch.no_grad():
        torch.testing.assert_close(lra(z), naive_gat(lra, z, mask), atol=1e-6, rtol=1e-5)
    lra.train()  # dropout 0.2 in training only: some entries zeroed, the rest scaled by 1 / 0.8
    torch.manual_seed(1)
    with torch.no_grad():
        dropped = lra(z)
        kept = dropped != 0
        assert 0 < int(kept.sum()) < kept.numel()
        torch.testing.assert_close(dropped[kept], naive_gat(lra, z, mask)[kept] / 0.8, atol=1e-6, rtol=1e-5)


def test_gat_attention_is_static_every_node_ranks_its_neighbours_alike():
    # why the official full mask gives every sample nearly the same z~: LeakyReLU(s_i + t_j) is increasing in t_j
    lra = lra_module(LRASettings(neighbourhood="all", attention="gat", gat_heads=1)).eval()
    head = lra.gat[0][0]
    z = torch.randn(7, D, generator=torch.Generator().manual_seed(17))
    full = ~torch.eye(7, dtype=torch.bool)
    with torch.no_grad():
        alpha = head.attention(head.w(z), full)
    torch.testing.assert_close(alpha.sum(1), torch.ones(7))
    for i in range(1, 7):
        shared = [j for j in range(7) if j not in (0, i)]  # the neighbours nodes 0 and i have in common
        assert torch.equal(torch.argsort(alpha[i, shared]), torch.argsort(alpha[0, shared]))


def test_official_mixup_term_reads_the_mixed_batchs_augmented_features_as_logits():
    algo, model, flat = make_fedrane(mixup_weight=10.0, lambda_cd=0.2, normalize=True)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(19))  # no all-zero ReLU row, mixed or not
    y = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    ctx = context(algo, model, flat, ClientData(x, y, C), {})
    lam, perm = draw_mix(0.5, 8, torch.Generator().manual_seed(1))  # context() seeds the client generator by round
    assert 0 < lam < 1
    with torch.no_grad():

        def unit(v):
            return v / v.norm(dim=1, keepdim=True)

        z, z_mix = unit(model.body(x)), unit(model.body(lam * x + (1 - lam) * x[perm]))
        z_aug, mix_aug = unit(model.head.lra(z)), unit(model.head.lra(z_mix))
        expected = F.cross_entropy(model.head.predictor(z_aug), y).item() + 0.2 * naive_cd(
            z, z_aug, 0.8, "pearson", False
        )
        expected += 0.2 * naive_cd(z_mix, mix_aug, 0.8, "pearson", False)
        log_p = torch.log_softmax(mix_aug, dim=1)  # D = 6 feature coordinates as logits, labels index the first 3
        expected += 10 * float(-(lam * log_p[range(8), y] + (1 - lam) * log_p[range(8), y[perm]]).mean())
        assert algo.local_loss(ctx, x, y).item() == pytest.approx(expected, rel=1e-5)


def test_without_lra_the_mixup_term_reads_the_mixed_batchs_unit_representation():
    algo, model, flat = make_fedrane("fedrane_wo_lra", mixup_weight=10.0, normalize=True)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(19))
    y = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    ctx = context(algo, model, flat, ClientData(x, y, C), {})
    lam, perm = draw_mix(0.5, 8, torch.Generator().manual_seed(1))
    with torch.no_grad():
        v = F.normalize(model.body(lam * x + (1 - lam) * x[perm]), dim=1)
        mixup = lam * F.cross_entropy(v, y) + (1 - lam) * F.cross_entropy(v, y[perm])
        expected = F.cross_entropy(model(x), y) + 10 * mixup  # model(x): the head on the unit z, no CD term
        assert algo.local_loss(ctx, x, y).item() == pytest.approx(expected.item(), rel=1e-5)


def test_the_mixup_term_needs_a_representation_as_wide_as_the_class_count():
    entry = ALGORITHMS.get("fedrane")
    narrow = FedModel({"fc": nn.Sequential(nn.Linear(4, 2), nn.ReLU())}, 2, C)
    with pytest.raises(ConfigError, match="mixup_weight > 0 reads the 2-d representation as logits over 3 classes"):
        entry.obj.prepare_model(entry.params(mixup_weight=10.0), narrow)


def test_a_fixed_predictor_cannot_have_two_layers(tiny_config):
    from fedhet.engine.simulation import resolve_config

    with pytest.raises(ConfigError, match="predictor_layers = 1"):
        resolve_config(tiny_config(algorithm={"name": "fedrane", "predictor": "fixed", "predictor_layers": 2}))


# ------------------------------------------------------------------------------------------- presets and config
def test_presets_switch_off_one_component_each():
    wo_lra, model_wo_lra, _ = make_fedrane("fedrane_wo_lra")
    assert isinstance(model_wo_lra.head, nn.Linear) and getattr(model_wo_lra, "transductive_batch", None) is None
    assert wo_lra.config.lambda_cd == 0 and wo_lra.config.aggregation == "gne"
    wo_gne, model_wo_gne, _ = make_fedrane("fedrane_wo_gne")
    assert hasattr(model_wo_gne.head, "lra") and wo_gne.config.aggregation == "samples"
    assert wo_gne.config.lambda_cd == 0.2


def test_cd_without_lra_is_a_clear_config_error(tiny_config):
    from fedhet.engine.simulation import resolve_config

    with pytest.raises(ConfigError, match="lambda_cd > 0 needs lra = true"):
        resolve_config(tiny_config(algorithm={"name": "fedrane", "lra": False}))
    with pytest.raises(ConfigError, match="relation_form"):
        resolve_config(tiny_config(algorithm={"name": "fedrane", "relation_form": "svd"}))


def test_a_two_layer_predictor_reads_the_augmented_representation():
    _, model, _ = make_fedrane(predictor_layers=2)
    predictor = model.head.predictor
    assert isinstance(predictor, nn.Sequential) and predictor[0].in_features == D and predictor[-1].out_features == C


# ------------------------------------------------------------------------------------------- evaluation
def test_evaluation_does_not_depend_on_how_the_caller_cuts_the_test_set():
    _, model, _ = make_fedrane(eval_batch_size=16)
    g = torch.Generator().manual_seed(10)
    x, y = torch.randn(45, 4, generator=g), torch.randint(0, C, (45,), generator=g)
    runs = [evaluate(model, x, y, C, batch_size=b) for b in (1, 7, 16, 1000)]
    for stats in runs[1:]:
        assert stats.loss_sum == runs[0].loss_sum and np.array_equal(stats.hits, runs[0].hits)
    with torch.no_grad():  # the chunks are 16, 16 and the last 13, in order
        expected = torch.cat([model(x[s : s + 16]) for s in range(0, 45, 16)])
    assert np.array_equal(runs[0].hits, (expected.argmax(1) == y).numpy())


def test_each_clients_split_is_evaluated_on_its_own_with_lra_at_eval():
    _, model, _ = make_fedrane(eval_batch_size=16)
    g = torch.Generator().manual_seed(11)
    empty_x, empty_y = torch.zeros(0, 4), torch.zeros(0, dtype=torch.long)
    clients = [
        ClientData(empty_x, empty_y, C, torch.randn(n, 4, generator=g), torch.randint(0, C, (n,), generator=g))
        for n in (5, 20, 0)
    ]
    acc = local_test_acc(model, clients, batch_size=1024)
    for a, c in zip(acc[:2], clients[:2], strict=True):
        assert a == evaluate(model, c.x_test, c.y_test, C, batch_size=16).acc
    assert np.isnan(acc[2])
    swapped = [ClientData(c.x_test, c.y_test, C, c.x, c.y) for c in clients]  # on_train: the training data instead
    assert np.array_equal(local_test_acc(model, swapped, batch_size=1024, on_train=True), acc, equal_nan=True)


def test_without_lra_at_eval_the_model_predicts_from_z_and_any_cut_is_allowed():
    _, model, _ = make_fedrane(lra_at_eval=False)
    assert model.transductive_batch is None
    x = torch.randn(9, 4, generator=torch.Generator().manual_seed(12))
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), model.head.predictor(model.body(x)))


# ------------------------------------------------------------------------------------------- end to end
def rane_config(tiny_config, name, algorithm="fedrane", **algo):
    # the exact SLIM solve and the paper's 5 local epochs: LRA predicts each sample from its neighbours only, which
    # needs a usable graph and more steps than plain training (see the module docstring of fedhet.algorithms.fedrane)
    return tiny_config(
        run={"name": name, "rounds": 5},
        partition={"local_test_fraction": 0.2},
        train={"batch_size": 32, "local_epochs": 5, "lr": 0.05, "momentum": 0.9},
        algorithm={"name": algorithm, "relation_form": "kkt", **algo},
    )


def test_fedrane_learns_and_resumes_bit_exact(tiny_config, kill_and_resume):
    full, resumed = kill_and_resume(lambda name: rane_config(tiny_config, name))
    records = read_metrics(full.run_dir / "metrics.jsonl")
    final = records[-1]
    assert final["test_acc"] > 0.4 and final["personal_acc_micro"] > 0.5, final  # 10 classes: chance is 0.1
    assert final["gne_fallbacks"] == 0 and final["gne_cos_min"] > 0, final  # the GNE aggregation took every round
    keys = ("round", "test_acc", "test_loss", "train_loss", "personal_acc_micro", "personal_acc_macro", "gne_cos_mean")
    assert [{k: r[k] for k in keys} for r in records] == [
        {k: r[k] for k in keys} for r in read_metrics(resumed.run_dir / "metrics.jsonl")
    ]
    torch.testing.assert_close(full.algo.global_params, resumed.algo.global_params, rtol=0, atol=0)
    for cid, state in full.executor.store.items():
        torch.testing.assert_close(state[LOCAL], resumed.executor.store.get(cid)[LOCAL], rtol=0, atol=0)


def test_message_type_is_the_plain_global_model():
    algo, _, _ = make_fedrane()
    msg = algo.configure(1, [0, 1], "train")[0]
    assert isinstance(msg, Message) and set(msg.tensors) == {"params"}


def test_without_lra_and_gne_fedrane_is_fedavg_bit_for_bit(tiny_config):
    from fedhet.engine.simulation import Simulation

    plain = Simulation(tiny_config(run={"name": "fedavg", "rounds": 2}, algorithm={"name": "fedavg"}))
    ablated = Simulation(
        tiny_config(run={"name": "rane", "rounds": 2}, algorithm={"name": "fedrane_wo_lra", "aggregation": "samples"})
    )
    plain.run(), ablated.run()
    assert torch.equal(plain.algo.global_params, ablated.algo.global_params)


# ------------------------------------------------------------------------------------------- GNE
def test_fedrane_aggregates_with_gne_and_wo_gne_with_sample_ratios():
    """Orthogonal deltas of norms 3 and 1: G^T G = diag(9, 1), p = (1/3, 1), summed to one (1/4, 3/4), so each
    client moves the model by the same amount (0.75); sample ratios (1/4, 3/4 for 1 and 3 samples) would too, so
    the clients' sizes are swapped against them here."""
    for name, expected in (("fedrane", (0.75, 0.75)), ("fedrane_wo_gne", (2.25, 0.25))):
        algo, _, flat = make_fedrane(name)
        x = algo.global_params.clone()
        a, b = x.clone(), x.clone()
        a[0] += 3.0
        b[1] += 1.0
        replies = {0: Reply({"params": a}, num_examples=3), 1: Reply({"params": b}, num_examples=1)}
        algo.aggregate(1, replies, "train")
        step = algo.global_params - x
        torch.testing.assert_close(step[:2], torch.tensor(expected), atol=1e-6, rtol=1e-6)
        assert torch.all(step[2:] == 0)


def test_gne_on_the_server_section_contradicts_the_wo_gne_preset(tiny_config):
    from fedhet.engine.simulation import Simulation

    with pytest.raises(ConfigError, match="server.aggregation = 'gne' contradicts it"):
        Simulation(tiny_config(algorithm={"name": "fedrane_wo_gne"}, server={"name": "sgd", "aggregation": "gne"}))


# ------------------------------------------------------------------------------ residual_mix (issue 30)
@pytest.mark.parametrize("normalize", [False, True])
def test_residual_mix_feeds_the_predictor_m_z_plus_one_minus_m_z_aug_and_cd_still_reads_z_aug(normalize):
    m = 0.9
    algo, model, flat = make_fedrane(lambda_cd=0.2, residual_mix=m, normalize=normalize)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(6))
    y = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    ctx = context(algo, model, flat, ClientData(x, y, C), {})
    with torch.no_grad():
        z = model.body(x)
        if normalize:
            z = F.normalize(z, dim=1)
        z_aug = model.head.lra(z)
        if normalize:
            z_aug = F.normalize(z_aug, dim=1)
        read = m * z + (1 - m) * z_aug  # by hand, element by element
        expected = F.cross_entropy(model.head.predictor(read), y).item() + 0.2 * naive_cd(
            z, z_aug, 0.8, "pearson", False
        )
        assert algo.local_loss(ctx, x, y).item() == pytest.approx(expected, rel=1e-5)
        model.eval()  # the model's prediction reads the same mix
        torch.testing.assert_close(model(x), model.head.predictor(read))


def test_residual_mix_zero_is_the_paper_and_one_bypasses_lra_in_the_prediction():
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(6))
    _, paper, _ = make_fedrane()
    _, zero, _ = make_fedrane(residual_mix=0.0)
    assert torch.equal(paper(x), zero(x))  # bit for bit: m = 0 does no arithmetic
    _, one, _ = make_fedrane(residual_mix=1.0)
    with torch.no_grad():
        assert torch.equal(one(x), one.head.predictor(one.body(x)))


def test_residual_mix_needs_lra_and_lies_in_the_unit_interval():
    with pytest.raises(ConfigError, match="needs lra = true"):
        ALGORITHMS.parse("fedrane_wo_lra", {"residual_mix": 0.5})
    with pytest.raises(ConfigError):
        ALGORITHMS.parse("fedrane", {"residual_mix": 1.5})

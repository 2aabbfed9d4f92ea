#!/usr/bin/env bash
# Why FedRANE trails FedAvg at the shared lr (docs/reproductions/fedrane.md, "What slows FedRANE"): the protocol of
# fmnist.toml at alpha 0.5 on a class-stratified 20% of the training set, 5 rounds, one torch thread per run, one
# run at a time. Rerunning skips finished runs. Results: runs/reproduce/fedrane-lra-study/<name> and the table at the
# end; the doc's runs are archived in benchmarks/reproduce/fedrane/results-lra-study/ (fedhet report reads them).
set -uo pipefail
cd "$(dirname "$0")/../../.."
out=${OUT:-runs/reproduce/fedrane-lra-study}
common=(-c benchmarks/reproduce/fedrane/fmnist.toml --threads 1 -r 5 -s dataset.train_fraction=0.2
  -s partition.min_size=34 -o "$out")  # min_size: the official 171 scaled to the 20% subset
cell() {
  local name=$1; shift
  [[ -f $out/$name/summary.json ]] && return
  "${FEDHET:-.venv/bin/fedhet}" run "${common[@]}" --name "$name" "$@"
}
cell avg-h0 -a fedavg                                     # the official CNNModel: FedRANE's LRA on 1568-d z
cell avg-h64 -a fedavg -s model.hidden=64                 # the paper's "d = 64": an FC 1568 -> 64 embedding
cell avg-h0-lr05-m0 -a fedavg -s train.lr=0.5 -s train.momentum=0 -r 2   # the paper's lr, plain SGD
cell avg-h64-lr05-m0 -a fedavg -s model.hidden=64 -s train.lr=0.5 -s train.momentum=0
cell rane-h0 -a fedrane
cell wogne-h0 -a fedrane_wo_gne
cell rane-h0-nocd -a fedrane -s algorithm.lambda_cd=0     # LRA without the CD loss
cell rane-h0-selfloop -a fedrane -s algorithm.self_loop=true
cell rane-h0-noeval -a fedrane -s algorithm.lra_at_eval=false   # the official evaluation: the predictor reads z
cell rane-h64 -a fedrane -s model.hidden=64
cell rane-h64-lr005-m09 -a fedrane -s model.hidden=64 -s train.lr=0.05
cell rane-h64-lr05-m0 -a fedrane -s model.hidden=64 -s train.lr=0.5 -s train.momentum=0
# The official code's representation (algorithm.normalize, algorithm.predictor; fedrane.py): unit-norm z and z~ read by
# SphereFed's fixed orthonormal predictor, cross-entropy as its train_raw; then its lr 0.5 (paper) with momentum 0.9
# (official optimiser), and the same head without LRA (GNE, no CD) to separate LRA from the head.
sphere=(-s algorithm.normalize=true -s algorithm.predictor=fixed)
cell rane-sphere -a fedrane "${sphere[@]}"
cell wolra-sphere -a fedrane_wo_lra "${sphere[@]}"
cell rane-sphere-lr05 -a fedrane "${sphere[@]}" -s train.lr=0.5
cell wolra-sphere-lr05 -a fedrane_wo_lra "${sphere[@]}" -s train.lr=0.5
cell rane-sphere-mse -a fedrane "${sphere[@]}" -s algorithm.pred_loss=mse
# Every official-code option at once, at lr 0.5: the one-shot EASE graph on all neighbours, symmetric cosine NT-Xent
# weighted 0.1 (nce_reg), and the official evaluation (the predictor reads z, no LRA)
cell rane-official-lr05 -a fedrane "${sphere[@]}" -s train.lr=0.5 -s algorithm.relation_form=oneshot \
  -s algorithm.neighbourhood=all -s algorithm.cd_similarity=cosine -s algorithm.cd_symmetric=true \
  -s algorithm.lambda_cd=0.1 -s algorithm.lra_at_eval=false
cell rane-official-lr05-evallra -a fedrane "${sphere[@]}" -s train.lr=0.5 -s algorithm.relation_form=oneshot \
  -s algorithm.neighbourhood=all -s algorithm.cd_similarity=cosine -s algorithm.cd_symmetric=true \
  -s algorithm.lambda_cd=0.1   # the same, evaluated with LRA: did training fail, or only the evaluation from z?
cell rane-official-lr05-topk -a fedrane "${sphere[@]}" -s train.lr=0.5 -s algorithm.relation_form=oneshot \
  -s algorithm.cd_similarity=cosine -s algorithm.cd_symmetric=true -s algorithm.lambda_cd=0.1  # top-10 neighbours
# The two official-code parts missing above: its GAT attention (2 heads, LeakyReLU scores, ELU, dropout 0.2) and its
# mixup term (a mixed batch through the same graph, its features as logits, weighted 10): the released FedRANE as a
# whole (train_raw, gnn_type gat, full mask, official evaluation), then with top-10 neighbours evaluated with LRA
official=("${sphere[@]}" -s train.lr=0.5 -s algorithm.relation_form=oneshot -s algorithm.cd_similarity=cosine
  -s algorithm.cd_symmetric=true -s algorithm.lambda_cd=0.1 -s algorithm.attention=gat -s algorithm.mixup_weight=10)
cell rane-released -a fedrane "${official[@]}" -s algorithm.neighbourhood=all -s algorithm.lra_at_eval=false
cell rane-released-lr001 -a fedrane "${official[@]}" -s algorithm.neighbourhood=all -s algorithm.lra_at_eval=false \
  -s train.lr=0.01  # the official README's -lr 0.01
cell rane-released-topk -a fedrane "${official[@]}"
cell rane-released-topk-nomixup -a fedrane "${official[@]}" -s algorithm.mixup_weight=0  # GAT alone, against topk
"${FEDHET:-.venv/bin/fedhet}" report "$out"

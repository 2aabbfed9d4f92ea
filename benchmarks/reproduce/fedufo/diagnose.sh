#!/usr/bin/env bash
# Why FedUAD / FedUFO trail FedAvg on the Fashion-MNIST shards (docs/reproductions/fedufo.md, "What goes wrong"):
# the reproduction's setting cut to E = 2 and 15 rounds, evaluated every round, seed 0, one reading changed per run.
# About 1 s a round for FedAvg and 6 s for FedUAD on one core. Results: OUT (default runs/ufo-diag)/<name>.
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=${OUT:-runs/ufo-diag}
base=(-c benchmarks/reproduce/fedufo/fmnist.toml -r 15 -s train.local_epochs=2 -s run.eval_every=1 -o "$out")
run() {
  local name=$1
  shift
  OMP_NUM_THREADS=1 "${FEDHET:-.venv/bin/fedhet}" run "${base[@]}" --name "$name" "$@"
}
run fedavg -a fedavg
run feduad -a feduad                                                  # D federated, trained after the model
run feduad-d0 -a feduad -s algorithm.disc_epochs=0                    # D never trained (stays at its init)
run feduad-private -a feduad -s algorithm.discriminator=private       # each client keeps its own D
run feduad-w01 -a feduad -s algorithm.uad_weight=0.1                  # UAD at a tenth of its weight
run feduad-step -a feduad -s algorithm.disc_schedule=step             # D steps after every model step
run feduad-nobias -a feduad_nobias --plugin benchmarks/reproduce/fedufo/uad_nobias.py  # D's output bias reset
run cgl -a fedufo_cgl
run cgl-mean -a fedufo_cgl -s algorithm.kl_reduction=mean
run cgr -a fedufo_cgr
run cgr-l1 -a fedufo_cgr -s algorithm.cgr_fusion=l1

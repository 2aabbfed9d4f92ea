#!/usr/bin/env bash
# FedUFO's discriminator readings (docs/reproductions/fedufo.md "Discriminator readings"): the E = 10,
# 100-round Fashion-MNIST protocol of fmnist.toml for FedUFO with algorithm.disc_mode = fresh and frozen, beside the
# +cgr / +cgl ablations, one cell at a time on one torch thread, whole seeds first (seed 0, then 1, then 2).
#
# 1. The KL reduction for "frozen": the short protocol (E = 2, 30 rounds, stage one 15 rounds, evaluated every
#    round, seed 0) with batchmean and with mean; the one with the higher mean accuracy over the last five rounds
#    runs at full length. "fresh" takes kl_reduction = "mean" from short runs not archived (73.2 against 72.4, seed 0).
# 2. The long cells. Rerunning the script skips finished cells and resumes killed ones (fedhet compare); the short
#    runs are skipped once finished. FedAvg and the seed-0 ablations are archived already (results/).
#
#   nohup benchmarks/reproduce/fedufo/disc_modes.sh > runs/reproduce/disc_modes.log 2>&1 &
#   python benchmarks/reproduce/archive.py --partial --checkpoint-mb 5 runs/reproduce/fedufo-fmnist-fresh \
#       benchmarks/reproduce/fedufo/results-fresh            # likewise -frozen, and fedufo-fmnist for the ablations
set -euo pipefail
cd "$(dirname "$0")/../../.."
fedhet=${FEDHET:-.venv/bin/fedhet}
short=${SHORT:-runs/ufo-short}
config=benchmarks/reproduce/fedufo/fmnist.toml
export OMP_NUM_THREADS=1

short_run() {  # NAME ARGS...: the short protocol, skipped once finished
  local name=$1
  shift
  if grep -qs '"finished"' "$short/$name/summary.json"; then return; fi
  local again=()
  if [ -d "$short/$name" ]; then again=(--resume); fi
  "$fedhet" run -c "$config" -a fedufo -r 30 -s train.local_epochs=2 -s run.eval_every=1 \
    -s algorithm.stage1_rounds=15 --threads 1 -o "$short" --name "$name" "${again[@]}" "$@"
}
last5() {
  .venv/bin/python -c "import json,sys; a=[json.loads(l)['test_acc'] for l in open(sys.argv[1])][-5:]; print(sum(a)/len(a))" \
    "$short/$1/metrics.jsonl"
}

short_run frozen-batchmean -s algorithm.disc_mode=frozen
short_run frozen-mean -s algorithm.disc_mode=frozen -s algorithm.kl_reduction=mean
bm=$(last5 frozen-batchmean)
mn=$(last5 frozen-mean)
frozen_kl=$(.venv/bin/python -c "print('mean' if $mn > $bm else 'batchmean')")
echo "frozen, short protocol, last five rounds: batchmean $bm, mean $mn -> kl_reduction=$frozen_kl"

compare() {  # SEED MODE KL
  "$fedhet" compare -c "$config" --variants fedufo --seeds "$1" --jobs 1 --threads 1 \
    -s algorithm.disc_mode="$2" -s algorithm.kl_reduction="$3" -s run.out_dir=runs/reproduce/fedufo-fmnist-"$2"
}
for seed in 0 1 2; do
  compare "$seed" fresh mean
  compare "$seed" frozen "$frozen_kl"
  if [ "$seed" != 0 ]; then
    "$fedhet" compare -c "$config" --variants fedufo_cgr,fedufo_cgl --seeds "$seed" --jobs 1 --threads 1
  fi
done
echo "all cells finished"

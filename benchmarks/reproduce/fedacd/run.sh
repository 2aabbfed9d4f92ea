#!/usr/bin/env bash
# FedACD's Tables 1-3 and 9 on Fashion-MNIST (benchmarks/reproduce/fedacd/fmnist.toml).
# Usage: [JOBS=N] run.sh [SEEDS] [BETAS...] [-- MORE_COMPARE_OPTIONS]   e.g. run.sh 0,1,2 0.1 -- --dry-run
# One `fedhet compare` per beta (so the first beta's cells all finish before the next starts), JOBS cells at a time
# (default: one per usable core, one torch thread each). Rerunning skips finished cells and continues killed ones.
# Results (OUT, default runs/reproduce/fedacd-fmnist): OUT/alpha<B>/<method>-s<seed>; benchmarks/reproduce/fedacd/tables.py turns
# them into the tables of docs/reproductions/fedacd.md.
set -euo pipefail
cd "$(dirname "$0")/../../.."
seeds=0
if (($#)) && [[ $1 != -- ]]; then seeds=$1; shift; fi
betas=(); extra=()
while (($#)); do
  if [[ $1 == -- ]]; then shift; extra=("$@"); break; fi
  betas+=("$1"); shift
done
((${#betas[@]})) || betas=(0.1 0.3 0.05)
variants=${VARIANTS:-fedavg,fedprox,fednova,creff,fedrod,fedntd,fedlc,feddecorr,fednh,fedacd}
for beta in "${betas[@]}"; do
  "${FEDHET:-.venv/bin/fedhet}" compare -c benchmarks/reproduce/fedacd/fmnist.toml --grid "partition.alpha=$beta" \
    --seeds "$seeds" --variants "$variants" -o "${OUT:-runs/reproduce/fedacd-fmnist}" --jobs "${JOBS:-auto}" "${extra[@]}"
done

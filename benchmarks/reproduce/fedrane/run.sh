#!/usr/bin/env bash
# Reproduce FedRANE's Tables 1 (G-FL) and 2 (P-FL) on Fashion-MNIST.
# Usage: [JOBS=N] run.sh [ROUNDS] [ALPHAS...] [-- MORE_COMPARE_OPTIONS]     (e.g. run.sh 5 0.1 0.5 -- --dry-run)
# One `fedhet compare` runs every (alpha, method) cell, JOBS at a time (default: one per usable core, one torch thread
# each). Rerunning skips finished cells, continues killed ones, and with a larger ROUNDS extends them.
# Results: runs/reproduce/fedrane-fmnist/alpha<A>/<method>-s0 with alpha<A>/comparison.md (+ .png) per alpha, and one
# table of every cell in runs/reproduce/fedrane-fmnist/comparison.md; benchmarks/reproduce/fedrane/tables.py prints
# Tables 1-2 beside the paper's (docs/reproductions/fedrane.md).
set -euo pipefail
cd "$(dirname "$0")/../../.."
rounds=100
if (($#)) && [[ $1 != -- ]]; then rounds=$1; shift; fi
alphas=(); extra=()
while (($#)); do
  if [[ $1 == -- ]]; then shift; extra=("$@"); break; fi
  alphas+=("$1"); shift
done
((${#alphas[@]})) || alphas=(0.1 0.5 5)
exec "${FEDHET:-.venv/bin/fedhet}" compare -c benchmarks/reproduce/fedrane/fmnist.toml -r "$rounds" \
  --grid "partition.alpha=$(IFS=,; echo "${alphas[*]}")" -o runs/reproduce/fedrane-fmnist --jobs "${JOBS:-auto}" \
  "${extra[@]}"

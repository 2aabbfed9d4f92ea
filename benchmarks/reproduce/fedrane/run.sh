#!/usr/bin/env bash
# Reproduce FedRANE's Table 1 baselines on Fashion-MNIST. Usage: run.sh [ROUNDS] [ALPHAS...]
# Results: runs/reproduce/fedrane-fmnist/alpha<A>/comparison.md (+ .png); docs/reproductions.md holds ours vs the paper.
set -euo pipefail
cd "$(dirname "$0")/../../.."
rounds=${1:-100}; shift || true
alphas=${*:-0.1 0.5 5}
for a in $alphas; do
  .venv/bin/fedhet compare -c benchmarks/reproduce/fedrane/fmnist.toml -r "$rounds" \
    -s partition.alpha="$a" -s run.progress=false -o "runs/reproduce/fedrane-fmnist/alpha$a" --resume
done

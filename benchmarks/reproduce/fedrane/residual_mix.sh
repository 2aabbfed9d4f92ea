#!/usr/bin/env bash
# FedRANE's residual_mix (docs/reproductions/fedrane.md "What LRA does to a sample's representation"): the 20 % study
# protocol of lra_study.sh (alpha 0.5, 5 rounds, seed 0, one torch thread), the predictor reading 0.9 z + 0.1 z~ as the
# official code's unused LocalGModel, for FedRANE without GNE and with it; and the paper reading (rane-h0 of
# lra_study.sh) run again here so that its checkpoint is at hand for neighbour_purity.py, which then measures all
# three. Rerunning skips finished runs. Results: runs/reproduce/fedrane-residual/<name>; archived in
# benchmarks/reproduce/fedrane/results-residual/.
set -uo pipefail
cd "$(dirname "$0")/../../.."
out=${OUT:-runs/reproduce/fedrane-residual}
common=(-c benchmarks/reproduce/fedrane/fmnist.toml --threads 1 -r 5 -s dataset.train_fraction=0.2
  -s partition.min_size=34 -o "$out")
cell() {
  local name=$1; shift
  [[ -f $out/$name/summary.json ]] && return
  OMP_NUM_THREADS=1 "${FEDHET:-.venv/bin/fedhet}" run "${common[@]}" --name "$name" "$@"
}
cell wogne-h0-mix09 -a fedrane_wo_gne -s algorithm.residual_mix=0.9
cell rane-h0 -a fedrane
.venv/bin/python benchmarks/reproduce/fedrane/neighbour_purity.py "$out"/rane-h0 "$out"/wogne-h0-mix09
cell rane-h0-mix09 -a fedrane -s algorithm.residual_mix=0.9
.venv/bin/python benchmarks/reproduce/fedrane/neighbour_purity.py "$out"/rane-h0-mix09

#!/usr/bin/env bash
# The privacy benchmark of docs/privacy-robustness.md (benchmarks/privacy/fmnist.toml): FedAvg, SCAFFOLD and FedRCL with
# client-level DP at epsilon 1, 4, 8 (delta 1e-5) and without DP. One `fedhet compare` per epsilon; rerunning skips
# finished cells and continues killed ones from their last checkpoint, so the script is safe to kill and restart.
# Usage: [JOBS=N] [OUT=dir] [ROUNDS=R] run.sh [SEEDS] [-- MORE_COMPARE_OPTIONS]     e.g. run.sh 0 -- --dry-run
# Results: OUT/eps<E>/<method>-s<seed> (OUT default runs/privacy-fmnist); tables.py OUT prints the markdown table of
# docs/privacy-robustness.md. ROUNDS shortens the runs (the noise is then computed for ROUNDS rounds).
set -euo pipefail
cd "$(dirname "$0")/../.."
seeds=0
if (($#)) && [[ $1 != -- ]]; then seeds=$1; shift; fi
[[ ${1:-} == -- ]] && shift
out=${OUT:-runs/privacy-fmnist}
fedhet=${FEDHET:-.venv/bin/fedhet}
rounds=() failed=0
[[ -n ${ROUNDS:-} ]] && rounds=(-s "run.rounds=$ROUNDS")
for eps in inf 8 4 1; do
  privacy=()
  [[ $eps != inf ]] && privacy=(-s privacy.mode=central -s "privacy.target_epsilon=$eps")
  "$fedhet" compare -c benchmarks/privacy/fmnist.toml "${privacy[@]}" "${rounds[@]}" --seeds "$seeds" \
    -o "$out/eps$eps" --jobs "${JOBS:-auto}" "$@" || failed=1  # a failed cell (its summary says why) stops no other
done
exit $failed

#!/usr/bin/env bash
# The robustness benchmark of docs/privacy-robustness.md (benchmarks/robustness/fmnist.toml): every (attack,
# aggregation) pair for FedAvg, and SCAFFOLD with its own aggregation. One `fedhet compare` per pair; rerunning skips
# finished cells and continues killed ones from their last checkpoint, so the script is safe to kill and restart.
# Usage: [JOBS=N] [OUT=dir] [ATTACKS="none sign_flip backdoor"] run.sh [SEEDS] [-- MORE_COMPARE_OPTIONS]
#        e.g. run.sh 0 -- --dry-run; ATTACKS=backdoor run.sh 0 (two such scripts may share OUT: a run folder that the
#        other is training is refused, not shared)
# Results: OUT/<attack>/<aggregation>/fraction<F>/<method>-s<seed> (OUT default runs/robustness-fmnist);
# tables.py OUT prints the markdown tables of docs/privacy-robustness.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
seeds=0
if (($#)) && [[ $1 != -- ]]; then seeds=$1; shift; fi
[[ ${1:-} == -- ]] && shift
out=${OUT:-runs/robustness-fmnist}
fedhet=${FEDHET:-.venv/bin/fedhet}
failed=0
aggregations=(weights median trimmed_mean krum multikrum geomed)
declare -A options=(
  [weights]=""
  [median]=""
  [trimmed_mean]="-s server.trim_fraction=0.3"
  [krum]="-s server.byzantine=3"
  [multikrum]="-s server.byzantine=3"
  [geomed]=""
)
for attack in ${ATTACKS:-none sign_flip backdoor}; do
  for agg in "${aggregations[@]}"; do
    variants=fedavg
    [[ $agg == weights ]] && variants=fedavg,scaffold  # SCAFFOLD refuses the others (not a weighted average)
    grid=()
    [[ $attack != none ]] && grid=(-s "attack.kind=$attack" -g "attack.fraction=0.1,0.3")
    # shellcheck disable=SC2086  # options[...] holds whole "-s key=value" words
    "$fedhet" compare -c benchmarks/robustness/fmnist.toml -s "server.aggregation=$agg" ${options[$agg]} \
      "${grid[@]}" --seeds "$seeds" --variants "$variants" -o "$out/$attack/$agg" --jobs "${JOBS:-auto}" "$@" ||
      failed=1  # a failed cell (its summary says why) stops no other
  done
done
exit $failed

#!/usr/bin/env bash
# The system-heterogeneity studies of docs/system-heterogeneity.md (benchmarks/system/synthetic.toml):
#   stragglers  FedProx's experiment: FedAvg dropping stragglers, FedProx mu = 0 and mu = 1 keeping their partial
#               work, at 0, 50 and 90 % stragglers (stragglers_shakespeare: the same on shakespeare.toml, mu = 0.001);
#   local_work  FedAvg against FedNova when local work varies: the sizes' own spread (20 epochs each), a random
#               share of it per client and round (every client a straggler, partial work), and a deadline under
#               log-normal speeds (slow clients always do less);
#   async       FedBuff against synchronous FedAvg under log-normal client speeds, on the simulated clock.
# Rerunning skips finished cells and continues killed ones, so the script is safe to kill and restart.
# Usage: [JOBS=N] [OUT=dir] run.sh [SEEDS] [STUDIES] [-- MORE_COMPARE_OPTIONS]      e.g. run.sh "0 1 2" stragglers
# Results: OUT/<study>/<setting>/<label>/<method>-s<seed> (OUT default runs/system-synthetic); tables.py OUT.
set -euo pipefail
cd "$(dirname "$0")/../.."
seeds="0 1 2"
studies="stragglers local_work async stragglers_shakespeare"
if (($#)) && [[ $1 != -- ]]; then seeds=$1; shift; fi
if (($#)) && [[ $1 != -- ]]; then studies=$1; shift; fi
[[ ${1:-} == -- ]] && shift
out=${OUT:-runs/system-synthetic}
fedhet=${FEDHET:-.venv/bin/fedhet}
failed=0

cell() {  # cell FOLDER SETTINGS...: one compare of the config's single variant, with SETTINGS
  local folder=$1
  shift
  "$fedhet" compare -c "benchmarks/system/${config:-synthetic}.toml" "$@" --seeds "$seeds_now" -o "$out/$folder" \
    --jobs "${JOBS:-auto}" --threads 1 "${extra[@]}" || failed=1  # a failed cell (its summary says why) stops no other
}

extra=("$@")
for seeds_now in $seeds; do
  for study in $studies; do
    case $study in
      stragglers | stragglers_shakespeare)
        config=synthetic mu=1 folder=stragglers
        [[ $study == stragglers_shakespeare ]] && config=shakespeare mu=0.001 folder=stragglers_shakespeare
        for s in 0 0.5 0.9; do
          drop=() partial=()  # a policy is refused without stragglers (there is nothing for it to act on)
          [[ $s != 0 ]] && drop=(-s system.straggler_policy=drop) partial=(-s system.straggler_policy=partial)
          cell "$folder/$s/fedavg-drop" -v fedavg -s system.stragglers=$s "${drop[@]}"
          cell "$folder/$s/fedprox-mu0" -v fedprox -s algorithm.mu=0 -s system.stragglers=$s "${partial[@]}"
          cell "$folder/$s/fedprox-mu$mu" -v fedprox -s algorithm.mu=$mu -s system.stragglers=$s "${partial[@]}"
        done
        config=synthetic
        ;;
      local_work)
        for method in fedavg fednova; do
          cell "local_work/sizes/$method" -v $method
          cell "local_work/random/$method" -v $method -s system.stragglers=1 -s system.straggler_policy=partial
          cell "local_work/deadline/$method" -v $method -s system.profiles=lognormal -s system.spread=1.0 \
            -s system.deadline=120 -s system.straggler_policy=partial
        done
        ;;
      async)
        cell "async/lognormal/fedavg-sync" -v fedavg -s system.profiles=lognormal -s system.spread=1.0
        cell "async/lognormal/fedbuff" -v fedavg -s system.profiles=lognormal -s system.spread=1.0 \
          -s server.mode=fedbuff -s server.buffer_size=5 -s server.concurrency=10 -s algorithm.weighting=uniform \
          -s run.rounds=3500 -s run.eval_every=50 -s run.checkpoint_every=250
        ;;
      *) echo "unknown study $study; valid: stragglers local_work async stragglers_shakespeare" >&2; exit 2 ;;
    esac
  done
done
exit $failed

#!/usr/bin/env bash
# The non-IID evidence of docs/non-iid.md (benchmarks/noniid/fmnist.toml): eight methods on Fashion-MNIST under seven
# kinds of client data. One `fedhet compare` per (seed, kind), seeds outermost so a partial table has every kind;
# rerunning skips finished cells and continues killed ones from their last checkpoint, so it is safe to kill and
# restart. Usage: [JOBS=N] [OUT=dir] run.sh [SEEDS] [KINDS] [-- MORE_COMPARE_OPTIONS]   e.g. run.sh "0 1 2" "iid dir0.1"
# The noise sweep of docs/non-iid.md: run.sh 0 "noise0.5 noise1 noise2" -- --variants fedavg,fedprox,fedbn
# Results: OUT/<kind>/<method>-s<seed> (OUT default runs/noniid-fmnist); tables.py OUT writes the table and plots.
set -euo pipefail
cd "$(dirname "$0")/../.."
seeds="0 1 2"
kinds="iid dir0.5 dir0.1 two_classes noise rotated quantity"
if (($#)) && [[ $1 != -- ]]; then seeds=$1; shift; fi
if (($#)) && [[ $1 != -- ]]; then kinds=$1; shift; fi
[[ ${1:-} == -- ]] && shift
out=${OUT:-runs/noniid-fmnist}
fedhet=${FEDHET:-.venv/bin/fedhet}

source benchmarks/noniid/kinds.sh  # settings KIND: the overrides of one kind of non-IID data

failed=0
for seed in $seeds; do
  for kind in $kinds; do
    # shellcheck disable=SC2046  # the settings are words
    "$fedhet" compare -c benchmarks/noniid/fmnist.toml $(settings "$kind") --seeds "$seed" -o "$out/$kind" \
      --jobs "${JOBS:-auto}" --threads 1 "$@" || failed=1  # a failed cell (its summary says why) stops no other
  done
done
exit $failed

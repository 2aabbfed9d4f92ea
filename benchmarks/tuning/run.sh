#!/usr/bin/env bash
# The tuned half of docs/tuning.md's evidence: docs/non-iid.md's methods (benchmarks/noniid/fmnist.toml) but FedBN
# (its global model is no model anyone uses, so the global model's val_acc is no objective for it) under Dir(0.1),
# two classes a client and rotated domains, each method tuned at an equal budget on validation data, then
# its chosen settings run on fresh seeds. Per kind: `fedhet compare --tune` with TRIALS trials of TUNE_ROUNDS rounds a
# variant (median pruning; the rounds a pruned trial ran count in its budget), tuning seed 100, on the method's own
# declared ranges plus train.lr; the final runs are fmnist.toml's 30 rounds with seeds 0-2. 10 % of each client's
# training share is held out as validation data (partition.validation_fraction) in the tuning and the final runs.
# Rerunning skips finished trials and cells and continues killed ones, so it is safe to kill and restart.
# LR=range replaces train.lr's declared range (log:1e-3:0.3), e.g. LR=log:1e-4:0.3 with its own OUT: a study's
# methods must share one space, so a kind is rerun whole with it.
# Usage: [JOBS=N] [OUT=dir] [TRIALS=16] [TUNE_ROUNDS=15] [VARIANTS=a,b] [LR=range] run.sh [KINDS] [-- MORE_OPTIONS]
# Results: OUT/<kind>/ (OUT default runs/tuning-fmnist): tuning/<variant>/study.db and trials, <variant>-s<seed>,
# comparison.md with the tuning table.
set -euo pipefail
cd "$(dirname "$0")/../.."
kinds="dir0.1 two_classes rotated"
if (($#)) && [[ $1 != -- ]]; then kinds=$1; shift; fi
[[ ${1:-} == -- ]] && shift
out=${OUT:-runs/tuning-fmnist}
fedhet=${FEDHET:-.venv/bin/fedhet}
source benchmarks/noniid/kinds.sh  # settings KIND: the overrides of one kind of non-IID data

failed=0
for kind in $kinds; do
  # shellcheck disable=SC2046  # the settings are words
  "$fedhet" compare -c benchmarks/noniid/fmnist.toml $(settings "$kind") -s partition.validation_fraction=0.1 \
    -v "${VARIANTS:-fedavg,fedprox,scaffold,fednova,feddyn,moon,fedrod}" \
    --tune "${TRIALS:-16}" --tune-rounds "${TUNE_ROUNDS:-15}" --tune-seeds 100 -t "train.lr${LR:+=$LR}" --seeds 0,1,2 \
    -o "$out/$kind" --jobs "${JOBS:-auto}" --threads 1 "$@" || failed=1  # a failed kind stops no other
done
exit $failed

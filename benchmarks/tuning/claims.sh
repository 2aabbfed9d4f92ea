#!/usr/bin/env bash
# The "tuned" column of docs/reproductions.md's claims table (docs/tuning.md): for each seed paper's closest
# protocol on the claims page, the seed method and its strongest baseline(s) there, each tuned at the same budget on
# validation data (10 % of each client's training share), then run with the chosen values on seeds 0-2.
#   fedbc    Synthetic(0.5, 0.5), E = 1, T = 50 (benchmarks/reproduce/fedbc)      FedBC against q-FedAvg, SCAFFOLD
#   fedrane  Fashion-MNIST, Dir(5), 5 rounds (the CPU cells of the claims row)     FedRANE against FedAvg
#   fedacd   Fashion-MNIST 10 %, Dir(0.1), 30 rounds                               FedACD against FedRoD
#   fedrcl   Fashion-MNIST, balanced Dir(0.3), LeNet-5, 40 rounds                  FedRCL against FedLC
#   fedufo   Fashion-MNIST 2NN, 100 clients of 2 shards, E = 10, 100 rounds        FedUFO against FedAvg
# Budget per method: TRIALS trials (default 16, median pruning) of about half the final rounds (all 5 for FedRANE's
# 5-round protocol), tuning seed 100, the method's declared space plus train.lr. Rerunning skips finished trials and
# cells and continues killed ones. Usage: [JOBS=N] [OUT=dir] [TRIALS=16] claims.sh [PAPERS] [-- MORE_COMPARE_OPTIONS]
# Results: OUT/<paper>/ (OUT default runs/tuning-claims): tuning/<method>/ and <method>-s<seed>, comparison.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
papers="fedbc fedrane fedacd fedrcl fedufo"
if (($#)) && [[ $1 != -- ]]; then papers=$1; shift; fi
[[ ${1:-} == -- ]] && shift
out=${OUT:-runs/tuning-claims}
fedhet=${FEDHET:-.venv/bin/fedhet}
root=benchmarks/reproduce

protocol() {  # config, overrides, variants and tuning rounds of one paper's claims row
  case $1 in
    fedbc) echo "-c $root/fedbc/synthetic.toml -v fedbc,qfedavg,scaffold --tune-rounds 25" ;;
    fedrane) echo "-c $root/fedrane/fmnist.toml -s partition.alpha=5 -s run.rounds=5 -v fedrane,fedavg --tune-rounds 5" ;;
    fedacd) echo "-c $root/fedacd/fmnist.toml -s partition.alpha=0.1 -v fedacd,fedrod --tune-rounds 15" ;;
    fedrcl) echo "-c $root/fedrcl/fmnist.toml -v fedrcl,fedlc --tune-rounds 20" ;;
    fedufo) echo "-c $root/fedufo/fmnist.toml -v fedufo,fedavg --tune-rounds 30" ;;
    *) echo "unknown paper $1; valid: fedbc fedrane fedacd fedrcl fedufo" >&2; exit 2 ;;
  esac
}

failed=0
for paper in $papers; do
  # shellcheck disable=SC2046  # the settings are words
  "$fedhet" compare $(protocol "$paper") -s partition.validation_fraction=0.1 --tune "${TRIALS:-16}" \
    --tune-seeds 100 -t train.lr --seeds 0,1,2 -o "$out/$paper" --jobs "${JOBS:-auto}" --threads 1 "$@" || failed=1
done
exit $failed

#!/usr/bin/env bash
# The evidence of docs/pretrained.md: pretrain vit_tiny centrally on Fashion-MNIST's classes 0-4 (pretrain.toml),
# then fine-tune it federated on classes 5-9 (fmnist.toml) under each kind of client data, in four modes:
#   scratch  a fresh model (no pretraining)
#   full     every weight starts from the pretrained backbone and trains (a fresh head: model.replace_head)
#   probe    the pretrained body frozen, only the fresh head trains (linear probing: model.freeze = "body")
#   lora     the body frozen, LoRA adapters of rank 4 on its Linear layers and the fresh head train
# One `fedhet compare` (FedAvg, FedProx, SCAFFOLD, FedRoD) per (seed, mode, kind), seeds outermost so a partial study
# has every cell of seed 0 first; rerunning skips finished cells and continues killed ones, so it is safe to kill and
# restart. Usage: [JOBS=N] [OUT=dir] run.sh [SEEDS] [MODES] [KINDS] [-- MORE_COMPARE_OPTIONS]
# Results: OUT/pretrain (the backbone's run folder), OUT/<mode>/<kind>/<method>-s<seed> (OUT default
# runs/pretrained-fmnist); tables.py OUT writes the table and the plot.
set -euo pipefail
cd "$(dirname "$0")/../.."
seeds="0 1 2"
modes="scratch full probe lora"
kinds="iid dir0.1 two_classes"
if (($#)) && [[ $1 != -- ]]; then seeds=$1; shift; fi
if (($#)) && [[ $1 != -- ]]; then modes=$1; shift; fi
if (($#)) && [[ $1 != -- ]]; then kinds=$1; shift; fi
[[ ${1:-} == -- ]] && shift
out=${OUT:-runs/pretrained-fmnist}
fedhet=${FEDHET:-.venv/bin/fedhet}
source benchmarks/noniid/kinds.sh  # settings KIND: the overrides of one kind of non-IID data

# the backbone (resumed where a killed run stopped; a finished one is left as it is)
[[ -f $out/pretrain/summary.json ]] || "$fedhet" run -c benchmarks/pretrained/pretrain.toml -o "$out" --resume
pretrained="$out/pretrain"

mode_settings() {  # the overrides of one mode
  case $1 in
    scratch) ;;
    full) echo "-s model.init=$pretrained -s model.replace_head=true" ;;
    probe) echo "-s model.init=$pretrained -s model.replace_head=true -s model.freeze=body" ;;
    lora) echo "-s model.init=$pretrained -s model.replace_head=true -s model.freeze=body -s model.lora_rank=4" ;;
    *) echo "unknown mode $1; valid: scratch full probe lora" >&2; exit 2 ;;
  esac
}

failed=0
for seed in $seeds; do
  for mode in $modes; do
    for kind in $kinds; do
      # shellcheck disable=SC2046  # the settings are words
      "$fedhet" compare -c benchmarks/pretrained/fmnist.toml $(settings "$kind") $(mode_settings "$mode") \
        --seeds "$seed" -o "$out/$mode/$kind" --jobs "${JOBS:-auto}" --threads 1 "$@" || failed=1
    done
  done
done
exit $failed

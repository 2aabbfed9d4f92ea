#!/usr/bin/env bash
# FedUFO's discriminator readings on the short protocol (docs/reproductions/fedufo.md "Discriminator readings"):
# fmnist.toml cut to E = 2 and 30 rounds, stage one 15 rounds, evaluated every round, seed 0, one torch thread, one
# run at a time; then feature_norms.py on every run's last model. disc_modes.sh runs the two frozen runs
# first (to pick frozen's KL reduction); this script skips every finished run. fresh with batchmean is left out
# (runs not archived gave it 72.4 against mean's 73.2, seed 0). Results: runs/ufo-short/<name>,
# archived in benchmarks/reproduce/fedufo/results-short/.
set -euo pipefail
cd "$(dirname "$0")/../../.."
fedhet=${FEDHET:-.venv/bin/fedhet}
short=${SHORT:-runs/ufo-short}
export OMP_NUM_THREADS=1
run() {  # NAME ALGORITHM ARGS...
  local name=$1 algo=$2
  shift 2
  if grep -qs '"finished"' "$short/$name/summary.json"; then return; fi
  local again=()
  if [ -d "$short/$name" ]; then again=(--resume); fi
  "$fedhet" run -c benchmarks/reproduce/fedufo/fmnist.toml -a "$algo" -r 30 -s train.local_epochs=2 \
    -s run.eval_every=1 --threads 1 -o "$short" --name "$name" "${again[@]}" "$@"
}
ufo=(-s algorithm.stage1_rounds=15)
run fedavg fedavg
run federated fedufo "${ufo[@]}"
run fresh-mean fedufo "${ufo[@]}" -s algorithm.disc_mode=fresh -s algorithm.kl_reduction=mean
run frozen-batchmean fedufo "${ufo[@]}" -s algorithm.disc_mode=frozen
run frozen-mean fedufo "${ufo[@]}" -s algorithm.disc_mode=frozen -s algorithm.kl_reduction=mean
.venv/bin/python - "$short" <<'PY'
import json, sys
from pathlib import Path
print("| run | acc, last five rounds (26-30) | acc @ 15 | acc @ 30 | uad loss @ 30 | disc loss @ 30 |")
print("|---|---:|---:|---:|---:|---:|")
for name in ["fedavg", "federated", "fresh-mean", "frozen-batchmean", "frozen-mean"]:
    rows = [json.loads(line) for line in (Path(sys.argv[1]) / name / "metrics.jsonl").read_text().splitlines()]
    acc = [r["test_acc"] for r in rows]
    last = rows[-1]
    uad, disc = last.get("fedufo_uad_loss"), last.get("fedufo_disc_loss")
    fmt = lambda v: "—" if v is None else f"{v:.3f}"
    print(f"| {name} | {100 * sum(acc[-5:]) / 5:.2f} | {100 * acc[14]:.2f} | {100 * acc[-1]:.2f} | {fmt(uad)} | {fmt(disc)} |")
PY
.venv/bin/python benchmarks/reproduce/fedufo/feature_norms.py "$short"/{fedavg,federated,fresh-mean,frozen-batchmean,frozen-mean}

#!/usr/bin/env bash
# FedRANE's alpha = 5 cell of Tables 1-2 at the paper's scale on a GPU (docs/performance.md): FedRANE and FedAvg on
# Fashion-MNIST, 20 clients, Dirichlet(5), 100 rounds (the official code's global_rounds), seed 0, the protocol of
# fmnist.toml, both cells at once on one GPU (--jobs 2). On this repository's CPU the cell ran 5 rounds; on an H100
# shared by 16 cells a round took about 5 s for FedAvg and 22 s for FedRANE (LRA on every batch), so one call of
# about DEADLINE seconds may stop before round 100: every cell resumes from its last checkpoint, so copy the run
# folders back and run this again to extend them (the tables say which round each cell reached).
#   here:   bash benchmarks/gpu_wheels.sh && mkdir -p .data && cp -r /usr/share/datasets/fashion-mnist .data/
#           [cp -r benchmarks/reproduce/fedrane/results-gpu-alpha5/cells runs/fedrane-alpha5   # to extend]
#   there:  OUT=$OUT bash benchmarks/reproduce/fedrane/gpu_cell.sh    (carrying .whl, .data [and runs/fedrane-alpha5])
#   back:   benchmarks/reproduce/archive.py --partial <files_at>/fedrane-alpha5 benchmarks/reproduce/fedrane/results-gpu-alpha5
set -u
OUT=${OUT:-runs/gpu-cell}
mkdir -p "$OUT"
source benchmarks/gpu_env.sh  # PY, PYTHONPATH, FEDHET_DATA=.data
cells=$OUT/fedrane-alpha5
if [ -d runs/fedrane-alpha5 ] && [ ! -d "$cells" ]; then cp -r runs/fedrane-alpha5 "$cells"; fi  # carried: extend
# SIGINT at the deadline: each cell stops at a round boundary and keeps its checkpoint (exit 130), -k: then KILL
timeout -s INT -k 30 "${DEADLINE:-480}" "$PY" -m fedhet.cli compare -c benchmarks/reproduce/fedrane/fmnist.toml \
    -s partition.alpha=5 -s run.device=cuda -v fedrane,fedavg -r 100 --seeds 0 -o "$cells" --jobs 2 --threads 2 \
    2>&1 | grep -v "^warning" | tail -40 | tee "$OUT/cell.log"
for run in "$cells"/*-s0; do  # how far each cell got
    echo "$run: $(tail -n 1 "$run/metrics.jsonl" 2>/dev/null | "$PY" -c 'import json, sys; r = json.loads(sys.stdin.read() or "{}"); print("round", r.get("round"), "test_acc", r.get("test_acc"), "personal_acc_micro", r.get("personal_acc_micro"))')"
done | tee -a "$OUT/cell.log"

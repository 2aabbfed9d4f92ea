#!/usr/bin/env bash
# The GPU check in one command (docs/performance.md, "On a GPU"), at most about 9.5 minutes (the tests 150 s, the
# benchmark BENCH_S = 400 s), for a CUDA machine that may have no internet access:
#     bash benchmarks/gpu_wheels.sh        # first, where pip can download: the few wheels fedhet needs, into .whl/
#     bash benchmarks/gpu_device.sh        # then on the GPU machine, in a copy of this checkout that includes .whl/
# The Python it runs and how it gets fedhet's dependencies there: benchmarks/gpu_env.sh. Results land in $OUT
# (gpu.json, gpu.md, the test and nvidia-smi output).
set -u
OUT=${OUT:-runs/gpu-bench}
mkdir -p "$OUT"
source benchmarks/gpu_env.sh  # PY, PYTHONPATH, the copied wheels
# the GPU tests (every algorithm on the GPU, batched = sequential, no host sync per step, augmentation): under a
# minute on an H200 with 8 pytest workers
workers=()
if "$PY" -c "import xdist" 2>/dev/null; then workers=(-n 8); fi
timeout 150 "$PY" -m pytest -q -p no:cacheprovider "${workers[@]}" -rf --tb=short tests/test_cuda.py 2>&1 | tail -40 |
    tee "$OUT/test_cuda.txt"
# Before and after the launch work (--before), case (a)'s launches counted (--profile), a compiled batched runner
# (run.compile = reduce-overhead: CUDA graphs) in cases (a) and (b), a compiled sequential one in (b); 3 rounds a
# runner (rounds 2-3 timed): the run of 2026-11-28 took 365 s for 4 rounds of the after-runners alone. Results are
# written after every runner, so a cut-off keeps what finished (the cases run in order (a) to (e)); Flower runs last.
flower=()
if "$PY" -c "import flwr, ray" 2>/dev/null; then flower=(--flower); else
    echo "Flower's Ray simulation is not installed here (Ray's wheel is not among the copied ones): case (a) runs without it"
fi
timeout "${BENCH_S:-400}" "$PY" benchmarks/gpu.py --device cuda --rounds "${ROUNDS:-3}" --profile --before \
    --compile reduce-overhead --compile-only "(a),(b)" --compile-sequential "(b)" "${flower[@]}" --out "$OUT" 2>&1 | grep -v "^warning" |
    tee "$OUT/bench.log"
cat "$OUT/gpu.md"

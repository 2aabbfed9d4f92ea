#!/usr/bin/env bash
# The GPU check in one command (docs/performance.md, "On a GPU"), about 7 minutes on an H200, for a CUDA machine
# that may have no internet access:
#     bash benchmarks/gpu_wheels.sh        # first, where pip can download: the few wheels fedhet needs, into .whl/
#     bash benchmarks/gpu_device.sh        # then on the GPU machine, in a copy of this checkout that includes .whl/
# It installs only the copied wheels, into /tmp/site. It needs a Python whose torch sees CUDA: a .venv there if its
# torch is a CUDA build (`make setup` installs the CPU build, and a .venv is too large to copy along), else the
# machine's python3, with fedhet's src/ on PYTHONPATH: fedhet's dependencies (pydantic, numpy, typer, flwr
# for the Flower case...) must then be importable there; the script stops with exit 2 and nvidia-smi's output if no
# Python qualifies. Results land in $OUT (gpu.json, gpu.md, the test and nvidia-smi output).
set -u
OUT=${OUT:-runs/gpu-bench}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then  # copied wheels (gpu_wheels.sh): pydantic and friends
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
PY=""
for candidate in .venv/bin/python python3 python; do
    if command -v "$candidate" >/dev/null 2>&1 &&
        "$candidate" -c "import sys, torch, pydantic; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
        PY=$candidate
        break
    fi
done
if [ -z "$PY" ]; then
    echo "no Python here has a torch that sees CUDA (and pydantic); nvidia-smi says:"
    nvidia-smi || true
    exit 2
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=4 FLWR_TELEMETRY_ENABLED=0
echo "python: $PY ($("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda)'))"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/nvidia-smi.csv"
# the GPU tests (every algorithm on the GPU, batched = sequential, no host sync per step, augmentation): under a
# minute on an H200 with 8 pytest workers
workers=()
if "$PY" -c "import xdist" 2>/dev/null; then workers=(-n 8); fi
timeout 150 "$PY" -m pytest -q -p no:cacheprovider "${workers[@]}" -rf --tb=short tests/test_cuda.py 2>&1 | tail -40 |
    tee "$OUT/test_cuda.txt"
# rounds 2-4 are timed (4 rounds, not 6: the benchmark took 365 s on an H200); Flower runs last
flower=()
if "$PY" -c "import flwr, ray" 2>/dev/null; then flower=(--flower); else
    echo "Flower's Ray simulation is not installed here (Ray's wheel is not among the copied ones): case (a) runs without it"
fi
timeout "${BENCH_S:-440}" "$PY" benchmarks/gpu.py --device cuda --rounds 4 "${flower[@]}" --out "$OUT" 2>&1 | grep -v "^warning" |
    tee "$OUT/bench.log"
cat "$OUT/gpu.md"

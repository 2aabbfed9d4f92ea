#!/usr/bin/env bash
# Sourced by the GPU scripts (gpu_device.sh, reproduce/fedrane/gpu_cell.sh) on a CUDA machine that may have no
# internet access: installs the copied wheels (.whl/, from gpu_wheels.sh) into /tmp/site, picks a Python whose torch
# sees CUDA (a .venv there if its torch is a CUDA build, else the machine's python3, with fedhet's src/ on
# PYTHONPATH) and sets PY; reads dataset files from .data/ when that was copied along (FEDHET_DATA). Exits 2 with
# nvidia-smi's output when no Python qualifies. Needs OUT set.
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
if [ -d .data ]; then export FEDHET_DATA="$PWD/.data"; fi  # gpu_cell.sh's Fashion-MNIST, copied along
echo "python: $PY ($("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda)'))"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/nvidia-smi.csv"

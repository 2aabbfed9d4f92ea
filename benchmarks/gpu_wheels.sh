#!/usr/bin/env bash
# Wheels for a GPU machine without internet access (benchmarks/gpu_device.sh, the GPU check). A machine image whose
# python3 has a CUDA torch, numpy, typer, rich, matplotlib, scikit-learn and pillow often lacks pydantic and tomli-w;
# the checkout's .venv (a CPU torch, about 2 GB) is too large to copy along. This downloads, where pip can, the few
# wheels fedhet still needs (about 3 MB, same versions as this .venv) into .whl/ (git-ignored), and
# benchmarks/gpu_device.sh installs them on the GPU machine:
#     bash benchmarks/gpu_wheels.sh        # here
#     bash benchmarks/gpu_device.sh        # there, in a copy of this checkout that includes .whl/
# Flower's Ray simulation is left out (Ray 2.55's wheel alone is 74 MB), so case (a)'s Flower row runs only where the
# GPU machine's Python has flwr[simulation] installed (gpu_device.sh checks and says so).
set -euo pipefail
cd "$(dirname "$0")/.."
version() { .venv/bin/python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
mkdir -p .whl
wheels=()
for name in pydantic pydantic-core annotated-types typing-inspection typing-extensions tomli-w; do
    wheels+=("$name==$(version "$name")")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${wheels[@]}"
ls -la .whl
du -sh .whl

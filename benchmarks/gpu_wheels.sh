#!/usr/bin/env bash
# Wheels for the device machine (issue 29's GPU check). The device's python3 has a CUDA torch, numpy, typer, rich,
# matplotlib, scikit-learn and pillow, but not pydantic or tomli-w, and nothing can be fetched there; the checkout's
# .venv (a CPU torch, about 2 GB) is far over the device tool's 64 MiB carry limit. This downloads, here, the few
# wheels fedhet still needs (about 3 MB, same versions as this .venv) into .whl/ (git-ignored), and
# benchmarks/gpu_device.sh installs them there:
#     bash benchmarks/gpu_wheels.sh
#     run(command="bash benchmarks/gpu_device.sh", carry=[".whl"], timeout_s=480)
# Flower's Ray simulation cannot travel: Ray 2.55's wheel alone is 74 MB, so case (a)'s Flower row runs only where
# the device's Python has flwr[simulation] installed (gpu_device.sh checks and says so).
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

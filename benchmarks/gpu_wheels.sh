#!/usr/bin/env bash
# Download what the GPU machine lacks into ./.whl, for a GPU run to carry
# (the machine reaches no package registry): the ucxx wheels (CUDA 13,
# CPython 3.12, x86-64) and py-spy, which benchmarks/gpu_check.sh's percall
# step samples both ranks with.  The GPU image already has torch, CuPy,
# numpy, pytest, pytest-timeout, cuda-bindings and nvidia-ml-py.
#
#   bash benchmarks/gpu_wheels.sh          # from the project root, ~55 MB
#
# Then carry ".whl" (the device tool's `carry`); gpu_check.sh installs the
# wheels offline with `pip --target` into $TMPDIR/ucxrpc-gpu-site when ucxx
# does not import, and finds py-spy in its bin/.
set -euo pipefail
top=$(git rev-parse --show-toplevel)
cd "$top"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
           --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d .whl \
  'ucxx-cu13==0.52.*' 'libucxx-cu13==0.52.*' 'libucx-cu13>=1.19,<1.22' \
  'rmm-cu13==26.10.*' 'librmm-cu13==26.10.*' 'rapids-logger==0.3.*'
# py-spy is one static binary in a py3-none wheel.
python3 -m pip download -q --no-deps --only-binary=:all: "${platforms[@]}" -d .whl 'py-spy>=0.4'
du -sh .whl

#!/usr/bin/env bash
# The Python packages the GPU machine's image lacks, as wheels in .whl/ (git-ignored), for benchmarks/gpu_suite.sh to
# install there with `pip install --no-index --find-links .whl` (that machine reaches no registry). Run it here, once,
# from the repository root; the versions are the ones this project's tests run with.
#
#     bash benchmarks/gpu_wheels.sh [PYTHON]      # PYTHON: the pip to download with (default: .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
# The GPU image's Python is 3.12 on x86-64: webdataset and braceexpand are pure-Python wheels (py3-none-any), which
# these platform flags also accept; torchao 0.17 is the release built against that image's torch (2.11), for
# train.fp8 (its float8 training is Python over torch's FP8 matmul).
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl webdataset==1.0.2 braceexpand==0.1.7 torchao==0.17.0
ls -1 .whl

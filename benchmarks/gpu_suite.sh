#!/usr/bin/env bash
# The GPU suite (docs/benchmarks.md#the-gpu-suite): the MPP step against the supervised one (eager, compiled), MFU,
# the loader alone, pretraining and fine-tuning end to end, build-shards, and each lever against the bf16 eager
# baseline, for ViT-B/16 and ViT-S/16, in one table; under 8 minutes on one H100, nothing downloaded.
#
#     bash benchmarks/gpu_suite.sh [--out DIR] [--budget-s 450] [--only KEY ...] [--pack] [--append]
#     bash benchmarks/gpu_suite.sh --smoke [--out DIR]     # every row on the CPU with tiny sizes
#     bash benchmarks/gpu_suite.sh --append-from DIR       # add DIR/table.md (a device's run) to docs/benchmarks.md
#
# Runs from the source tree (PYTHONPATH=$PWD) with .venv/bin/python, else python3 (PYTHON= chooses). The packages
# the GPU image lacks (webdataset, braceexpand; torchao for FP8) are installed from .whl/ (benchmarks/gpu_wheels.sh
# downloads them) when they are not importable. The rest is benchmarks/gpu_suite.py.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# What the image lacks, from .whl/: webdataset and braceexpand (needed), torchao (the FP8 rows; without it they fail).
missing=()
for pkg in webdataset braceexpand torchao; do
    "$PYTHON" -c "import $pkg" 2>/dev/null || missing+=("$pkg")
done
for pkg in webdataset braceexpand; do
    if [[ " ${missing[*]} " == *" $pkg "* ]] && ! ls .whl/"$pkg"-*.whl >/dev/null 2>&1; then
        echo "error: $pkg is not importable and .whl/ lacks its wheel: run benchmarks/gpu_wheels.sh where a" \
             "registry is reachable, and bring .whl/ along" >&2
        exit 2
    fi
done
wheels=()
for pkg in "${missing[@]}"; do ls .whl/"$pkg"-*.whl >/dev/null 2>&1 && wheels+=("$pkg"); done
if [ ${#wheels[@]} -gt 0 ]; then
    # Into the Python's own site-packages when it may be written, else beside it (on PYTHONPATH).
    if ! "$PYTHON" -m pip install --quiet --no-index --no-deps --find-links .whl "${wheels[@]}"; then
        site="${TMPDIR:-/tmp}/vit-mpp-site"
        "$PYTHON" -m pip install --quiet --no-index --no-deps --target "$site" --find-links .whl "${wheels[@]}"
        export PYTHONPATH="$PYTHONPATH:$site"
    fi
fi
exec "$PYTHON" benchmarks/gpu_suite.py --python "$PYTHON" "$@"

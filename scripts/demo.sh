#!/usr/bin/env bash
# The three stages on generated data, on whatever this machine has (CPU is fine): a few minutes on 2 cores.
#   bash scripts/demo.sh            (from the repository root, with the package installed)
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
LAUNCH="accelerate launch --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no"
rm -rf runs/demo

echo "== 1/4 generating the demo images (4 texture classes x 500)"
python -m data_tools.demo_images runs/demo/images --per-class 500 --size 48

echo "== 2/4 build-shards"
build-shards runs/demo/images runs/demo/shards --shard-size 250 --val-fraction 0.1

echo "== 3/4 pretrain (masked patch prediction, mean-colour target)"
$LAUNCH -m pretrain --config configs/pretrain/demo.yaml

echo "== 4/4 finetune (zero head, position embeddings resized 32px -> 48px)"
$LAUNCH -m finetune --config configs/finetune/demo.yaml

"""Run the data streams under a real multi-process launch and write what each rank saw
(tests/vit_mpp/test_stream_launch.py).

    python -m accelerate.commands.launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \
        --dynamo_backend no --main_process_port 0 tests/vit_mpp/stream_probe.py OUT_DIR NAME=SHARDS [NAME=SHARDS ...]

For each shard set, every rank iterates `--epochs` training epochs (with one collective per step, as training
does, so unequal step counts would hang) and one evaluation pass, then writes `OUT_DIR/NAME.rank<R>.json` with its
keys per epoch, its step counts and the evaluation metrics reduced and gathered across ranks.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from vit_mpp.config.sections import DataConfig, TrainConfig
from vit_mpp.data.eval_stream import eval_split_loader
from vit_mpp.data.image_decoder import ImageDecoder
from vit_mpp.data.manifest import load_split
from vit_mpp.data.stream import loader_layout, train_split_loader
from vit_mpp.run.start.accelerator import make_accelerator


def probe(accelerator, shards: str, workers: int, batch: int, epochs: int, seed: int) -> dict:
    """Iterate the train stream for `epochs` epochs and the val stream once: what this rank saw, and metrics."""
    rank, world = accelerator.process_index, accelerator.num_processes
    data = DataConfig(num_workers=workers, shuffle_buffer=4)
    train_split, _ = load_split(shards, "train")
    _, loader = train_split_loader(train_split, data, ImageDecoder.for_training(data, 8),
                                   loader_layout(data, batch, world), rank=rank, seed=seed)
    batches = iter(loader)
    steps = epochs * train_split.num_samples // (world * batch)
    keys: dict[int, list[str]] = {}  # epoch -> keys this rank read in it
    for _ in range(steps):
        b = next(batches)
        for key, epoch in zip(b["key"], b["epoch"]):
            keys.setdefault(epoch, []).append(key)
        # One collective per step, like a gradient all-reduce: a rank with fewer steps would block here forever.
        accelerator.reduce(torch.ones(1, device=accelerator.device), reduction="sum")
    steps_all = accelerator.gather(torch.tensor([steps], device=accelerator.device)).tolist()
    train = [{"keys": keys.get(e, []), "steps_all_ranks": steps_all} for e in range(epochs)]

    val_split, _ = load_split(shards, "val")
    val_loader = eval_split_loader(val_split, data, ImageDecoder.for_evaluation(data, 8),
                                   loader_layout(data, batch, world), rank=rank)
    val_keys, val_batches = [], 0
    totals = torch.zeros(3, device=accelerator.device)  # valid samples, label sum, label == 0 hits
    labels_all = []
    for b in val_loader:
        val_batches += 1
        valid, label = b["valid"].to(accelerator.device), b["label"].to(accelerator.device)
        val_keys += [k for k, v in zip(b["key"], b["valid"].tolist()) if v]
        totals += torch.stack([valid.sum(), (label * valid).sum(), ((label == 0) & valid).sum()]).float()
        # gather_for_metrics on a loader that is not prepared gathers everything; the valid mask removes padding.
        g_label, g_valid = accelerator.gather_for_metrics((label, valid))
        labels_all += g_label[g_valid].tolist()
    totals = accelerator.reduce(totals, reduction="sum")
    batches_all = accelerator.gather(torch.tensor([val_batches], device=accelerator.device)).tolist()
    return {"rank": rank, "world": world, "train": train,
            "val": {"keys": val_keys, "batches_all_ranks": batches_all, "reduced": totals.tolist(),
                    "gathered_labels": sorted(labels_all)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("shard_sets", nargs="+", help="NAME=SHARD_DIR_OR_URL")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=3)
    args = parser.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    world = int(os.environ.get("WORLD_SIZE", "1"))  # set by the launcher; the global batch is one micro-batch each
    accelerator, _ = make_accelerator(TrainConfig(run_dir=str(out / "run"), batch_size=args.batch * world))
    for item in args.shard_sets:
        name, shards = item.split("=", 1)
        result = probe(accelerator, shards, args.workers, args.batch, args.epochs, args.seed)
        (out / f"{name}.rank{accelerator.process_index}.json").write_text(json.dumps(result))
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()

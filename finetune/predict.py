"""Label images with a fine-tuned export: `python -m finetune.predict --checkpoint runs/x/export --images DIR`.

    python -m finetune.predict --checkpoint runs/demo/finetune/export --images photos/ [--out preds.csv]
    python -m finetune.predict --checkpoint runs/demo/finetune/export/best --images a.jpg b.png --top-k 3

The export's `model.json` gives the architecture, input size, normalisation, evaluation crop and class names;
images get the validation preprocessing of fine-tuning (resize, centre crop). Writes CSV rows
`path,class_index,class_name,prob` (plus the next-best classes with `--top-k`) to `--out` or standard output.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from common.checkpoint import CheckpointError
from common.cli import run_main
from common.config import ConfigError, ModelConfig
from common.data_stream import IMAGE_EXTENSIONS, ImageDecoder, normalize
from common.models import ARCH_KEYS, create_encoder
from finetune.checkpoints import read_export


def load_classifier(path: str | Path) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The fine-tuned classifier of an export (folder or model.safetensors) in eval mode, and its metadata."""
    state, meta = read_export(path)
    if "num_classes" not in meta:
        raise CheckpointError(f"{path} is not a fine-tuned classifier (no num_classes): use a finetune export")
    arch = {k: meta["model"][k] for k in (*ARCH_KEYS, "img_size") if k in meta["model"]}
    model = create_encoder(dataclasses.replace(ModelConfig(), **arch), num_classes=meta["num_classes"])
    model.load_state_dict(state)
    return model.eval(), meta


def image_paths(items: list[str]) -> list[Path]:
    """The image files named, and those found (recursively, sorted) in the folders named."""
    suffixes = {f".{e}" for e in IMAGE_EXTENSIONS}
    paths: list[Path] = []
    for item in items:
        p = Path(item)
        if p.is_dir():
            paths.extend(sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in suffixes))
        elif p.is_file():
            paths.append(p)
        else:
            raise ConfigError(f"no such image or folder: {p}")
    if not paths:
        raise ConfigError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) in {', '.join(items)}")
    return paths


@torch.no_grad()
def predict(model: torch.nn.Module, meta: dict[str, Any], paths: list[Path], batch_size: int = 64, top_k: int = 1,
            device: str | torch.device = "cpu") -> Iterator[tuple[Path, list[tuple[int, float]]]]:
    """(path, [(class index, probability)] best first) for each image; undecodable images are reported and skipped."""
    decoder = ImageDecoder(meta["model"]["img_size"], train=False, eval_crop_pct=meta.get("eval_crop_pct", 0.875))
    model.to(device)
    mean, std = tuple(meta["mean"]), tuple(meta["std"])
    for i in range(0, len(paths), batch_size):
        good, images = [], []
        for p in paths[i:i + batch_size]:
            try:
                images.append(decoder(p.read_bytes()))
                good.append(p)
            except Exception as e:  # one bad file must not stop the labelling of the others
                print(f"warning: skipped {p}: {e}", file=sys.stderr)
        if not images:
            continue
        probs = model(normalize(torch.stack(images).to(device), mean, std)).float().softmax(1)  # (B, K)
        top = probs.topk(min(top_k, probs.shape[1]), dim=1)
        for p, values, indices in zip(good, top.values.tolist(), top.indices.tolist()):
            yield p, list(zip(indices, values))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m finetune.predict", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="fine-tuning export folder (or its model.safetensors)")
    parser.add_argument("--images", nargs="+", required=True, help="image files and/or folders (searched recursively)")
    parser.add_argument("--out", help="CSV file to write (default: standard output)")
    parser.add_argument("--top-k", type=int, default=1, help="classes per image, best first")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    model, meta = load_classifier(args.checkpoint)
    names = meta.get("class_names") or [str(i) for i in range(meta["num_classes"])]
    paths = image_paths(args.images)
    count = 0
    with open(args.out, "w", newline="") if args.out else contextlib.nullcontext(sys.stdout) as out:
        writer = csv.writer(out)
        header = ["path", "class_index", "class_name", "prob"]
        writer.writerow(header + [f"{h}_{r}" for r in range(2, args.top_k + 1) for h in header[1:]])
        for path, top in predict(model, meta, paths, args.batch_size, args.top_k, args.device):
            writer.writerow([str(path)] + [x for idx, prob in top for x in (idx, names[idx], f"{prob:.6f}")])
            count += 1
    if args.out:
        print(f"labelled {count} of {len(paths)} images -> {args.out}", file=sys.stderr)


if __name__ == "__main__":
    run_main(main)

"""Label images with a fine-tuned export: each image prepared exactly as the shards were (`prepare_image`), then as
the validation split is; CSV rows `path,class_index,class_name,prob` to `--out` or standard output.

    python -m finetune.predict --checkpoint runs/demo/finetune/export/best --images photos/ a.jpg [--top-k 3]

See docs/finetune.md#predict.
"""

from __future__ import annotations

import contextlib
import csv
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from vit_mpp.cli import ArgumentParser
from vit_mpp.config.engine import ConfigError
from vit_mpp.data.image_decoder import ImageDecoder
from vit_mpp.data.image_formats import IMAGE_EXTENSIONS, is_image_file
from vit_mpp.data.image_prep import BadImage, EncodeSettings, prepare_image
from vit_mpp.data.stream import normalize
from vit_mpp.models.pretrained import Pretrained, load_classifier
from vit_mpp.processes.exits import run_main
from vit_mpp.progress import progress
from vit_mpp.tools.args import check_device, check_out_file, open_out_file


class NothingLabelled(ConfigError):
    """Not one of the images given could be read."""


def warn_skipped(path: Path, reason: str) -> None:
    print(f"warning: skipped {path}: {reason}", file=sys.stderr)


def image_paths(items: list[str]) -> list[Path]:
    """The image files named, and those found (recursively, sorted) in the folders named."""
    paths: list[Path] = []
    for item in items:
        p = Path(item)
        if p.is_dir():
            paths.extend(sorted(f for f in p.rglob("*") if f.is_file() and is_image_file(f)))
        elif p.is_file():
            paths.append(p)
        elif p.exists():  # a device, a pipe, a socket: nothing to decode as an image
            raise ConfigError(f"{p} is neither an image file nor a folder")
        else:
            raise ConfigError(f"no such image or folder: {p}")
    if not paths:
        raise ConfigError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) in {', '.join(items)}")
    return paths


def prepared_image(path: Path, decoder: ImageDecoder, pre: Pretrained) -> torch.Tensor:
    """An image file as the model sees it: prepared as build-shards prepared the training images (the encoder
    settings the export recorded from the shards' manifest), then the evaluation resize and crop. uint8 (3, H, W)."""
    settings = EncodeSettings.from_record((pre.record.get("data") or {}).get("encoder"))
    return decoder(prepare_image(path.read_bytes(), settings)[0])


@torch.no_grad()
def predict(model: torch.nn.Module, pre: Pretrained, paths: list[Path], batch_size: int = 64, top_k: int = 1,
            device: str | torch.device = "cpu") -> Iterator[tuple[Path, list[tuple[int, float]] | None, str]]:
    """(path, [(class index, probability)] best first, "") for each image in order; an image that cannot be read is
    (path, None, why), and the labelling goes on."""
    decoder = ImageDecoder(pre.model.img_size, train=False, eval_crop_pct=pre.crop_pct or 0.875)
    model.to(device)
    for i in range(0, len(paths), batch_size):
        good, images = [], []
        for p in paths[i:i + batch_size]:
            try:
                images.append(prepared_image(p, decoder, pre))
                good.append(p)
            except (BadImage, OSError) as e:  # one bad file must not stop the labelling of the others
                yield p, None, str(e)
        if not images:
            continue
        x = normalize(torch.stack(images).to(device), pre.mean, pre.std)
        probs = model(x).float().softmax(1)  # (B, K)
        top = probs.topk(min(top_k, probs.shape[1]), dim=1)
        for p, values, indices in zip(good, top.values.tolist(), top.indices.tolist()):
            yield p, list(zip(indices, values)), ""


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m finetune.predict", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True,
                        help="fine-tuning export folder (or its model.safetensors, local-dir:PATH, hf-hub:NAME)")
    parser.add_argument("--images", nargs="+", required=True, help="image files and/or folders (searched recursively)")
    parser.add_argument("--out", help="CSV file to write (default: standard output)")
    parser.add_argument("--top-k", type=int, default=1, help="classes per image, best first")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    if args.top_k < 1 or args.batch_size < 1:
        raise ConfigError("--top-k and --batch-size must be at least 1")
    check_device(args.device)
    if args.out:
        check_out_file(args.out)
    paths = image_paths(args.images)
    if args.out and Path(args.out).resolve() in {p.resolve() for p in paths}:
        raise ConfigError(f"--out {args.out} is one of the images to label: the CSV would overwrite it")
    model, pre = load_classifier(args.checkpoint)
    names = pre.class_names or [str(i) for i in range(pre.num_classes)]
    header = ["path", "class_index", "class_name", "prob"]  # and the next best, as many as a row holds
    header += [f"{h}_{r}" for r in range(2, min(args.top_k, pre.num_classes) + 1) for h in header[1:]]
    skipped: list[tuple[Path, str]] = []
    count = 0

    def skip(path: Path, reason: str) -> None:
        skipped.append((path, reason))
        if count:  # while nothing is labelled the warnings wait: if nothing ever is, the error says it in one line
            warn_skipped(path, reason)

    with contextlib.ExitStack() as stack, progress("labelling", len(paths)) as advance:
        writer = None
        for path, top, problem in predict(model, pre, paths, args.batch_size, args.top_k, args.device):
            advance(1)
            if top is None:
                skip(path, problem)
                continue
            if writer is None:  # opened at the first label: when no image can be read, nothing is written
                out = stack.enter_context(open_out_file(args.out)) if args.out else sys.stdout
                writer = csv.writer(out)
                writer.writerow(header)
                for held in skipped:
                    warn_skipped(*held)
            writer.writerow([str(path)] + [x for idx, prob in top for x in (idx, names[idx], f"{prob:.6f}")])
            count += 1
    if not count:
        first, reason = skipped[0]
        raise NothingLabelled(f"none of the {len(paths)} image(s) could be read, so nothing was labelled "
                              f"({first}: {' '.join(reason.split())})")
    if args.out:
        print(f"labelled {count} of {len(paths)} images -> {args.out}", file=sys.stderr)


if __name__ == "__main__":
    run_main(main)

"""`python -m analysis CHECKPOINT [--images a.jpg ...] [--shards DIR] [--out DIR]`: the ViT paper's analysis figures
(attention maps and rollout, position-embedding similarity, patch-embedding filters, mean attention distance) and a
parameter and memory table, for any checkpoint fine-tuning starts from (vit_mpp/models/pretrained.py).
See docs/analysis.md.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from timm.models.vision_transformer import VisionTransformer

from analysis import attention_stats as stats
from analysis import paper_figures
from vit_mpp.cli import ArgumentParser
from vit_mpp.config.engine import ConfigError
from vit_mpp.config.sections import ModelConfig, img_hw
from vit_mpp.data.image_decoder import ImageDecoder, image_bytes
from vit_mpp.data.image_prep import BadImage, EncodeSettings, prepare_image
from vit_mpp.data.manifest import load_split
from vit_mpp.data.shard_reader import range_segments, read_segment
from vit_mpp.data.stream import normalize
from vit_mpp.models.pretrained import Pretrained, checkpoint_kind, results_folder
from vit_mpp.models.pretrained import load_model as load_pretrained_model
from vit_mpp.models.vit import grid_size, patch_size
from vit_mpp.progress import progress
from vit_mpp.tools.args import check_device, check_out_folder, make_out_folder, open_out_file, write_out_text


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = ArgumentParser(prog="python -m analysis", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter,
                            epilog="`python -m analysis plot RUN_DIR [RUN_DIR ...]` draws training curves.")
    parser.add_argument("checkpoint", help="an export folder or file, local-dir:/hf-hub: name, or a state dict")
    parser.add_argument("--out", default=None, help="output folder (default: PATH-analysis beside the export folder "
                                                    "PATH, never inside it)")
    parser.add_argument("--model", default=None, help="timm model name, for a state dict that names no architecture")
    parser.add_argument("--img-size", type=int, nargs="+", default=None, metavar="N",
                        help="input size (N or H W); required with --model; for an export, resizes its position "
                             "embeddings (bilinear) to this size")
    parser.add_argument("--images", nargs="*", default=[], help="image files to draw attention maps for")
    parser.add_argument("--shards", default=None, help="shard folder (build-shards output) to take images from")
    parser.add_argument("--split", default="val", help="split of --shards to read (default: %(default)s)")
    parser.add_argument("--num-images", type=int, default=16,
                        help="images read from --shards; all of them enter the mean attention distance "
                             "(default: %(default)s)")
    parser.add_argument("--num-maps", type=int, default=4, help="attention-map figures drawn for shard images "
                        "(default: %(default)s)")
    parser.add_argument("--components", type=int, default=28, help="principal components of the filters to draw "
                        "(default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=8,
                        help="images per forward pass; the attention of every layer is held, L x B x heads x T^2 "
                             "floats (default: %(default)s)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the attention is computed (default: %(default)s)")
    args = parser.parse_args(argv)
    for name in ("num_images", "num_maps", "components", "batch_size"):
        if getattr(args, name) < (0 if name == "num_maps" else 1):
            raise ConfigError(f"--{name.replace('_', '-')} must be at least {0 if name == 'num_maps' else 1}")
    if args.img_size is not None and (len(args.img_size) not in (1, 2) or min(args.img_size) < 1):
        raise ConfigError(f"--img-size takes N or H W (positive), got {args.img_size}")
    check_device(args.device)
    return args


def load_model(checkpoint: str, model_name: str | None, img_size: list[int] | None,
               ) -> tuple[VisionTransformer, tuple[float, ...], tuple[float, ...], Pretrained]:
    """(model in eval mode with the checkpoint's weights, mean, std, what was read); a classifier head is kept.

    Only exports and hub models name their architecture: other formats need `model_name` and `img_size`.
    `img_size` resizes the position embeddings with the fine-tuning rule.
    """
    size = None if img_size is None else (img_size[0] if len(img_size) == 1 else list(img_size))
    if checkpoint_kind(checkpoint) in ("timm", "npz") and (model_name is None or size is None):
        raise ConfigError(f"{checkpoint} does not name its architecture: give --model NAME and --img-size N")
    given = ModelConfig(name=model_name, img_size=size) if model_name else ModelConfig()
    model, mean, std, pre = load_pretrained_model(checkpoint, given, size)
    if model_name and pre.model is not None and pre.model.name.split(".")[0] != model_name.split(".")[0]:
        raise ConfigError(f"--model {model_name}: {checkpoint} is a {pre.model.name} and names it itself; --model is "
                          "for a state dict that names no architecture")
    return model, mean, std, pre


def load_images(files: list[str], shards: str | None, split: str, count: int, hw: tuple[int, int],
                settings: EncodeSettings) -> tuple[torch.Tensor, list[str]]:
    """uint8 images (B, 3, H, W), resized and centre-cropped as in evaluation, and their names. Files are first
    prepared as build-shards prepares its inputs (`settings`)."""
    decode = ImageDecoder(hw, train=False)
    images, names = [], []
    for f in files:
        if not Path(f).is_file():
            raise ConfigError(f"image not found: {f}")
        try:
            images.append(decode(prepare_image(Path(f).read_bytes(), settings)[0]))
        except (BadImage, OSError) as e:  # an image the user named: they need to know, in one line
            raise ConfigError(f"--images {f}: {' '.join(str(e).split())}") from None
        names.append(Path(f).stem)
    if shards:
        s, _ = load_split(shards, split)
        skipped = []
        for seg in range_segments(s, list(range(len(s.urls))), 0, min(count, s.num_samples)):
            for sample in read_segment(seg):
                try:
                    images.append(decode(image_bytes(sample)))
                except Exception:  # as training does: a bad sample is passed over, and said
                    skipped.append(sample["__key__"])
                    continue
                names.append(sample["__key__"])
        if skipped:
            print(f"warning: {len(skipped)} undecodable sample(s) of {shards} passed over (first: {skipped[0]})")
    return (torch.stack(images) if images else torch.empty(0, 3, *hw, dtype=torch.uint8)), names


def human_bytes(n: int) -> str:
    """1536 -> '1.5 KiB' (binary units, as memory is reported)."""
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def param_report(model: torch.nn.Module, out: Path) -> list[dict[str, Any]]:
    """Print the per-module parameter/memory table and write it as params.txt, params.csv and params.json."""
    rows = stats.param_table(model)
    table = Table(title=f"Parameters and weight memory ({type(model).__name__})")
    for col in ("module", "params", "share", "fp32", "bf16", "train fp32 + Adam"):
        table.add_column(col, justify="left" if col == "module" else "right")
    for r in rows:
        sizes = [human_bytes(r[k]) for k in ("fp32_bytes", "bf16_bytes", "train_fp32_adam_bytes")]
        table.add_row(r["module"], f"{r['params']:,}", f"{100 * r['share']:.1f}%", *sizes,
                      style="bold" if r["module"] == "total" else None, end_section=r["module"] == rows[-2]["module"])
    Console().print(table)
    buf = io.StringIO()
    Console(file=buf, width=110, color_system=None).print(table)
    write_out_text(out / "params.txt", buf.getvalue())
    with open_out_file(out / "params.csv", "") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    write_out_text(out / "params.json", json.dumps(rows, indent=1))
    return rows


def attention_figures(model: VisionTransformer, loaded: tuple[torch.Tensor, list[str]],
                      norm: tuple[tuple[float, ...], tuple[float, ...]], out: Path, args: argparse.Namespace,
                      advance: Callable[[int], None] = lambda n: None) -> dict[str, Any]:
    """Attention maps for the images given by name and the first `--num-maps` of the shards', and the mean attention
    distance over all the `loaded` (images, names); `advance(n)` is told of each chunk of n images done."""
    (images, names), (mean, std), device, batch_size = loaded, norm, args.device, args.batch_size
    num_maps = len(args.images) + (min(args.num_maps, len(images) - len(args.images)) if args.shards else 0)
    grid, p, prefix = grid_size(model), patch_size(model), model.num_prefix_tokens
    dist_sum, maps = None, []
    for start in range(0, len(images), batch_size):  # chunks bound the memory of L x (B, heads, T, T) probabilities
        batch = images[start:start + batch_size]
        probs = stats.attention_probs(model, normalize(batch.to(device), mean, std))
        d = stats.mean_attention_distance(probs, prefix, grid, p) * len(batch)  # (L, heads), summed over images
        dist_sum = d if dist_sum is None else dist_sum + d
        rollout, layers = stats.class_token_maps(probs, prefix, grid)  # (b, gh, gw), (b, L, gh, gw)
        for i in range(len(batch)):
            j = start + i
            if j < num_maps:
                path = out / f"attention_{j}_{names[j]}.png"
                paper_figures.plot_attention(batch[i].permute(1, 2, 0).numpy(), rollout[i], layers[i], names[j], path)
                maps.append(path.name)
        advance(len(batch))
    dist = dist_sum / len(images)  # (L, heads)
    uniform = float(stats.patch_distances(grid, p).mean())  # a head attending to every patch equally
    paper_figures.plot_attention_distance(dist, uniform, img_hw(tuple(model.patch_embed.img_size)), len(images),
                                    out / "attention_distance.png")
    return {"attention_maps": maps,
            "mean_attention_distance_px": [[round(float(v), 2) for v in row] for row in dist],
            "mean_attention_distance_px_per_layer": [round(float(v), 2) for v in dist.mean(dim=1)],
            "uniform_attention_distance_px": round(uniform, 2)}


def default_out(checkpoint: str) -> Path:
    """`PATH-analysis` beside the export folder PATH, never inside an export (the folder is the model as trained and
    uploaded); `FILE-analysis` beside a bare weights file; for a Hub or timm name, `NAME-analysis` here. The same
    rule as evaluation's (vit_mpp.models.pretrained.results_folder). The model card's figures are drawn into the
    export on purpose, with --out (vit_mpp/models/hub.py)."""
    return results_folder(checkpoint, "analysis")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = check_out_folder(Path(args.out) if args.out else default_out(args.checkpoint))  # before the model loads
    model, mean, std, pre = load_model(args.checkpoint, args.model, args.img_size)
    grid, p, pos_prefix = grid_size(model), patch_size(model), stats.num_pos_prefix(model)
    hw = (grid[0] * p, grid[1] * p)
    settings = EncodeSettings.from_record((pre.record.get("data") or {}).get("encoder"))
    # the images first: a bad one is one line before anything is written
    images, names = load_images(args.images, args.shards, args.split, args.num_images, hw, settings)
    make_out_folder(out)
    rows = param_report(model, out)
    summary: dict[str, Any] = {
        "checkpoint": args.checkpoint, "model": model.pretrained_cfg.get("architecture", args.model),
        "img_size": list(hw), "patch_size": p, "grid": list(grid), "depth": len(model.blocks),
        "num_heads": model.blocks[0].attn.num_heads, "embed_dim": model.embed_dim,
        "num_classes": model.num_classes, "params": rows[-1]["params"],
        "params_fp32_mib": round(rows[-1]["fp32_bytes"] / 2**20, 2),
    }

    sim = stats.position_similarity(model.pos_embed.detach(), pos_prefix)  # (N, N)
    paper_figures.plot_position_similarity(sim, grid, out / "position_similarity.png")
    # One number that says whether the embeddings learned the 2D layout: neighbours vs all other patches.
    near = stats.patch_distances(grid, 1) == 1  # (N, N) 4-neighbourhood
    off = ~torch.eye(sim.shape[0], dtype=torch.bool)
    summary["pos_similarity_neighbours"] = round(float(sim[near].mean()), 4) if near.any() else None
    summary["pos_similarity_all_pairs"] = round(float(sim[off].mean()), 4) if off.any() else None

    pcs, explained = stats.patch_embedding_pcs(model.patch_embed.proj.weight.detach(), args.components)
    paper_figures.plot_filters(pcs, explained, out / "embedding_filters.png")
    summary["filter_pc_explained_variance"] = [round(float(v), 4) for v in explained]

    summary["images"] = names
    if len(images):
        model.to(args.device)
        with progress("attention", len(images)) as advance:
            summary.update(attention_figures(model, (images, names), (mean, std), out, args, advance))
    else:
        print("no --images and no --shards: attention maps and mean attention distance skipped")
    written = ["params.txt", "params.csv", "params.json", "position_similarity.png", "embedding_filters.png",
               *summary.get("attention_maps", []), *(["attention_distance.png"] if len(images) else []), "summary.json"]
    summary["files"] = written
    write_out_text(out / "summary.json", json.dumps(summary, indent=1))
    print(f"wrote {len(written)} files to {out}: {', '.join(written)}")



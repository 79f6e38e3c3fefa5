"""How well could each labeller label the pool? Before building pseudo-labels from the pool's own structure, measure
them: for an export's features of the labelled images and of a labelled proxy pool, the pool's accuracy under
1-NN and 20-NN votes, under label propagation over a k-NN graph of labelled and pool images together (Iscen et al.,
CVPR 2019, arXiv 1904.04717), and, for a fine-tuned export, under its own head (what a teacher starts from), each
also on its most confident half, fifth and tenth of the pool. The pool's labels are read to score, never to label.

    python -m experiments.pool_labels --checkpoint runs/x/mpp/pretrain/export \\
        --labelled runs/x/labelled/k20_s0 --pool runs/cluttered_light/shards/pool

See docs/results.md, "Labels from the pool's structure".
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer

from vit_mpp.cli import ArgumentParser
from vit_mpp.config.engine import ConfigError
from vit_mpp.config.sections import DataConfig
from vit_mpp.data.eval_stream import eval_split_loader
from vit_mpp.data.image_decoder import ImageDecoder
from vit_mpp.data.manifest import check_every_sample_labelled, load_split
from vit_mpp.data.stream import loader_layout, normalize
from vit_mpp.durable import write_atomic
from vit_mpp.models.knn import knn_top1
from vit_mpp.models.pretrained import Pretrained, checkpoint_kind, load_model
from vit_mpp.processes.exits import run_main
from vit_mpp.progress import progress
from vit_mpp.tools.args import check_out_file

SHARES = (1.0, 0.5, 0.2, 0.1)  # the pool's most confident shares each labeller is scored on
GAMMA, ALPHA, ITERATIONS = 3.0, 0.99, 20  # Iscen et al.'s edge power, diffusion weight and conjugate-gradient steps


def propagate(features: torch.Tensor, labels: torch.Tensor, num_classes: int, neighbours: int = 10,
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Label propagation (Iscen et al.'s rule) over `features` (N, D), the rows whose `labels` (N,) are >= 0 given:
    ((N, K) class probabilities, (N,) weights 1 - entropy / log K).

    The graph joins each image to its `neighbours` nearest by cosine similarity s, with weight max(s, 0)^GAMMA,
    made symmetric and normalised (D^-1/2 W D^-1/2); the labels diffuse by solving (I - ALPHA W) Z = Y with
    conjugate gradients (ITERATIONS steps), Y one column per class holding 1 / (its labelled count) on its labelled
    rows, so that a class with more labels does not flood the graph.
    """
    n = len(features)
    f = F.normalize(features.float(), dim=1)
    k = min(neighbours, n - 1)
    rows, cols, weights = [], [], []
    for start in range(0, n, 1024):  # bounds the (chunk, N) similarity matrix
        sims, idx = (f[start:start + 1024] @ f.T).topk(k + 1, dim=1)
        sims, idx = sims[:, 1:], idx[:, 1:]  # itself, first, left out
        rows.append(torch.arange(start, start + len(idx))[:, None].expand_as(idx).reshape(-1))
        cols.append(idx.reshape(-1))
        weights.append(sims.clamp(min=0).pow(GAMMA).reshape(-1))
    r, c, w = torch.cat(rows), torch.cat(cols), torch.cat(weights)
    # W + W^T: a pair each of which chose the other counts twice
    graph = torch.sparse_coo_tensor(torch.stack([torch.cat([r, c]), torch.cat([c, r])]), torch.cat([w, w]),
                                    (n, n), check_invariants=False).coalesce()
    where, values = graph.indices(), graph.values()
    scale = torch.zeros(n).index_add_(0, where[0], values).clamp(min=1e-12).rsqrt()
    graph = torch.sparse_coo_tensor(where, values * scale[where[0]] * scale[where[1]], (n, n),
                                    check_invariants=False).coalesce()

    given = (labels >= 0).nonzero().squeeze(1)
    counts = torch.bincount(labels[given], minlength=num_classes).float().clamp(min=1)
    y = torch.zeros(n, num_classes)
    y[given, labels[given]] = 1 / counts[labels[given]]

    def apply(z: torch.Tensor) -> torch.Tensor:
        return z - ALPHA * torch.sparse.mm(graph, z)

    z = torch.zeros_like(y)
    residual = y.clone()
    direction = residual.clone()
    norm = (residual * residual).sum(0)
    for _ in range(ITERATIONS):  # every class's column at once
        moved = apply(direction)
        step = norm / (direction * moved).sum(0).clamp(min=1e-30)
        z += step * direction
        residual -= step * moved
        new_norm = (residual * residual).sum(0)
        direction = residual + new_norm / norm.clamp(min=1e-30) * direction
        norm = new_norm
    z = z.clamp(min=0)
    probs = z / z.sum(1, keepdim=True).clamp(min=1e-12)
    probs[z.sum(1) == 0] = 1 / num_classes  # an image no label reached: no class
    entropy = -(probs * probs.clamp(min=1e-12).log()).sum(1)
    return probs, 1 - entropy / math.log(num_classes)


def confident_accuracy(right: torch.Tensor, confidence: torch.Tensor) -> dict[str, float]:
    """Accuracy over the pool, and over its most confident shares (SHARES), keyed `all`, `top50%`, ..."""
    order = confidence.argsort(descending=True)
    out = {}
    for share in SHARES:
        kept = order[:max(1, round(share * len(order)))]
        out["all" if share == 1 else f"top{share:.0%}"] = round(right[kept].float().mean().item(), 4)
    return out


@torch.no_grad()
def read_features(model: VisionTransformer, pre: Pretrained, norm: tuple[tuple[float, ...], tuple[float, ...]],
                  where: tuple[str, str], args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """The [class] token, the patch mean, the head's probabilities (a fine-tuned export's) and the labels of every
    image of one labelled split (`where`: its location and split), prepared as evaluation prepares them (`pre`: the
    export's size and crop; `norm`: the model's mean and std; `args`: the batch size and loader workers)."""
    location, split_name = where
    split, info = load_split(location, split_name)
    check_every_sample_labelled(location, info, split_name)
    data = DataConfig(num_workers=args.workers, eval_crop_pct=pre.crop_pct or 0.875)  # as finetune.evaluate reads
    loader = eval_split_loader(split, data, ImageDecoder.for_evaluation(data, pre.model.img_size),
                               loader_layout(data, args.batch_size))
    mean, std = norm
    parts: dict[str, list[torch.Tensor]] = {"cls": [], "avg": [], "head": [], "label": []}
    with progress(f"features of {location}:{split_name}", split.num_samples) as advance:
        for batch in loader:
            keep = batch["valid"]
            tokens = model.forward_features(normalize(batch["image"], mean, std))
            parts["cls"].append(tokens[keep, 0])
            parts["avg"].append(tokens[keep, model.num_prefix_tokens:].mean(1))
            if model.num_classes:
                parts["head"].append(model.forward_head(tokens)[keep].softmax(1))
            parts["label"].append(batch["label"][keep])
            advance(int(keep.sum()))
    features = {name: torch.cat(values) for name, values in parts.items() if values}
    if unlabelled := int((features["label"] < 0).sum()):  # a manifest need not say (timm's do not)
        raise ConfigError(f"split '{split_name}' of {location} has {unlabelled:,} image(s) without a label: the probe "
                          "scores the pool against its labels (a proxy experiment's) and needs every one")
    return features


def score(labelled: dict[str, torch.Tensor], pool: dict[str, torch.Tensor], num_classes: int,
          neighbours: int) -> dict[str, dict[str, float]]:
    """Each labeller's accuracy on the pool: {labeller: {"all": ..., "top50%": ...}} (k-NN: "all" only)."""
    out: dict[str, dict[str, float]] = {}
    if "head" in pool:
        confidence, guess = pool["head"].max(1)
        out["head"] = confident_accuracy(guess == pool["label"], confidence)
    for pooling, name in (("cls", "[class] token"), ("avg", "patch mean")):
        for k in (1, 20):
            out[f"{k}-NN, {name}"] = {"all": round(knn_top1(labelled[pooling], labelled["label"], pool[pooling],
                                                            pool["label"], k, 0.07), 4)}
        features = torch.cat([labelled[pooling], pool[pooling]])
        hidden = torch.cat([labelled["label"], torch.full_like(pool["label"], -1)])
        probs, weight = propagate(features, hidden, num_classes, neighbours)
        guess = probs[len(labelled["label"]):].argmax(1)
        out[f"propagation, {name}"] = confident_accuracy(guess == pool["label"], weight[len(labelled["label"]):])
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = ArgumentParser(prog="python -m experiments.pool_labels", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="an export (pretraining's or fine-tuning's) whose features "
                                                       "are compared")
    p.add_argument("--labelled", required=True, help="the labelled shard set (its labels are the given ones)")
    p.add_argument("--labelled-split", default="train")
    p.add_argument("--pool", required=True, help="a labelled proxy pool: its labels only score the labellers")
    p.add_argument("--pool-split", default="train")
    p.add_argument("--neighbours", type=int, default=10, help="edges per image of the propagation's graph")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--out", help="also write the table as JSON to this file")
    args = p.parse_args(argv)
    for name in ("neighbours", "batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.workers < 0:
        p.error(f"--workers must be 0 or more, got {args.workers}")
    return args


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    args = parse_args(argv)
    out = check_out_file(args.out) if args.out else None  # before the work, not after it
    if checkpoint_kind(args.checkpoint) in ("timm", "npz"):
        raise ConfigError(f"{args.checkpoint} names no architecture: give an export folder")
    model, mean, std, pre = load_model(args.checkpoint)
    labelled, pool = (read_features(model, pre, (mean, std), where, args)
                      for where in ((args.labelled, args.labelled_split), (args.pool, args.pool_split)))
    num_classes = pre.num_classes or int(max(labelled["label"].max(), pool["label"].max())) + 1
    table = score(labelled, pool, num_classes, args.neighbours)
    shares = ["all", *(f"top{s:.0%}" for s in SHARES[1:])]
    print(f"pool top-1 of each labeller: {len(labelled['label'])} labelled images, {len(pool['label'])} pool images, "
          f"{num_classes} classes (chance {1 / num_classes:.3f}); topN%: on the pool's most confident N%")
    print("| labeller | " + " | ".join(shares) + " |\n| --- |" + " --- |" * len(shares))
    for labeller, accuracy in table.items():
        print(f"| {labeller} | " + " | ".join(f"{accuracy[s]:.3f}" if s in accuracy else "" for s in shares) + " |")
    if out is not None:
        write_atomic(out, json.dumps({"checkpoint": args.checkpoint, "labelled": args.labelled,
                                                 "pool": args.pool, "table": table}, indent=1) + "\n")
    return table


if __name__ == "__main__":
    run_main(main)

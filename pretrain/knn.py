"""A representation-quality signal during pretraining (`knn_monitor`): k-NN classification of validation images by
their nearest labelled training images in the encoder's feature space, with DINO's weighted vote, reported as
`knn_top1_cls` (the [class] token) and `knn_top1_avg` (the mean of the patch tokens); with `knn.probe_epochs`, a
linear and an attentive probe of the same features (pretrain/probes.py).
See docs/pretrain.md#the-k-nn-monitor-pretrainknnpy.
"""

from __future__ import annotations

import torch
from timm.models.vision_transformer import VisionTransformer

from pretrain.probes import probe_top1
from vit_mpp.data.manifest import Split
from vit_mpp.data.stream import normalize, to_device
from vit_mpp.models.knn import knn_top1
from vit_mpp.run.loop import Gate
from vit_mpp.run.metering.eval_progress import with_progress
from vit_mpp.run.start.run import Run

Norm = tuple[tuple[float, ...], tuple[float, ...]]  # the encoder's mean and std


@torch.no_grad()
def features(run: Run, encoder: VisionTransformer, split: Split, limit: int, norm: Norm, gated: Gate,
             ) -> tuple[torch.Tensor, ...]:
    """([class] features (N, D), patch-mean features (N, D), labels (N,)) of the first `limit` images of `split`,
    and for the probes (`knn.probe_epochs`) every token (N, T, D) as well, gathered from every process (each image
    once); batches taken through `gated`."""
    accelerator, loader = run.accelerator, gated(run.eval_loader(split, limit=limit))
    every_token = run.cfg.knn.probe_epochs > 0
    mean, std = norm
    cls, avg, labels, valid, every = [], [], [], [], []
    shown = with_progress(accelerator, loader, f"k-NN features ({split.name})", min(limit, split.num_samples))
    with shown as batches:
        for batch in batches:
            batch = to_device(batch, accelerator.device)
            with accelerator.autocast():
                tokens = encoder.forward_features(normalize(batch["image"], mean, std)).float()  # (B, T, D)
            cls.append(tokens[:, 0])
            avg.append(tokens[:, encoder.num_prefix_tokens:].mean(dim=1))
            labels.append(batch["label"])
            valid.append(batch["valid"])
            if every_token:
                every.append(tokens)
    parts = [torch.cat(valid), torch.cat(cls), torch.cat(avg), torch.cat(labels)]
    if every_token:
        parts.append(torch.cat(every))
    keep, *gathered = accelerator.gather(tuple(parts))
    return tuple(part[keep] for part in gathered)


def knn_monitor(run: Run, encoder: VisionTransformer, ref_split: Split, norm: Norm, gated: Gate,
                ) -> dict[str, float] | None:
    """`knn_top1_cls` and `knn_top1_avg` of the run's validation split against `ref_split`, or None when either is
    unlabelled; batches taken through `gated`. Leaves the encoder in eval mode."""
    knn, probed = run.cfg.knn, run.cfg.knn.probe_epochs > 0
    encoder.eval()
    ref_cls, ref_avg, ref_y, *ref_all = features(run, encoder, ref_split, knn.train_images, norm, gated)
    val_cls, val_avg, val_y, *val_all = features(run, encoder, run.data.val_split, knn.val_images, norm, gated)
    if not len(ref_y) or not len(val_y) or ref_y.min() < 0 or val_y.min() < 0:
        return None  # unlabelled (label -1): no classes to vote for
    result = {"knn_top1_cls": knn_top1(ref_cls, ref_y, val_cls, val_y, knn.k, knn.temperature),
              "knn_top1_avg": knn_top1(ref_avg, ref_y, val_avg, val_y, knn.k, knn.temperature)}
    if probed:
        heads = encoder.blocks[0].attn.num_heads
        result["knn_probe_linear"] = probe_top1(*ref_all, ref_y, *val_all, val_y, knn.probe_epochs)
        result["knn_probe_attentive"] = probe_top1(*ref_all, ref_y, *val_all, val_y, knn.probe_epochs, heads)
    return result

"""A representation-quality signal during pretraining (`knn_monitor`): k-NN classification of validation images by
their nearest labelled training images in the encoder's feature space, with DINO's weighted vote, reported as
`knn_top1_cls` (the [class] token) and `knn_top1_avg` (the mean of the patch tokens).
See docs/pretrain.md#the-k-nn-monitor-pretrainknnpy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer

from vit_mpp.data.manifest import Split
from vit_mpp.data.stream import normalize, to_device
from vit_mpp.run.loop import Gate
from vit_mpp.run.metering.eval_progress import with_progress
from vit_mpp.run.start.run import Run

Norm = tuple[tuple[float, ...], tuple[float, ...]]  # the encoder's mean and std


@torch.no_grad()
def features(run: Run, encoder: VisionTransformer, split: Split, limit: int, norm: Norm, gated: Gate,
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """([class] features (N, D), patch-mean features (N, D), labels (N,)) of the first `limit` images of `split`,
    gathered from every process (each image once); batches taken through `gated`."""
    accelerator, loader = run.accelerator, gated(run.eval_loader(split, limit=limit))
    mean, std = norm
    cls, avg, labels, valid = [], [], [], []
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
    gathered = accelerator.gather((torch.cat(cls), torch.cat(avg), torch.cat(labels), torch.cat(valid)))
    keep = gathered[3]
    return gathered[0][keep], gathered[1][keep], gathered[2][keep]


CHUNK = 1024  # queries at a time: bounds the (chunk, N) similarity matrix


def knn_top1(ref: torch.Tensor, ref_labels: torch.Tensor, query: torch.Tensor, query_labels: torch.Tensor, k: int,
             temperature: float) -> float:
    """Top-1 accuracy of weighted k-NN voting with cosine similarity (DINO's rule)."""
    num_classes = int(max(ref_labels.max(), query_labels.max())) + 1
    ref = F.normalize(ref, dim=1)  # (N, D)
    k = min(k, ref.shape[0])
    correct = 0
    for start in range(0, query.shape[0], CHUNK):
        q = F.normalize(query[start:start + CHUNK], dim=1)  # (Q, D)
        sims, idx = (q @ ref.T).topk(k, dim=1)  # (Q, k)
        votes = F.one_hot(ref_labels[idx], num_classes).float() * (sims / temperature).exp().unsqueeze(-1)
        correct += int((votes.sum(dim=1).argmax(dim=1) == query_labels[start:start + CHUNK]).sum())
    return correct / max(1, query.shape[0])


def knn_monitor(run: Run, encoder: VisionTransformer, ref_split: Split, norm: Norm, gated: Gate,
                ) -> dict[str, float] | None:
    """`knn_top1_cls` and `knn_top1_avg` of the run's validation split against `ref_split`, or None when either is
    unlabelled; batches taken through `gated`. Leaves the encoder in eval mode."""
    knn = run.cfg.knn
    encoder.eval()
    ref_cls, ref_avg, ref_y = features(run, encoder, ref_split, knn.train_images, norm, gated)
    val_cls, val_avg, val_y = features(run, encoder, run.data.val_split, knn.val_images, norm, gated)
    if not len(ref_y) or not len(val_y) or ref_y.min() < 0 or val_y.min() < 0:
        return None  # unlabelled (label -1): no classes to vote for
    return {"knn_top1_cls": knn_top1(ref_cls, ref_y, val_cls, val_y, knn.k, knn.temperature),
            "knn_top1_avg": knn_top1(ref_avg, ref_y, val_avg, val_y, knn.k, knn.temperature)}

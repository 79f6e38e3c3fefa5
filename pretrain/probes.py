"""Probes beside the k-NN monitor (pretrain/knn.py), trained at each evaluation on the frozen features it has just
read (its labelled reference images) and scored on its validation images: a linear probe of the [class] token
(`knn_probe_linear`) and an attentive probe of every token (`knn_probe_attentive`: timm's attention pool, one
learned query through one cross-attention block, then a linear layer: V-JEPA's, arXiv 2404.08471, and
finetune's `train.mode=attentive_probe`). k-NN stays flat on masked-image-modelling features where fine-tuning
gains; the attentive probe is the frozen evaluation that tracks it. See docs/pretrain.md#probes-beside-the-k-nn-monitor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from timm.layers import AttentionPoolLatent
from torch import nn

BATCH = 64
LR = 1e-3
WEIGHT_DECAY = 0.01
SEED = 0  # the same probe at every evaluation, on every process


class _Probe(nn.Module):
    """A linear layer on the [class] token, or on every token pooled by an attention pool (`heads` > 0)."""

    def __init__(self, dim: int, classes: int, heads: int = 0) -> None:
        super().__init__()
        self.pool = AttentionPoolLatent(dim, num_heads=heads) if heads else None
        self.norm = nn.LayerNorm(dim, elementwise_affine=False)  # the features' scale differs from run to run
        self.head = nn.Linear(dim, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.pool(tokens) if self.pool is not None else tokens[:, 0]
        return self.head(self.norm(x))


def probe_top1(ref: torch.Tensor, ref_labels: torch.Tensor, query: torch.Tensor, query_labels: torch.Tensor,
               epochs: int, heads: int = 0) -> float:
    """Top-1 on (`query`, `query_labels`) of a probe trained `epochs` epochs on (`ref`, `ref_labels`), tokens
    (N, T, D) in full precision: linear on the [class] token, or attentive over every token with `heads` heads.
    AdamW (lr 1e-3, weight decay 0.01), batches of 64, from a fixed seed: the same numbers on every process."""
    classes = int(max(ref_labels.max(), query_labels.max())) + 1
    generator = torch.Generator().manual_seed(SEED)
    with torch.random.fork_rng(devices=[]):  # the run's own random state is left as it was
        torch.manual_seed(SEED)
        probe = _Probe(ref.shape[-1], classes, heads).to(ref.device)
    optimizer = torch.optim.AdamW(probe.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    with torch.enable_grad():
        for _ in range(epochs):
            for idx in torch.randperm(len(ref), generator=generator).split(BATCH):
                idx = idx.to(ref.device)
                loss = F.cross_entropy(probe(ref[idx]), ref_labels[idx])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
    with torch.no_grad():
        correct = sum(int((probe(q).argmax(1) == y).sum()) for q, y in zip(query.split(BATCH * 4),
                                                                             query_labels.split(BATCH * 4)))
    return correct / max(1, len(query))

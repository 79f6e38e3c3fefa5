"""k-NN classification in a feature space (`knn_top1`): DINO's weighted vote of the k nearest labelled features by
cosine similarity. The pretraining's representation monitor (pretrain/knn.py) and the pool's labeller probe
(experiments/pool_labels.py) score features with it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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

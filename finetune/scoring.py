"""Scoring a classifier on a split: loss, top-1/top-5, per-class accuracy and the confusion matrix.

Every rank evaluates its own range of the split (padded with invalid samples, see vit_mpp/data/stream.py); the
sums and the K x K count matrix are reduced once at the end, so each validation sample counts exactly once.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator

from vit_mpp.data.stream import normalize, to_device
from vit_mpp.durable import write_atomic
from vit_mpp.tools.figures import pyplot, save_figure

MAX_TICK_LABELS = 40  # beyond this, class names on the axes are unreadable
# A pool's rule: teacher probabilities (B, K) -> (pseudo-label, kept), each (B,) (finetune/thresholds.py `label`)
Labeller = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@torch.no_grad()
def evaluate(accelerator: Accelerator, model: torch.nn.Module, loader,
             mean_std: tuple[tuple[float, ...], tuple[float, ...]], num_classes: int,
             labeller: Labeller | None = None) -> tuple[dict[str, float], torch.Tensor]:
    """(metrics, confusion) over the whole split, the images normalised by the model's (mean, std);
    confusion[true, predicted] counts samples (CPU, int64).

    Metrics: val_loss, val_top1, val_top5 (more than 5 classes), val_samples, val_mean_class_acc; with a pool's
    `labeller` (the model is its teacher), `val_pseudo_kept` and `val_pseudo_acc`: the share of the split's images
    whose pseudo-label the rule would keep now, and the share of those that are right, an estimate from labelled
    images of what the pool gets. The model is left in eval mode; the caller restores its training mode.
    """
    model.eval()
    k = min(5, num_classes)
    loss_sum = torch.zeros(1, device=accelerator.device)
    # Integer counts, so they stay exact at any size: confusion[true * K + pred], the top-k hits, the pseudo-labels
    # kept and the right ones among them.
    counts = torch.zeros(num_classes * num_classes + 3, device=accelerator.device, dtype=torch.int64)
    for batch in loader:
        batch = to_device(batch, accelerator.device)
        with accelerator.autocast():
            logits = model(normalize(batch["image"], *mean_std)).float()  # (B, K)
        valid, labels = batch["valid"], batch["label"]
        loss_sum += (F.cross_entropy(logits, labels, reduction="none") * valid).sum()
        counts.index_add_(0, labels * num_classes + logits.argmax(1), valid.long())  # invalid samples add 0
        hits_k = (logits.topk(k, dim=1).indices == labels.unsqueeze(1)).any(1)  # (B,)
        counts[-3] += (hits_k & valid).sum()
        if labeller is not None:
            pseudo, kept = labeller(logits.softmax(1))
            counts[-2] += (kept & valid).sum()
            counts[-1] += (kept & valid & (pseudo == labels)).sum()
    loss_sum = accelerator.reduce(loss_sum, reduction="sum")
    counts = accelerator.reduce(counts, reduction="sum").cpu()
    confusion = counts[:-3].view(num_classes, num_classes)
    samples = int(confusion.sum())
    n = max(1, samples)
    per_class = per_class_accuracy(confusion)
    seen = confusion.sum(1) > 0
    result = {"val_loss": float(loss_sum) / n, "val_top1": float(confusion.diagonal().sum()) / n,
              "val_samples": samples,
              "val_mean_class_acc": float(per_class[seen].mean()) if seen.any() else 0.0}
    if num_classes > 5:
        result["val_top5"] = float(counts[-3]) / n
    if labeller is not None:
        result["val_pseudo_kept"] = float(counts[-2]) / n
        result["val_pseudo_acc"] = float(counts[-1]) / max(1, int(counts[-2]))
    return result, confusion


def per_class_accuracy(confusion: torch.Tensor) -> torch.Tensor:
    """Recall of each class (correct / samples of that class); 0 for classes without samples."""
    counts = confusion.sum(1)
    return confusion.diagonal().double() / counts.clamp(min=1)


def write_confusion(confusion: torch.Tensor, class_names: list[str] | None, out_dir: str | Path,
                    title: str = "") -> None:
    """Write `confusion_matrix.json` (counts, per-class accuracy) and `confusion_matrix.png` into `out_dir`."""
    out_dir = Path(out_dir)
    num_classes = confusion.shape[0]
    names = list(class_names) if class_names and len(class_names) == num_classes else [str(i) for i in
                                                                                       range(num_classes)]
    per_class = per_class_accuracy(confusion)
    write_atomic(out_dir / "confusion_matrix.json", json.dumps({
        "class_names": names, "confusion": confusion.tolist(), "per_class_count": confusion.sum(1).tolist(),
        "per_class_acc": [round(float(a), 6) for a in per_class]}, indent=None) + "\n")
    # Rows normalised, so classes of different sizes read alike; the counts are in the JSON.
    rates = (confusion.double() / confusion.sum(1, keepdim=True).clamp(min=1)).numpy()
    size = min(16.0, 3.0 + 0.35 * num_classes)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(size + 1.5, size))
    im = ax.imshow(rates, cmap="Blues", vmin=0.0, vmax=1.0, interpolation="nearest")
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="fraction of the true class")
    if num_classes <= MAX_TICK_LABELS:
        ax.set_xticks(range(num_classes), names, rotation=90)
        ax.set_yticks(range(num_classes), names)
        if num_classes <= 12:
            for i in range(num_classes):
                for j in range(num_classes):
                    ax.text(j, i, str(int(confusion[i, j])), ha="center", va="center", fontsize=8,
                            color="white" if rates[i, j] > 0.5 else "black")
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title(title)
    save_figure(fig, out_dir / "confusion_matrix.png")

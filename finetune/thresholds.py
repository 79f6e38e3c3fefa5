"""Which pool images train the student, and towards which class (`PoolThresholds`): the teacher's probabilities on the
weak views, aligned with the uniform distribution when `semi.align` is on (ReMixMatch's distribution alignment), then
a fixed threshold (`semi.threshold`) or FreeMatch's self-adaptive ones (`semi.threshold_mode=freematch`, arXiv
2205.07246). docs/finetune.md#semi-supervised-fine-tuning-semi.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from finetune.config import SemiConfig

Reduce = Callable[[torch.Tensor], torch.Tensor]  # a sum over every process (one all-reduce; the tensor itself alone)


class PoolThresholds(torch.nn.Module):
    """`thresholds(probs, pool)` -> (confidence, pseudo-label, kept), each (B,), for a micro-batch's teacher
    probabilities (B, K) and its pool mask (B,).

    The running means are of the pool images of every process (one all-reduce per micro-batch through `reduce`), so
    every rank holds the same thresholds; they are buffers, saved in the run's checkpoints (the caller registers this
    module with Accelerate when `stateful`). FreeMatch, per micro-batch: tau = m tau + (1 - m) mean(max probability),
    p = m p + (1 - m) mean(probabilities), class c's threshold tau p_c / max(p), both starting at 1 / K; alignment:
    q = m q + (1 - m) mean(probabilities) of the teacher, and the probabilities used are probs / q, renormalised.
    Also counts, per pseudo-label, the pool images labelled and kept since the last `per_class` (a log's interval).
    """

    def __init__(self, semi: SemiConfig, num_classes: int, reduce: Reduce) -> None:
        super().__init__()
        self.mode, self.align, self.fixed = semi.threshold_mode, semi.align, semi.threshold
        self.momentum, self.num_classes, self.reduce = semi.momentum, num_classes, reduce
        uniform = torch.full((num_classes,), 1.0 / num_classes)
        self.register_buffer("global_threshold", torch.tensor(1.0 / num_classes))  # FreeMatch's tau
        self.register_buffer("class_means", uniform.clone())  # FreeMatch's p~: the (aligned) probabilities' mean
        self.register_buffer("teacher_means", uniform.clone())  # alignment's: the teacher's own probabilities' mean
        self.labelled_as = torch.zeros(num_classes)  # pool images per pseudo-label since the last log (not saved)
        self.kept_as = torch.zeros(num_classes)

    @property
    def stateful(self) -> bool:
        """Whether its running means change as it trains (and so belong in a checkpoint)."""
        return self.mode == "freematch" or self.align

    def _pool_mean(self, values: torch.Tensor, pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the mean of `values` (B, C) over the pool rows of every process (C,), whether there were any)."""
        weight = pool.float()
        sums = self.reduce(torch.cat([(values * weight[:, None]).sum(0), weight.sum()[None]]))
        count = sums[-1]
        return sums[:-1] / count.clamp(min=1), count > 0

    def _follow(self, running: torch.Tensor, mean: torch.Tensor, seen: torch.Tensor) -> None:
        """One step of a running mean, in place; unchanged when no process had a pool image (no host read)."""
        running.copy_(torch.where(seen, self.momentum * running + (1 - self.momentum) * mean, running))

    def class_thresholds(self) -> torch.Tensor:
        """Each class's threshold now (K,)."""
        if self.mode == "freematch":
            return self.global_threshold * self.class_means / self.class_means.max()
        return torch.full_like(self.class_means, self.fixed)

    def _aligned(self, probs: torch.Tensor) -> torch.Tensor:
        if not self.align:
            return probs
        probs = probs / self.teacher_means  # x uniform, a constant the renormalisation removes
        return probs / probs.sum(1, keepdim=True)

    def _passes(self, confidence: torch.Tensor, pseudo: torch.Tensor) -> torch.Tensor:
        """Whether each (aligned) top probability reaches its pseudo-label's threshold now (B,)."""
        return confidence >= self.class_thresholds()[pseudo]

    @torch.no_grad()
    def forward(self, probs: torch.Tensor, pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.align:
            mean, seen = self._pool_mean(probs, pool)
            self._follow(self.teacher_means, mean, seen)
        probs = self._aligned(probs)
        confidence, pseudo = probs.max(1)  # (B,), (B,)
        if self.mode == "freematch":  # the statistics first, then the mask, as FreeMatch does
            mean, seen = self._pool_mean(torch.cat([confidence[:, None], probs], 1), pool)
            self._follow(self.global_threshold, mean[0], seen)
            self._follow(self.class_means, mean[1:], seen)
        kept = pool & self._passes(confidence, pseudo)
        labelled_as = F.one_hot(pseudo, self.num_classes).float()  # (B, K)
        self.labelled_as = self.labelled_as.to(probs.device) + (labelled_as * pool[:, None]).sum(0)
        self.kept_as = self.kept_as.to(probs.device) + (labelled_as * kept[:, None]).sum(0)
        return confidence, pseudo, kept

    @torch.no_grad()
    def label(self, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(pseudo-label, kept), each (B,), for teacher probabilities (B, K) of images that are not the pool's (the
        validation split's): what the rule would make of them now, its running means left as they are."""
        confidence, pseudo = self._aligned(probs).max(1)
        return pseudo, self._passes(confidence, pseudo)

    def per_class(self) -> dict[str, Any]:
        """For a log record, over every process since the last call (a collective: call it on every process): each
        class's threshold now, the share of the pool images the teacher gave that class that were kept (None where
        it gave it none), and the share of pool images it gave that class. The counts start again."""
        counts = self.reduce(torch.stack([self.labelled_as, self.kept_as]).to(self.class_means.device)).tolist()
        self.labelled_as, self.kept_as = torch.zeros_like(self.labelled_as), torch.zeros_like(self.kept_as)
        labelled, kept = counts
        total = sum(labelled)
        return {"pseudo_class_threshold": [round(t, 4) for t in self.class_thresholds().tolist()],
                "pseudo_class_kept": [round(k / n, 4) if n else None for k, n in zip(kept, labelled)],
                "pseudo_class_share": [round(n / total, 4) if total else None for n in labelled]}

    def describe(self) -> str:
        """The rule, for the start-up summary."""
        rule = (f"FreeMatch's adaptive thresholds (momentum {self.momentum:g})" if self.mode == "freematch"
                else f"above {self.fixed:g}")
        return rule + (f", aligned to the uniform distribution (momentum {self.momentum:g})" if self.align else "")

"""Evaluate-and-keep-best: at each evaluation of fine-tuning, score the model (and its EMA) on the validation split,
draw the confusion matrix, and export whichever beats its best top-1 so far to `export/best` (`export_ema/best`).
With a pool, the EMA is its teacher: its pseudo-labels of the validation images are scored too."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

from timm.utils import ModelEmaV3

from finetune.classifier_export import ClassifierExporter
from finetune.scoring import Labeller, evaluate, per_class_accuracy, write_confusion
from vit_mpp.run.loop import At
from vit_mpp.run.metering.eval_progress import with_progress
from vit_mpp.run.metering.step_meter import Evaluation
from vit_mpp.run.metering.tracking import log_images
from vit_mpp.run.start.run import Run


@dataclass
class Best:
    """The best validation top-1 so far, of the model and of its EMA (checkpointed, so a resumed run keeps them)."""

    top1: float = -1.0
    ema_top1: float = -1.0


# Below this share of right pseudo-labels no pool helped in docs/results.md's tables (the digits' paid from 76%)
POOR_PSEUDO_LABELS = 0.5


def poor_teacher_warning(ema_result: dict[str, float], step: int) -> str | None:
    """The warning for a teacher whose kept pseudo-labels of the validation images are mostly wrong, or None."""
    kept, right = ema_result.get("val_pseudo_kept"), ema_result.get("val_pseudo_acc")
    if kept is None or right is None or kept <= 0 or right >= POOR_PSEUDO_LABELS:
        return None
    return (f"warning: at step {step} the pool's teacher (the EMA) would keep {kept:.0%} of the validation images "
            f"with pseudo-labels {right:.0%} right: no pool labelled less than half right helped fine-tuning in the "
            f"measured tables, and semi.gate={POOR_PSEUDO_LABELS:g} keeps the pool out while so (docs/finetune.md, "
            "\"The gate\")")


@dataclass
class KeepBest:
    """`keep_best(model, ema, at, label)`: score the model (and its EMA) on the validation split, draw the confusion
    matrix and export whichever beats its best so far. Every process calls it: the reductions and exports are
    collective."""

    run: Run
    loader: Any  # the validation loader; None without a validation split (then nothing is evaluated)
    exporter: ClassifierExporter
    best: Best
    labeller: Labeller | None = None  # the pool's rule, when the EMA is a pool's teacher
    result: dict[str, float] = field(default_factory=dict)  # the last evaluation's, of the model
    ema_result: dict[str, float] = field(default_factory=dict)  # and of its EMA ({} without one)
    warned: bool = False  # the poor teacher's warning is printed once per process

    @classmethod
    def for_run(cls, run: Run, exporter: ClassifierExporter, state: dict[str, Any],
                labeller: Labeller | None = None) -> KeepBest:
        """The run's evaluation, with the best scores of the checkpointed trainer `state`."""
        split = run.data.val_split
        loader = run.eval_loader(split, num_classes=exporter.num_classes) if split is not None else None
        return cls(run, loader, exporter, Best(state.get("best_top1", -1.0), state.get("best_ema_top1", -1.0)),
                   labeller)

    @property
    def evaluates(self) -> bool:
        return self.loader is not None

    def state(self) -> dict[str, float]:
        """What a checkpoint keeps of it."""
        return {"best_top1": self.best.top1, "best_ema_top1": self.best.ema_top1}

    def __call__(self, model: Any, ema: ModelEmaV3 | None, at: At, label: str) -> Evaluation:
        """Leaves the model in eval mode; the loop restores its training mode."""
        accelerator, exporter, run_dir = self.run.accelerator, self.exporter, self.run.run_dir
        mean, std, num_classes = exporter.mean, exporter.std, exporter.num_classes
        split = self.run.data.val_split
        with with_progress(accelerator, at.gated(self.loader), f"validation ({split.name})",
                           split.num_samples) as batches:
            result, confusion = evaluate(accelerator, model, batches, (mean, std), num_classes)
        ema_result = {}
        if ema is not None:
            with with_progress(accelerator, at.gated(self.loader), f"validation of the EMA ({split.name})",
                               split.num_samples) as batches:
                ema_result = evaluate(accelerator, ema.module, batches, (mean, std), num_classes, self.labeller)[0]
            warning = None if self.warned else poor_teacher_warning(ema_result, at.step)
            if warning and accelerator.is_main_process:
                print(warning, file=sys.stderr, flush=True)
            self.warned = self.warned or warning is not None
        if accelerator.is_main_process:
            write_confusion(confusion, exporter.class_names, run_dir,
                            title=f"step {at.step}: top-1 {result['val_top1']:.4f} on {result['val_samples']} images")
            log_images(accelerator, {"val/confusion_matrix": run_dir / "confusion_matrix.png"}, at.step)
        if result["val_top1"] > self.best.top1:  # the same decision on every process: the metrics were reduced
            exporter.write(model, run_dir / "export" / "best", at, result)
            self.best.top1 = result["val_top1"]
        if ema is not None and ema_result["val_top1"] > self.best.ema_top1:
            exporter.write(ema.module, run_dir / "export_ema" / "best", at, ema_result, ema=True)
            self.best.ema_top1 = ema_result["val_top1"]
        self.result, self.ema_result = result, ema_result
        return Evaluation({**result, **{f"ema_{k}": v for k, v in ema_result.items()}}, label, split.num_samples,
                          details={"val_per_class_acc": per_class_accuracy(confusion).tolist(),
                                   "val_per_class_count": confusion.sum(1).tolist()})

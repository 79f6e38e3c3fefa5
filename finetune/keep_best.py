"""Evaluate-and-keep-best: at each evaluation of fine-tuning, score the model (and its EMA) on the validation split,
draw the confusion matrix, and export whichever beats its best top-1 so far to `export/best` (`export_ema/best`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from timm.utils import ModelEmaV3

from finetune.classifier_export import ClassifierExporter
from finetune.scoring import evaluate, per_class_accuracy, write_confusion
from vit_mpp.run.step_meter import StepMeter
from vit_mpp.run.tracking import log_images


@dataclass
class Best:
    """The best validation top-1 so far, of the model and of its EMA (checkpointed, so a resumed run keeps them)."""

    top1: float = -1.0
    ema_top1: float = -1.0


def evaluate_and_keep_best(accelerator: Accelerator, model: Any, ema: ModelEmaV3 | None, loader: Any,
                           exporter: ClassifierExporter, best: Best, meter: StepMeter, *, step: int, label: str,
                           split_size: int, run_dir: str | Path) -> tuple[dict[str, float], dict[str, float]]:
    """Score, log, draw and keep the best (every process calls this: the reductions and exports are collective);
    returns the metrics of the model and of its EMA ({} without one). The model is left in eval mode; the caller
    restores its training mode."""
    mean, std, num_classes = exporter.mean, exporter.std, exporter.num_classes
    result, confusion = evaluate(accelerator, model, loader, mean, std, num_classes)
    ema_result = evaluate(accelerator, ema.module, loader, mean, std, num_classes)[0] if ema is not None else {}
    meter.log_eval(step, {**result, **{f"ema_{k}": v for k, v in ema_result.items()}}, label=label,
                   split_size=split_size, details={"val_per_class_acc": per_class_accuracy(confusion).tolist(),
                                                   "val_per_class_count": confusion.sum(1).tolist()})
    if accelerator.is_main_process:
        write_confusion(confusion, exporter.class_names, run_dir,
                        title=f"step {step}: top-1 {result['val_top1']:.4f} on {result['val_samples']} images")
        log_images(accelerator, {"val/confusion_matrix": Path(run_dir) / "confusion_matrix.png"}, step)
    if result["val_top1"] > best.top1:  # the same decision on every process: the metrics were reduced
        exporter.write(model, Path(run_dir) / "export" / "best", step, result)
        best.top1 = result["val_top1"]
    if ema is not None and ema_result["val_top1"] > best.ema_top1:
        exporter.write(ema.module, Path(run_dir) / "export_ema" / "best", step, ema_result, ema=True)
        best.ema_top1 = ema_result["val_top1"]
    return result, ema_result

"""Evaluate-and-keep-best: at each evaluation of fine-tuning, score the model (and its EMA) on the validation split,
draw the confusion matrix, and export whichever beats its best top-1 so far to `export/best` (`export_ema/best`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from timm.utils import ModelEmaV3

from finetune.classifier_export import ClassifierExporter
from finetune.scoring import evaluate, per_class_accuracy, write_confusion
from vit_mpp.run.eval_progress import with_progress
from vit_mpp.run.start import Run
from vit_mpp.run.step_meter import StepMeter
from vit_mpp.run.tracking import log_images


@dataclass
class Best:
    """The best validation top-1 so far, of the model and of its EMA (checkpointed, so a resumed run keeps them)."""

    top1: float = -1.0
    ema_top1: float = -1.0


@dataclass
class KeepBest:
    """`keep_best(model, ema, step, label)`: score the model (and its EMA) on the validation split, log, draw and
    export whichever beats its best so far. Every process calls it: the reductions and exports are collective."""

    run: Run
    loader: Any  # the validation loader; None without a validation split (then nothing is evaluated)
    exporter: ClassifierExporter
    meter: StepMeter
    best: Best
    result: dict[str, float] = field(default_factory=dict)  # the last evaluation's, of the model
    ema_result: dict[str, float] = field(default_factory=dict)  # and of its EMA ({} without one)

    @classmethod
    def for_run(cls, run: Run, exporter: ClassifierExporter, meter: StepMeter, state: dict[str, Any]) -> KeepBest:
        """The run's evaluation, with the best scores of the checkpointed trainer `state`."""
        split = run.data.val_split
        loader = run.eval_loader(split, num_classes=exporter.num_classes) if split is not None else None
        # For the ETA: the loop's evaluation period (finetune/train.py), in steps
        steps_per_epoch = max(1, run.data.samples_per_epoch() // run.cfg.train.batch_size)
        meter.evaluates_every(steps_per_epoch * run.cfg.train.eval_every_epochs if loader is not None else None)
        return cls(run, loader, exporter, meter, Best(state.get("best_top1", -1.0), state.get("best_ema_top1", -1.0)))

    @property
    def evaluates(self) -> bool:
        return self.loader is not None

    def state(self) -> dict[str, float]:
        """What a checkpoint keeps of it."""
        return {"best_top1": self.best.top1, "best_ema_top1": self.best.ema_top1}

    def __call__(self, model: Any, ema: ModelEmaV3 | None, step: int, label: str) -> None:
        """Leaves the model in eval mode; the caller restores its training mode."""
        accelerator, exporter, run_dir = self.run.accelerator, self.exporter, self.run.run_dir
        mean, std, num_classes = exporter.mean, exporter.std, exporter.num_classes
        split = self.run.data.val_split
        with with_progress(accelerator, self.loader, f"validation ({split.name})", split.num_samples) as batches:
            result, confusion = evaluate(accelerator, model, batches, mean, std, num_classes)
        ema_result = {}
        if ema is not None:
            with with_progress(accelerator, self.loader, f"validation of the EMA ({split.name})",
                               split.num_samples) as batches:
                ema_result = evaluate(accelerator, ema.module, batches, mean, std, num_classes)[0]
        self.meter.log_eval(step, {**result, **{f"ema_{k}": v for k, v in ema_result.items()}}, label=label,
                            split_size=self.run.data.val_split.num_samples,
                            details={"val_per_class_acc": per_class_accuracy(confusion).tolist(),
                                     "val_per_class_count": confusion.sum(1).tolist()})
        if accelerator.is_main_process:
            write_confusion(confusion, exporter.class_names, run_dir,
                            title=f"step {step}: top-1 {result['val_top1']:.4f} on {result['val_samples']} images")
            log_images(accelerator, {"val/confusion_matrix": run_dir / "confusion_matrix.png"}, step)
        if result["val_top1"] > self.best.top1:  # the same decision on every process: the metrics were reduced
            self.run.data.realised = self.meter.realised_shares(self.run.data.names)  # for the export's record
            exporter.write(model, run_dir / "export" / "best", step, result)
            self.best.top1 = result["val_top1"]
        if ema is not None and ema_result["val_top1"] > self.best.ema_top1:
            exporter.write(ema.module, run_dir / "export_ema" / "best", step, ema_result, ema=True)
            self.best.ema_top1 = ema_result["val_top1"]
        self.result, self.ema_result = result, ema_result
        self.meter.evaluation_done()  # the confusion matrix and the best export were part of it

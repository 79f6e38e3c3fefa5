"""What a fine-tuning run hands on: classifier exports (the last and the best model, and the same of its EMA), each
with a model card, and the upload of the best one to the Hugging Face Hub.

    run_dir/export/          the last model        run_dir/export_ema/        the EMA's last weights
    run_dir/export/best/     the best by val top-1  run_dir/export_ema/best/   the EMA's best
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from vit_mpp.config.sections import ExportConfig, ModelConfig
from vit_mpp.data.training_data import TrainingData
from vit_mpp.models.export import Export, write_export
from vit_mpp.models.hub import publish
from vit_mpp.models.pretrained import describe_checkpoint, hub_model_id
from vit_mpp.run.loop import At
from vit_mpp.run.metering.curves import CURVES_NAME
from vit_mpp.run.start.run import Run
from vit_mpp.run.start.sharding import whole_state_dict


@dataclass
class ClassifierExporter:
    """Writes this run's classifier as an export; `record` is the provenance every export of the run carries."""

    accelerator: Accelerator
    model_cfg: ModelConfig
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    crop_pct: float
    class_names: list[str] | None
    record: dict[str, Any]  # {"finetune": {...}, "data": {...}, and "pretrain": {...} from the init export}
    training_data: TrainingData | None = None  # the run's: its record is made again at each export (shares so far)

    @classmethod
    def for_run(cls, run: Run, model_cfg: ModelConfig, mean: tuple[float, ...], std: tuple[float, ...],
                peak_lr: float) -> ClassifierExporter:
        """The exporter of a fine-tuning run, recording its recipe, its training data (`data`), the Hub model it
        started from (`base_model`) and the pretraining recipe of the export it started from, carried on."""
        cfg, tc, classes = run.cfg, run.cfg.train, run.data_check
        record = {"finetune": {"init": cfg.init.checkpoint, "base_model": hub_model_id(cfg.init.checkpoint),
                               "mode": tc.mode, "epochs": tc.epochs, "batch_size": tc.batch_size,
                               "optimizer": cfg.optim.name, "lr": peak_lr, "ema_decay": tc.ema_decay},
                  "data": {**run.data.record(), "val_split": cfg.data.val_split}}
        pretrained = pretrain_record(cfg.init.checkpoint, cfg.init.kind)
        if pretrained:
            record["pretrain"] = pretrained
        return cls(run.accelerator, model_cfg, classes.count, mean, std, cfg.data.eval_crop_pct, classes.names,
                   record=record, training_data=run.data)

    def write(self, net: torch.nn.Module, out_dir: Path, at: At, metrics: dict[str, Any], ema: bool = False) -> None:
        """Export `net` as it is at `at.step`, with the mixture's shares so far. Every process calls this (a sharded
        model is gathered from every process); the main process writes."""
        state = whole_state_dict(self.accelerator, net)
        if not self.accelerator.is_main_process:
            return
        finetune = {**self.record["finetune"], "step": at.step, "weights": "ema" if ema else "model"}
        now = self.training_data.record(at.shares) if self.training_data is not None else {}
        data = {**self.record["data"], **now}
        write_export(Export(out_dir, state, self.model_cfg, num_classes=self.num_classes, mean=self.mean,
                            std=self.std, crop_pct=self.crop_pct, class_names=self.class_names,
                            record={**self.record, "finetune": finetune, "data": data, "metrics": metrics}),
                     kind="classifier")


def pretrain_record(checkpoint: str, kind: str = "auto") -> dict[str, Any]:
    """The pretraining recipe of the checkpoint fine-tuning starts from (its export's `pretrain` record, with the name
    of the data it was pretrained on), so a fine-tuned export says where its encoder came from; {} for none."""
    if not checkpoint:
        return {}
    record = describe_checkpoint(checkpoint, kind)[1]
    pretrain = record.get("pretrain")
    if not isinstance(pretrain, dict):
        return {}
    if "data" in pretrain:  # carried on already (this checkpoint was itself fine-tuned from an MPP export)
        return dict(pretrain)
    data = record.get("data") or {}
    # the mixture it was pretrained on, and what validated it and fed its k-NN monitor, when the export says
    used = {key: data[key] for key in ("mixture", "val", "knn") if data.get(key)}
    return {**pretrain, "data": data.get("name") or data.get("shards"), "hf_dataset": data.get("hf_dataset"), **used}


def publish_exports(accelerator: Accelerator, run_dir: str | Path, export: ExportConfig, shards: str,
                    with_ema: bool) -> list[Path]:
    """A model card for every export of the run; the best model (else the last) goes to the Hub when asked. Returns
    the export folders of the run."""
    run = Path(run_dir)
    upload = run / "export" / "best" if (run / "export" / "best").is_dir() else run / "export"
    folders = [run / "export", run / "export" / "best"]
    if with_ema:
        folders += [run / "export_ema", run / "export_ema" / "best"]
    if not accelerator.is_main_process:
        return folders
    for folder in folders:
        if folder.is_dir():
            url = publish(folder, run / CURVES_NAME, export, shards, push_it=folder == upload)
            if url:
                accelerator.print(f"uploaded {folder} to {url}")
    return folders

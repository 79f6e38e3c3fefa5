"""The fine-tuning config: which encoder to start from, model input size, data, optimizer (the paper's SGD), run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from common.config import DataConfig, ModelConfig, OptimConfig, TrainConfig, opt, section


@dataclass
class InitConfig:
    checkpoint: str = opt("", "encoder to start from: a pretrain export (.safetensors or its folder); '' = scratch")
    posemb_interp: Literal["bilinear", "bicubic"] = opt("bilinear", "position-embedding resize (paper: bilinear)")


@dataclass
class FinetuneOptimConfig(OptimConfig):
    name: Literal["adamw", "adam", "sgd"] = opt("sgd", "optimizer (paper: SGD with momentum 0.9)")
    base_lr: float = opt(0.01, "learning rate at base_batch_size (paper: one of 0.001, 0.003, 0.01, 0.03)")
    base_batch_size: int = opt(512, "batch size at which base_lr applies (paper: 512)")
    warmup_steps: int = opt(500, "linear warmup steps")


@dataclass
class FinetuneTrainConfig(TrainConfig):
    run_dir: str = opt("runs/finetune", "run directory (config, metrics, checkpoints, export); re-running resumes")
    batch_size: int = opt(512, "global batch size (all processes, after accumulation)")
    epochs: int = opt(10, "passes over the training split")
    label_smoothing: float = opt(0.0, "label smoothing of the cross-entropy")
    eval_every_epochs: int = opt(1, "evaluate on the validation split every N epochs (and at the end)")


@dataclass
class FinetuneConfig:
    init: InitConfig = section(InitConfig)
    model: ModelConfig = section(ModelConfig)
    num_classes: int | None = opt(None, "classes of the new head (default: from the shard manifest)")
    data: DataConfig = section(DataConfig)
    optim: FinetuneOptimConfig = section(FinetuneOptimConfig)
    train: FinetuneTrainConfig = section(FinetuneTrainConfig)

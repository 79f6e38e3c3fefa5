"""The pretraining config: model, MPP objective, data, optimizer (the paper's recipe by default), run."""

from __future__ import annotations

from dataclasses import dataclass

from common.config import DataConfig, ModelConfig, OptimConfig, TrainConfig, opt, section
from pretrain.mpp import MPPConfig


@dataclass
class PretrainTrainConfig(TrainConfig):
    run_dir: str = opt("runs/pretrain", "run directory (config, metrics, checkpoints, export); re-running resumes")
    steps: int = opt(1000, "optimizer steps (the paper: 1M at batch 4096)")
    eval_every: int = opt(500, "evaluate the MPP loss on the validation split every N steps (0: only at the end)")


@dataclass
class PretrainConfig:
    model: ModelConfig = section(ModelConfig)
    mpp: MPPConfig = section(MPPConfig)
    data: DataConfig = section(DataConfig)
    optim: OptimConfig = section(OptimConfig)
    train: PretrainTrainConfig = section(PretrainTrainConfig)

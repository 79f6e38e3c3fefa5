"""Experiment trackers through Accelerate (TensorBoard, W&B, MLflow, ...): checked before training starts, and sent
the whole resolved config flattened to dotted keys (`optim.base_lr`), so runs can be filtered on any setting.

    train.trackers: [tensorboard]      # any of vit_mpp.config.TRACKERS; each needs its own package
    train.project: vit-mpp             # W&B/MLflow project; TensorBoard writes to run_dir/logs/<project>/
    train.run_name: ...                # the run's name in the tracker (default: the run directory's path)
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from accelerate import Accelerator

from vit_mpp.config import ConfigError, TrainConfig, flatten, to_dict

# The package each tracker imports (Accelerate skips a tracker whose package is missing, with only a log message).
PACKAGES = {"tensorboard": ("tensorboard", "tensorboardX"), "wandb": ("wandb",), "comet_ml": ("comet_ml",),
            "aim": ("aim",), "mlflow": ("mlflow",), "clearml": ("clearml",), "dvclive": ("dvclive",),
            "swanlab": ("swanlab",), "trackio": ("trackio",)}
# How each tracker is told the run's name (Accelerate passes `project` as the project / experiment / log folder).
RUN_NAME_KWARG = {"wandb": "name", "mlflow": "run_name", "clearml": "task_name", "swanlab": "experiment_name",
                  "trackio": "name", "aim": "run_name"}


def check_trackers(names: list[str]) -> None:
    """Every tracker named can start: its package is installed (a ConfigError naming it otherwise)."""
    for name in names:
        if not any(importlib.util.find_spec(p) for p in PACKAGES[name]):
            extra = " (pip install 'vit-mpp[tracking]')" if name == "tensorboard" else ""
            raise ConfigError(f"train.trackers names {name}, but its package {PACKAGES[name][0]} is not installed: "
                              f"pip install {PACKAGES[name][0]}{extra}, or remove it from train.trackers")


def tracker_config(cfg: Any) -> dict[str, Any]:
    """The resolved config as flat `section.key` -> value; lists and nulls as strings (trackers want scalars)."""
    return {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in flatten(to_dict(cfg)).items()}


def start_trackers(accelerator: Accelerator, train: TrainConfig, cfg: Any) -> None:
    """Start the configured trackers with the flattened config (a no-op without trackers)."""
    if not train.trackers:
        return
    run_name = train.run_name or str(Path(train.run_dir))
    init_kwargs = {t: {RUN_NAME_KWARG[t]: run_name} for t in train.trackers if t in RUN_NAME_KWARG}
    accelerator.init_trackers(train.project, config=tracker_config(cfg), init_kwargs=init_kwargs)

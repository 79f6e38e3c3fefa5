"""Experiment trackers through Accelerate (TensorBoard, W&B, MLflow, ...): checked before training starts
(`check_trackers`), each run named, its numbers grouped as `<group>/<name>` (`tracker_key`), and its hyperparameters
tied to its final and best metrics (`start_trackers`, `log_scalars`, `log_images`, `finish_trackers`).
See docs/pretrain.md#trackers-and-curves.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from accelerate.tracking import LOGGER_TYPE_TO_CLASS, TensorBoardTracker

from vit_mpp.config.engine import ConfigError, flatten, to_dict
from vit_mpp.config.sections import TrainConfig
from vit_mpp.run.metering.metrics_log import read_metrics
from vit_mpp.run.metering.summary import best_metrics

# The package each tracker imports (Accelerate skips a tracker whose package is missing, with only a log message).
PACKAGES = {"tensorboard": ("tensorboard", "tensorboardX"), "wandb": ("wandb",), "comet_ml": ("comet_ml",),
            "aim": ("aim",), "mlflow": ("mlflow",), "clearml": ("clearml",), "dvclive": ("dvclive",),
            "swanlab": ("swanlab",), "trackio": ("trackio",)}
# How each tracker is told the run's name; Accelerate passes `project` as the project / experiment / log folder.
# (aim takes the run's name where the others take the project, and comet_ml is named once started: see _create.)
RUN_NAME_KWARG = {"wandb": "name", "mlflow": "run_name", "clearml": "task_name", "swanlab": "experiment_name",
                  "trackio": "name", "dvclive": "exp_name"}
GROUPS = ("val", "knn", "ema")  # metrics.jsonl key prefixes that are tracker groups; everything else is train/
# The step is the x axis; every tracker keeps its own wall time (the run's times are in metrics.jsonl and summary.json)
NOT_TRACKED = ("step", "elapsed_s", "run_s", "train_s", "eval_s")
TAKES_IMAGES = ("tensorboard", "wandb", "aim", "clearml", "swanlab")  # trackers with Accelerate's log_images


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


def tracker_key(key: str) -> str:
    """The name a metrics.jsonl key has in the trackers: `val_loss` -> `val/loss`, `loss` -> `train/loss`."""
    group, _, rest = key.partition("_")
    return f"{group}/{rest}" if group in GROUPS and rest else f"train/{key}"


def run_name(train: TrainConfig) -> str:
    """The run's name in every tracker: `train.run_name`, else the run directory's path."""
    return train.run_name or str(Path(train.run_dir))


def tensorboard_folder(name: str) -> str:
    """The folder of a run under run_dir/logs/<project>/: its name, one path component (TensorBoard shows runs by
    folder), e.g. `runs/demo/pretrain` -> `runs_demo_pretrain`."""
    return re.sub(r"[^\w.=+-]+", "_", name).strip("._") or "run"


class RunTensorBoard(TensorBoardTracker):
    """Accelerate's TensorBoard tracker, writing to the run's own folder; the hyperparameters go into that folder too,
    at the end, with the final metrics (`write_hparams`), where TensorBoard's HPARAMS tab pairs them."""

    def __init__(self, folder: str, logging_dir: str | Path, purge_step: int | None = None) -> None:
        # purge_step: a resumed run logs again the steps after its checkpoint; TensorBoard then drops those the
        # killed run had logged, instead of showing both.
        super().__init__(folder, logging_dir, purge_step=purge_step)
        self.hparams: dict[str, Any] = {}

    def store_init_configuration(self, values: dict) -> None:
        """Keep the hyperparameters for `write_hparams` (TensorBoard pairs them with metrics known only at the end)."""
        self.hparams = dict(values)

    def write_hparams(self, metrics: dict[str, float], step: int) -> None:
        """The hyperparameters and `metrics` into this run's own event file, the metrics also as scalars."""
        try:
            from torch.utils.tensorboard.summary import hparams
        except ImportError:  # only tensorboardX installed
            from tensorboardX.summary import hparams
        for summary in hparams(self.hparams, metrics):  # experiment, session start, session end
            self.writer.file_writer.add_summary(summary, step)
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()


def _create(name: str, train: TrainConfig, logging_dir: str | Path) -> Any:
    """Accelerate's tracker `name` for this run, named (not started)."""
    label = run_name(train)
    if name == "tensorboard":
        # metrics.jsonl is rewound to the step the run resumes from: what comes after it will be logged again
        last = max((int(r.get("step", 0)) for r in read_metrics(train.run_dir)), default=-1)
        return RunTensorBoard(f"{train.project}/{tensorboard_folder(label)}", logging_dir, purge_step=last + 1)
    if name == "aim":  # aim.Run(experiment=project), run named `label` by the tracker itself
        return LOGGER_TYPE_TO_CLASS[name](label, logging_dir, experiment=train.project)
    cls = LOGGER_TYPE_TO_CLASS[name]
    kwargs = {RUN_NAME_KWARG[name]: label} if name in RUN_NAME_KWARG else {}
    return cls(train.project, logging_dir, **kwargs) if cls.requires_logging_directory else cls(train.project, **kwargs)


def start_trackers(accelerator: Accelerator, train: TrainConfig, cfg: Any) -> None:
    """Start the configured trackers (main process), named after the run, with the flattened config (a no-op
    without trackers). Built here rather than by `accelerator.init_trackers`, which gives every tracker the project
    as its run and TensorBoard a separate sub-run for the config."""
    if not train.trackers or not accelerator.is_main_process:
        return
    config = tracker_config(cfg)
    for name in train.trackers:
        tracker = _create(name, train, accelerator.logging_dir)
        tracker.start()
        if name == "comet_ml":
            tracker.writer.set_name(run_name(train))
        tracker.store_init_configuration(config)
        accelerator.trackers.append(tracker)  # what accelerator.log and end_training go through


def log_scalars(accelerator: Accelerator, record: dict[str, Any], step: int) -> None:
    """The numbers of a metrics.jsonl record, named by `tracker_key`, to every tracker (main process)."""
    if not accelerator.trackers:
        return
    values = {tracker_key(k): v for k, v in record.items()
              if k not in NOT_TRACKED and isinstance(v, (int, float)) and not isinstance(v, bool)}
    accelerator.log(values, step=step)


def log_images(accelerator: Accelerator, images: dict[str, str | Path], step: int) -> None:
    """PNG files (name -> path) to every tracker that takes images; MLflow keeps them as artifacts."""
    if not accelerator.trackers or not accelerator.is_main_process:
        return
    import numpy as np
    from PIL import Image

    arrays = {}
    for key, path in images.items():
        with Image.open(path) as im:
            arrays[key] = np.asarray(im.convert("RGB"))
    for tracker in accelerator.trackers:
        if tracker.name == "tensorboard":
            tracker.log_images({k: a[None] for k, a in arrays.items()}, step=step, dataformats="NHWC")
        elif tracker.name in TAKES_IMAGES:
            tracker.log_images({k: [a] for k, a in arrays.items()}, step=step)
        elif tracker.name == "mlflow":
            import mlflow

            for path in images.values():
                mlflow.log_artifact(str(path), artifact_path="figures")


def finish_trackers(accelerator: Accelerator, train: TrainConfig, final_metrics: dict[str, Any]) -> None:
    """At the end of a run, before `accelerator.end_training()`: the final metrics (`final/<key>`) and the run's best
    (`best/<key>`, from its metrics.jsonl) to every tracker, at the last step; TensorBoard writes the hyperparameters
    with them (see the module doc). A no-op without trackers."""
    if not accelerator.trackers or not accelerator.is_main_process:
        return
    records = read_metrics(train.run_dir)
    step = max((int(r.get("step", 0)) for r in records), default=0)
    metrics = {f"final/{k}": float(v) for k, v in final_metrics.items()
               if k not in NOT_TRACKED and isinstance(v, (int, float)) and not isinstance(v, bool)}
    metrics.update({f"best/{k}": v for k, v in best_metrics(records).items()})
    for tracker in accelerator.trackers:
        if isinstance(tracker, RunTensorBoard):
            tracker.write_hparams(metrics, step)
        elif metrics:
            tracker.log(metrics, step=step)

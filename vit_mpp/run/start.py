"""The start of a training run, the same in both stages: the accelerator (trackers checked), the Hub checked, the
seed, the data's manifests, the model's architecture (built in shapes only), the run directory (taken, its config
written; in a dry run only checked), the metrics log and the sample audit. The model and the data are checked
before the run directory is touched, so a wrong setting or path changes nothing."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from accelerate import Accelerator
from accelerate.utils import set_seed

from vit_mpp.config.engine import is_dry_run
from vit_mpp.data.stream_plan import Layout
from vit_mpp.data.training_data import TrainingData, load_training_data
from vit_mpp.models.vit import architecture
from vit_mpp.run.accelerator import GlobalBatch, make_accelerator
from vit_mpp.run.hub import check_hub
from vit_mpp.run.run_dir import MetricsLog, prepare_run_dir
from vit_mpp.run.sample_audit import SampleAudit


@dataclass
class RunStart:
    """What every training run has once it has started."""

    accelerator: Accelerator
    gbatch: GlobalBatch
    layout: Layout
    data: TrainingData
    changed: list[str]  # config keys that differ from the run directory's previous config
    log: MetricsLog
    audit: SampleAudit
    dry_run: bool
    data_check: Any = None  # what the stage's `check_data` returned (fine-tuning: its classes)


def start_run(cfg: Any, check_data: Callable[[TrainingData], object] | None = None) -> RunStart:
    """Start a run of a stage config (with `train`, `data` and `export` sections); see the module doc.
    `check_data`: the stage's own checks of the data (fine-tuning: classes and labels), run before the run
    directory is touched; what it returns is kept as `data_check`."""
    tc, dry_run = cfg.train, is_dry_run(cfg)
    accelerator, gbatch = make_accelerator(tc)
    if accelerator.is_main_process:
        check_hub(cfg.export)  # a push at the end of a long run must not fail for want of a token
    set_seed(tc.seed, device_specific=True)  # a different corruption draw and dropout on every process
    data = load_training_data(cfg.data)
    data_check = check_data(data) if check_data is not None else None
    # The model is built in shapes only (no memory): what only timm can tell (the patch size a model name implies,
    # against model.img_size) is then found before the run directory is touched, not when the model is built.
    architecture(cfg.model)
    with accelerator.main_process_first():
        changed = prepare_run_dir(tc.run_dir, cfg, accelerator.is_main_process, dry_run)
    layout = Layout(accelerator.num_processes, max(1, cfg.data.num_workers), gbatch.micro_batch, gbatch.accum_steps)
    is_main = accelerator.is_main_process and not dry_run
    audit = SampleAudit(tc.run_dir, accelerator.process_index, is_main, data.names, tc.record_samples and not dry_run)
    return RunStart(accelerator, gbatch, layout, data, changed, MetricsLog(tc.run_dir, is_main), audit, dry_run,
                    data_check)

"""The start of a training run, the same in both stages (`start_run`), and the `Run` it returns: what the run
carries from its first line to its export, and what it makes from itself (the resume, its loaders).
docs/architecture.md."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader

from vit_mpp.config.device_checks import check_device_settings
from vit_mpp.config.engine import is_dry_run
from vit_mpp.config.fsdp_settings import FsdpSettings
from vit_mpp.data.eval_stream import EvalStream
from vit_mpp.data.image_decoder import ImageDecoder
from vit_mpp.data.manifest import Split
from vit_mpp.data.stream import Batches, TrainStream, loader_layout, make_loader, read_settings
from vit_mpp.data.stream_plan import Generation, Layout, resume_generation
from vit_mpp.data.training_data import Pool, TrainingData, load_training_data
from vit_mpp.models.hub import check_hub
from vit_mpp.models.vit import architecture
from vit_mpp.processes.stop_signals import StopSignals
from vit_mpp.run.durability.checkpoint import resume_latest
from vit_mpp.run.durability.checkpoint_files import check_sharding
from vit_mpp.run.metering.metrics_log import MetricsLog
from vit_mpp.run.metering.sample_audit import SampleAudit
from vit_mpp.run.start.accelerator import GlobalBatch, make_accelerator, prepare_model
from vit_mpp.run.start.run_dir import prepare_run_dir


@dataclass
class Resumed:
    """Where a run starts: its step, the checkpoint's trainer state and this rank's own state, and the data
    stream's generation (vit_mpp/data/stream_plan.py), adapted to this run's layout."""

    step: int
    state: dict[str, Any]
    own: dict[str, Any] | None
    generation: Generation
    layout_changed: bool


@dataclass
class Run:
    """What every training run carries once it has started: its config (a stage config with `train`, `data`,
    `model` and `export` sections), accelerator, batch, data, run directory logs, and the stop signals it catches."""

    cfg: Any
    accelerator: Accelerator
    gbatch: GlobalBatch
    layout: Layout
    data: TrainingData
    changed: list[str]  # config keys that differ from the run directory's previous config
    log: MetricsLog
    audit: SampleAudit
    dry_run: bool
    signals: StopSignals
    data_check: Any = None  # what the stage's `check_data` returned (fine-tuning: its `Classes`)
    sharding: FsdpSettings | None = None  # the launch asks for FSDP (vit_mpp/run/start/sharding.py)

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.train.run_dir)

    @property
    def rank(self) -> int:
        return self.accelerator.process_index

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps in one epoch of the training data (of a mixture: see `TrainingData.samples_per_epoch`)."""
        return max(1, self.data.samples_per_epoch() // self.cfg.train.batch_size)

    def print(self, text: str) -> None:
        """Print on the main process."""
        self.accelerator.print(text)

    def prepare(self, model: torch.nn.Module, make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
                ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """The model made ready to train (sharded, or prepared for data parallel) and its optimizer:
        vit_mpp/run/start/accelerator.py `prepare_model`."""
        return prepare_model(self.accelerator, model, make_optimizer, self.cfg.train, self.sharding)

    def resume(self, total_steps: int, lr: Callable[[int], float]) -> Resumed:
        """Restore the newest checkpoint (vit_mpp/run/durability/checkpoint.py `resume_latest`), cut the metrics log and
        the sample audit back to its step, and continue the data stream where it stopped, on this layout; a line says so
        when the layout changed, and when a finished run goes on (train.extend), what its learning rate does (`lr` of a
        step)."""
        accelerator, tc = self.accelerator, self.cfg.train
        state, own = resume_latest(accelerator, tc.run_dir, self.changed)
        step = state.get("step", 0)
        for log in (self.log, self.audit):
            log.rewind(step)
        if state.get("finished") and total_steps > step:
            accelerator.print(f"note: the finished run goes on from step {step} to {total_steps} (train.extend): its "
                              f"learning rate, which had decayed to the end of its schedule, follows the schedule of "
                              f"{total_steps} steps from step {step + 1} on ({lr(step):.3g}, then down to step "
                              f"{total_steps})")
        generation, note = resume_generation(state.get("stream"), step, self.layout, self.data.sizes,
                                             self.data.weights, tc.seed)
        if note:
            accelerator.print(note)
        saved_world = state.get("num_processes", accelerator.num_processes)
        return Resumed(step, state, own, generation, saved_world != accelerator.num_processes)

    def train_loader(self, resumed: Resumed, num_classes: int | None = None,
                     augment: Callable[[torch.Tensor], torch.Tensor] | None = None,
                     pool_augment: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Batches:
        """This rank's endless training batches, from where `resumed` says (close them when the loop ends); with
        `num_classes` every label must be one of the classes; `augment` runs in the workers after the crop (and
        `pool_augment` instead on a pool's images, when given). The loader is not passed to `accelerate.prepare`: the
        stream splits itself across processes and workers (accelerate would re-split it, or make rank 0 decode for
        everyone)."""
        cfg = self.cfg
        decoder = ImageDecoder.for_training(cfg.data, cfg.model.img_size, augment, pool_augment)
        stream = TrainStream(self.data.sets, decoder, resumed.generation, rank=self.rank, resume_step=resumed.step,
                             read=read_settings(cfg.data, cfg.train.seed, num_classes))
        return Batches(stream, make_loader(stream, cfg.data))

    def eval_loader(self, split: Split, num_classes: int | None = None, limit: int | None = None) -> DataLoader:
        """One ordered pass over `split` (its first `limit` samples) for this rank, at the micro-batch size. In a
        training run, take its batches through the loop's stop agreement (vit_mpp/run/loop.py `At.gated`)."""
        cfg = self.cfg
        stream = EvalStream(split, ImageDecoder.for_evaluation(cfg.data, cfg.model.img_size),
                            loader_layout(cfg.data, self.gbatch.micro_batch, self.accelerator.num_processes),
                            rank=self.rank, read=read_settings(cfg.data, num_classes=num_classes), limit=limit)
        return make_loader(stream, cfg.data)


def start_run(cfg: Any, signals: StopSignals, check_data: Callable[[TrainingData], object] | None = None,
              pool: Pool | None = None) -> Run:
    """Start a run: device settings this machine cannot run refused (vit_mpp/config/device_checks.py), the accelerator
    (trackers checked), the Hub checked, the seed, the data's manifests, the model's architecture (built in shapes
    only), the run directory (taken, its config written; in a dry run only checked), the metrics log and the sample
    audit. The model and the data are checked before the run directory is touched, so a wrong setting or path
    changes nothing. `check_data`: the stage's own checks of the data (fine-tuning: classes and labels), run before
    the run directory is touched; what it returns is kept as `data_check`. `signals`: the run's stop signals, caught
    from before this call to the run's end. `pool`: semi-supervised fine-tuning's unlabelled sets, read in the same
    stream."""
    tc, dry_run = cfg.train, is_dry_run(cfg)
    check_device_settings(cfg)  # the stages' __main__ ask first; this covers a run started from code (`train(cfg)`)
    sharding = FsdpSettings.read()  # the launch asks for FSDP: this run shards itself (sharding.py)
    accelerator, gbatch = make_accelerator(tc)
    if accelerator.is_main_process:
        check_hub(cfg.export)  # a push at the end of a long run must not fail for want of a token
    set_seed(tc.seed, device_specific=True)  # a different corruption draw and dropout on every process
    data = load_training_data(cfg.data, pool=pool)
    data_check = check_data(data) if check_data is not None else None
    # The model is built in shapes only (no memory): what only timm can tell (the patch size a model name implies,
    # against model.img_size) is then found before the run directory is touched, not when the model is built.
    architecture(cfg.model)
    check_sharding(tc.run_dir, sharded=sharding is not None)  # its checkpoints are resumed as they were written
    with accelerator.main_process_first():
        changed = prepare_run_dir(tc.run_dir, cfg, accelerator.is_main_process, dry_run)
    layout = Layout(accelerator.num_processes, max(1, cfg.data.num_workers), gbatch.micro_batch, gbatch.accum_steps)
    is_main = accelerator.is_main_process and not dry_run
    audit = SampleAudit(tc.run_dir, accelerator.process_index, is_main, data.names, tc.record_samples and not dry_run)
    return Run(cfg, accelerator, gbatch, layout, data, changed, MetricsLog(tc.run_dir, is_main), audit, dry_run,
               signals, data_check, sharding)

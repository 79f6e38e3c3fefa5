"""`--dry-run`: everything a run checks at start, and what it would do, printed; nothing written. `probe` reads and
decodes the first sample of a shard set; `report` prints the resolved config, the stage's start-up summary, the
learning rate at a few steps and where the run would start. See docs/pretrain.md#run-directory-checkpoints-resume.
"""

from __future__ import annotations

import io
import json
from typing import Any

import yaml

from vit_mpp.config.engine import to_dict
from vit_mpp.config.sections import DataConfig
from vit_mpp.data.image_decoder import image_bytes
from vit_mpp.data.manifest import Split
from vit_mpp.data.shard_reader import ShardError, range_segments, read_segment
from vit_mpp.data.stream_plan import resume_generation
from vit_mpp.run.durability.checkpoint_files import TRAINER_STATE, latest_checkpoint
from vit_mpp.run.loop import Schedule
from vit_mpp.run.start.run import Run


def probe(split: Split, data: DataConfig, where: str) -> None:
    """Read and decode the first sample of `split` (a ShardError with one line when it cannot be)."""
    from PIL import Image

    segments = range_segments(split, list(range(len(split.urls))), 0, 1)
    if not segments:
        return
    sample = next(read_segment(segments[0], data.read_retries, timeout=data.read_timeout_s), None)
    if sample is None:
        raise ShardError(f"{where}: the first shard ({segments[0].url}) holds no sample")
    try:
        Image.open(io.BytesIO(image_bytes(sample))).load()
    except Exception as e:  # any decoder error says the same: this sample is not an image
        raise ShardError(f"{where}: sample {sample['__key__']} of {segments[0].url} is not a readable image "
                         f"({type(e).__name__})") from None


def report(run: Run, summary: str, schedule: Schedule) -> None:
    """Check the shards, then print what the run would do (main process); every process returns after it."""
    cfg = run.cfg
    for s in run.data.sets:
        probe(s.split, cfg.data, f"set '{s.name}' (split '{s.split.name}')")
    if run.data.val_split is not None:
        probe(run.data.val_split, cfg.data, f"evaluation split '{run.data.val_split.name}' of {run.data.val_location}")
    if not run.accelerator.is_main_process:
        return
    total_steps, warmup = schedule.total, schedule.warmup
    steps = sorted({1, max(1, warmup), max(1, warmup + 1), max(1, total_steps // 2), total_steps})
    rates = ", ".join(f"step {s} {schedule.lr(s - 1):.3g}" for s in steps if s <= total_steps)
    print("dry run: nothing is written; the resolved config:\n" + yaml.safe_dump(to_dict(cfg), sort_keys=False)
          + summary + f"\nlearning rate: {rates}\n" + _start(run, cfg, total_steps), flush=True)


def _start(run: Run, cfg: Any, total_steps: int) -> str:
    """Where the run would start: a new run, or a resume (and on which layout)."""
    ckpt = latest_checkpoint(cfg.train.run_dir)
    if ckpt is None:
        return f"would start a new run in {cfg.train.run_dir}, {total_steps} steps"
    state = json.loads((ckpt / TRAINER_STATE).read_text())
    note = resume_generation(state.get("stream"), state["step"], run.layout, run.data.sizes, run.data.weights,
                             cfg.train.seed)[1]
    changed = f"; config changes: {', '.join(run.changed)}" if run.changed else ""
    return (f"would resume {ckpt} at step {state['step']} of {total_steps}{changed}"
            + (f"\n{note}" if note else ""))

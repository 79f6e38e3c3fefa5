"""What each stage's entry point does before torch is imported (a bad config fails in a fraction of a second): the
start-up signals, the run's clock, the config read and checked, the settings this machine cannot run, the data's
local paths."""

from __future__ import annotations

from functools import partial
from typing import Any

from vit_mpp.config.device_checks import check_device_settings
from vit_mpp.config.engine import parse_args
from vit_mpp.config.fsdp_settings import refuse_deepspeed
from vit_mpp.data.manifest import check_location
from vit_mpp.processes.stop_signals import start_up_resumes_from, stop_during_start_up
from vit_mpp.run.durability.checkpoint_files import saved_step
from vit_mpp.run.metering.run_clock import mark_start


def read_run_config(cls: type, argv: list[str] | None, prog: str, description: str) -> Any:
    """The stage's config from the command line, checked (a user error raises, the entry point prints one line)."""
    stop_during_start_up()  # a signal during the seconds of imports: one line, not a silent end
    mark_start()  # the run's clock: its summary's total time counts the start-up too
    refuse_deepspeed()  # before the config's own checks, which would otherwise send the user round (semi.pool's EMA)
    cfg = parse_args(cls, argv, prog=prog, description=description)
    start_up_resumes_from(partial(saved_step, cfg.train.run_dir))  # a signal from now on names what a rerun resumes
    check_device_settings(cfg)  # data.decode=gpu, train.fp8=true where they cannot run: one line, first
    return cfg


def check_data_locations(cfg: Any) -> None:
    """Every local shard location of the run exists and holds a manifest (a URL is read by the run itself)."""
    for location in [*cfg.data.shard_sets(), cfg.data.val_shards]:
        if location.strip():
            check_location(location)

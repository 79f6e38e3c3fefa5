"""`python -m finetune` / `accelerate launch finetune` / `accelerate launch -m finetune`: see finetune/train.py.

The config is read and checked before torch is imported, so a bad config fails in a fraction of a second.
"""

from vit_mpp.launcher import die_with_launcher, stop_during_start_up

die_with_launcher()  # first of all: a launcher killed while this rank starts must not leave it running

from finetune.config import DESCRIPTION, FinetuneConfig  # noqa: E402
from vit_mpp.cli import run_main  # noqa: E402
from vit_mpp.config.engine import parse_args  # noqa: E402
from vit_mpp.data.manifest import check_location  # noqa: E402
from vit_mpp.models.export_folder import check_checkpoint_path  # noqa: E402
from vit_mpp.run.device_checks import check_device_settings  # noqa: E402
from vit_mpp.run.run_clock import mark_start  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    stop_during_start_up()  # a signal during the seconds of imports: one line, not a silent end
    mark_start()  # the run's clock: its summary's total time counts the start-up too
    cfg = parse_args(FinetuneConfig, argv, prog="finetune", description=DESCRIPTION)
    check_device_settings(cfg)  # data.decode=gpu, train.fp8=true where they cannot run: one line, first
    check_checkpoint_path(cfg.init.checkpoint)  # before the data, as the run itself does
    for location in [*cfg.data.shard_sets(), cfg.data.val_shards]:  # local paths; a URL is read by the run
        if location.strip():
            check_location(location)
    from finetune.train import train  # the heavy imports (torch, timm, accelerate), once the config is known good

    train(cfg)


if __name__ == "__main__":
    run_main(main)

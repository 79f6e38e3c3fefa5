"""`python -m finetune` / `accelerate launch finetune` / `accelerate launch -m finetune`: see finetune/train.py.

The config is read and checked before torch is imported, so a bad config fails in a fraction of a second.
"""

from vit_mpp.processes.rank_lifecycle import command_owns_the_process, die_with_launcher

die_with_launcher()  # first of all: a launcher killed while this rank starts must not leave it running

from finetune.config import DESCRIPTION, FinetuneConfig  # noqa: E402
from vit_mpp.models.export_folder import check_checkpoint_path  # noqa: E402
from vit_mpp.processes.exits import one_line_errors  # noqa: E402
from vit_mpp.run.start.entry import check_data_locations, read_run_config  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    cfg = read_run_config(FinetuneConfig, argv, prog="finetune", description=DESCRIPTION)
    check_checkpoint_path(cfg.init.checkpoint)  # before the data, as the run itself does
    check_data_locations(cfg)
    from finetune.train import train  # the heavy imports (torch, timm, accelerate), once the config is known good

    train(cfg)


if __name__ == "__main__":
    command_owns_the_process()  # Ctrl-C during the imports: one line (vit_mpp/processes/rank_lifecycle.py)
    with one_line_errors():  # a user error is one line and exit 2, a preemption 75 (vit_mpp/processes/exits.py)
        main()

"""`python -m finetune` / `accelerate launch finetune` / `accelerate launch -m finetune`: see finetune/train.py.

The config is read and checked before torch is imported, so a bad config fails in a fraction of a second.
"""

from finetune.config import DESCRIPTION, FinetuneConfig
from vit_mpp.cli import run_main
from vit_mpp.config import parse_args


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(FinetuneConfig, argv, prog="finetune", description=DESCRIPTION)
    from finetune.train import train  # the heavy imports (torch, timm, accelerate), once the config is known good

    train(cfg)


if __name__ == "__main__":
    run_main(main)

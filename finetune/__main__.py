"""`python -m finetune` / `accelerate launch finetune` / `accelerate launch -m finetune`: see finetune/train.py."""

from common.cli import run_main
from finetune.train import main

if __name__ == "__main__":
    run_main(main)

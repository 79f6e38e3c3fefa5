"""`python -m pretrain` / `accelerate launch pretrain` / `accelerate launch -m pretrain`: see pretrain/train.py."""

from common.cli import run_main
from pretrain.train import main

if __name__ == "__main__":
    run_main(main)

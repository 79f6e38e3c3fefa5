"""Masked patch prediction pretraining: `accelerate launch pretrain --config configs/pretrain/<name>.yaml`."""

from vit_mpp.launcher import die_with_launcher

die_with_launcher()  # `-m pretrain` under a launcher: before anything heavy

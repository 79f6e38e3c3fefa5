"""Masked patch prediction pretraining: `accelerate launch pretrain --config configs/pretrain/<name>.yaml`."""

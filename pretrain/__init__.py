"""Masked patch prediction pretraining: `accelerate launch pretrain --config configs/pretrain/<name>.yaml`. The
stage (train.py) and its config (config.py), the targets (targets.py), corruption, head and loss (mpp.py), the
validation (validation.py) with its k-NN monitor (knn.py) and probes (probes.py)."""

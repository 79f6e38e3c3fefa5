"""Fine-tuning a pretrained ViT encoder: `accelerate launch finetune --config configs/finetune/<name>.yaml`."""

from vit_mpp.launcher import die_with_launcher

die_with_launcher()  # `-m finetune.evaluate` under a launcher: before its heavy imports

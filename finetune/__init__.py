"""Fine-tuning a pretrained ViT encoder: `accelerate launch finetune --config configs/finetune/<name>.yaml`."""

"""Fine-tuning a pretrained ViT encoder: `accelerate launch finetune --config configs/finetune/<name>.yaml`. The stage
(train.py) and its config (config.py); the classifier it starts from (init_model.py) and its classes (classes.py);
the loss (loss.py) with the device's and the workers' augmentations (augment.py); semi-supervised fine-tuning's loss
(semi.py), which pool images pass (thresholds.py) and whether the pool trains yet (pool_gate.py); the EMA (ema.py),
the probes' modes (modes.py), keeping the best model (keep_best.py), scoring (scoring.py) and the exports
(classifier_export.py); an export on a split (evaluate.py) and on images (predict.py)."""

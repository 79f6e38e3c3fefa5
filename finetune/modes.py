"""Training modes: full fine-tuning, or a linear probe (frozen encoder, only the classifier head trains).

The linear probe is kept deliberately plain: the [class] token after the encoder's final LayerNorm (timm's
`forward_head` input) feeds the zero-initialised linear head; there is no extra BatchNorm (MAE adds one) and the
encoder runs in eval mode, so dropout and stochastic depth are off and its features do not change during training.
"""

from __future__ import annotations

from timm.models.vision_transformer import VisionTransformer

HEAD_PREFIX = "head."


def freeze_encoder(model: VisionTransformer) -> None:
    """Stop gradients everywhere but the head (timm's parameter groups then leave the frozen weights out)."""
    for name, param in model.named_parameters():
        param.requires_grad = name.startswith(HEAD_PREFIX)


def set_train_mode(model: VisionTransformer, mode: str) -> None:
    """`model.train()` for fine-tuning; for a linear probe the encoder stays in eval mode and only the head trains."""
    if mode == "linear_probe":
        model.eval()
        model.head.train()
    else:
        model.train()

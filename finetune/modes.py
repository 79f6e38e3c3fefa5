"""Training modes: full fine-tuning, a linear probe or an attentive probe (a frozen encoder; only the head trains,
and for the attentive probe the attention pool before it).

The linear probe is kept deliberately plain: the [class] token after the encoder's final LayerNorm (timm's
`forward_head` input) feeds the zero-initialised linear head; there is no extra BatchNorm (MAE adds one) and the
encoder runs in eval mode, so dropout and stochastic depth are off and its features do not change during training.

The attentive probe reads every token instead, through timm's attention pool (`model.global_pool=map`, which the mode
sets: finetune/config.py): one learned query, one cross-attention block with its MLP, then the linear head:
V-JEPA's attentive probe (arXiv 2404.08471), which tracks fine-tuning on masked-image-modelling features where a
linear probe and k-NN do not (docs/finetune.md).
"""

from __future__ import annotations

from timm.models.vision_transformer import VisionTransformer

PROBES = ("linear_probe", "attentive_probe")
TRAINED_IN_A_PROBE = ("head.", "attn_pool.")  # the classifier's own modules; the encoder is frozen


def freeze_encoder(model: VisionTransformer) -> None:
    """Stop gradients everywhere but the head and its pool (timm's parameter groups then leave the frozen weights
    out)."""
    for name, param in model.named_parameters():
        param.requires_grad = name.startswith(TRAINED_IN_A_PROBE)


def set_train_mode(model: VisionTransformer, mode: str) -> None:
    """`model.train()` for fine-tuning; for a probe the encoder stays in eval mode and only the head (and its pool)
    trains."""
    if mode in PROBES:
        model.eval()
        for trained in (model.head, model.attn_pool):
            if trained is not None:
                trained.train()
    else:
        model.train()

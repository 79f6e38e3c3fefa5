"""The classifier fine-tuning starts from: a pretrained encoder (or random init), resized, with a zero head."""

from __future__ import annotations

import dataclasses

from timm.models.vision_transformer import VisionTransformer

from common.config import ConfigError, ModelConfig
from common.models import ARCH_KEYS, create_encoder, norm_stats
from finetune.checkpoints import checkpoint_kind, export_grid, read_export, read_npz, read_state_dict, state_dict_grid
from finetune.config import InitConfig
from finetune.surgery import attach_zero_head, load_encoder_weights


def build_classifier(init: InitConfig, model_cfg: ModelConfig, num_classes: int,
                     ) -> tuple[VisionTransformer, tuple[float, ...], tuple[float, ...], ModelConfig]:
    """(model, mean, std, resolved model config).

    An export's recorded architecture wins over `model_cfg`'s (its `img_size` and training settings are kept);
    timm and npz checkpoints are loaded into the architecture `model_cfg` names. The encoder's pretraining head is
    dropped, the position embeddings are resized to `model_cfg.img_size`, and a zero D x K head is attached.
    """
    if not init.checkpoint:  # from scratch
        model = create_encoder(model_cfg)
        attach_zero_head(model, num_classes)
        mean, std = _chosen_stats(init, *norm_stats(model))
        return model, mean, std, model_cfg
    detected = checkpoint_kind(init.checkpoint)  # also fails clearly when the path does not exist
    kind = detected if init.kind == "auto" else init.kind
    meta = None
    if kind == "export":
        state, meta = read_export(init.checkpoint)
        model_cfg = dataclasses.replace(model_cfg, **{k: meta["model"][k] for k in ARCH_KEYS if k in meta["model"]})
        model = create_encoder(model_cfg)
        old_grid = export_grid(meta, state)
    elif kind == "npz":
        state, old_grid = read_npz(init.checkpoint, model_cfg, init.grid)
        model = create_encoder(model_cfg)
    else:
        state = read_state_dict(init.checkpoint)
        model = create_encoder(model_cfg)
        old_grid = state_dict_grid(state, model, init.grid)
    load_encoder_weights(model, state, old_grid, init.posemb_interp)
    attach_zero_head(model, num_classes)
    mean, std = norm_stats(model)
    if meta is not None:  # the normalisation the encoder was pretrained with
        mean, std = tuple(meta.get("mean", mean)), tuple(meta.get("std", std))
    mean, std = _chosen_stats(init, mean, std)
    return model, mean, std, model_cfg


def _chosen_stats(init: InitConfig, mean: tuple[float, ...], std: tuple[float, ...],
                  ) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """`init.mean` / `init.std` when given (checked: three values, std > 0), else the defaults passed in."""
    for name, values in (("mean", init.mean), ("std", init.std)):
        if values is not None and (len(values) != 3 or (name == "std" and min(values) <= 0)):
            raise ConfigError(f"init.{name} must be three numbers [r, g, b]{' > 0' if name == 'std' else ''}, "
                              f"got {values}")
    return (tuple(init.mean) if init.mean is not None else mean), (tuple(init.std) if init.std is not None else std)

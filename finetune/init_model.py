"""The classifier fine-tuning starts from: a pretrained encoder (or a random one), resized, with a zero head.

The fine-tuning rule of the ViT paper: drop the pretraining head, attach a D x K linear layer initialised to zero
(weights and bias; timm's `reset_classifier` does not zero it), keep the patch size and resize the position
embeddings to the new resolution (vit_mpp/models/pretrained.py).
"""

from __future__ import annotations

import torch
from timm.models.vision_transformer import VisionTransformer

from finetune.config import InitConfig
from finetune.modes import freeze_encoder
from vit_mpp.config.engine import ConfigError, given_keys, replaced
from vit_mpp.config.sections import ARCH_KEYS, ModelConfig
from vit_mpp.models.export import read_export_head
from vit_mpp.models.pretrained import (
    LOCAL_DIR,
    build_model,
    checkpoint_kind,
    describe_checkpoint,
    look_at_weights_file,
    read_pretrained,
)
from vit_mpp.models.vit import architecture, create_vit, norm_stats


def attach_zero_head(model: VisionTransformer, num_classes: int) -> None:
    """Replace the classifier by a D x K linear layer with zero weight and bias."""
    model.reset_classifier(num_classes)
    torch.nn.init.zeros_(model.head.weight)
    torch.nn.init.zeros_(model.head.bias)


def build_classifier(init: InitConfig, model_cfg: ModelConfig, num_classes: int, freeze: bool = False,
                     ) -> tuple[VisionTransformer, tuple[float, ...], tuple[float, ...], ModelConfig]:
    """(model, mean, std, resolved model config); with `freeze` (a linear probe) only the head keeps gradients, so
    the optimizer's parameter groups hold the head only.

    A checkpoint that names its architecture (an export, a hub model) fixes the architecture keys of `model_cfg`;
    an architecture key set in `model_cfg` that differs from it is an error. `img_size`, `global_pool` and the
    training settings stay `model_cfg`'s. timm and npz checkpoints are loaded into the architecture `model_cfg` names.
    """
    mean = std = None
    if init.checkpoint:
        pre = read_pretrained(init.checkpoint, model_cfg, init.kind, init.grid)
        if pre.model is not None:
            model_cfg = _with_architecture(model_cfg, pre.model)
        if init.keep_head:  # its classes were checked against the data's before the run started (check_kept_head)
            model = build_model(model_cfg, pre, num_classes, keep_head=True, interp=init.posemb_interp)
        else:  # headless: attach_zero_head adds it
            model = build_model(model_cfg, pre, interp=init.posemb_interp)
        mean, std = pre.mean, pre.std
    else:  # from scratch
        model = create_vit(model_cfg)
    if not init.keep_head:
        attach_zero_head(model, num_classes)
    if freeze:
        freeze_encoder(model)
    default_mean, default_std = norm_stats(model)
    mean, std = _chosen_stats(init, mean or default_mean, std or default_std)
    return model, mean, std, model_cfg


def check_kept_head(init: InitConfig, model_cfg: ModelConfig, num_classes: int, names: list[str] | None) -> None:
    """With `init.keep_head`, the checkpoint must be a classifier export of this run's classes (their number, and
    their names where both say) that pools its tokens as this run does; else one line, before the run starts."""
    if not init.keep_head:
        return
    if checkpoint_kind(init.checkpoint) != "export" or init.kind not in ("auto", "export"):
        raise ConfigError(f"init.keep_head keeps the classifier of a fine-tuned export, and init.checkpoint "
                          f"{init.checkpoint} is not an export folder: give a finetune run's export, or leave "
                          "init.keep_head out for a zero head")
    has, their_names, model = read_export_head(init.checkpoint.removeprefix(LOCAL_DIR))
    if not has:
        raise ConfigError(f"init.keep_head: {init.checkpoint} has no classifier head (an encoder export): leave "
                          "init.keep_head out, and the classifier starts from a zero head")
    if has != num_classes or (names and their_names and list(names) != list(their_names)):
        theirs = f"{has} classes" + (f" ({', '.join(their_names[:5])}{', ...' if has > 5 else ''})"
                                     if their_names else "")
        raise ConfigError(f"init.keep_head: the head of {init.checkpoint} has {theirs}, this run's data "
                          f"{num_classes}" + (f" ({', '.join(names[:5])}{', ...' if num_classes > 5 else ''})"
                                              if names else "")
                          + ": a kept head must name the same classes; leave init.keep_head out for a zero head")
    if model.global_pool != model_cfg.global_pool:
        raise ConfigError(f"init.keep_head: the head of {init.checkpoint} reads model.global_pool={model.global_pool}, "
                          f"this run's is {model_cfg.global_pool}: set model.global_pool={model.global_pool}")


def resolve_architecture(init: InitConfig, model_cfg: ModelConfig) -> ModelConfig:
    """`model_cfg` with the architecture `init.checkpoint` names (an export, a Hub model: read from its config, not
    its weights), so that the run's config.yaml records the model it trains; `model_cfg` itself when the checkpoint
    names none (timm and npz weights, whose file is looked at now: vit_mpp.models.pretrained.look_at_weights_file) or
    there is none. Called before a run writes anything: an architecture key the user set that differs from the
    checkpoint's is a ConfigError. `build_classifier` checks the same on the weights it loads."""
    if init.checkpoint:
        look_at_weights_file(init.checkpoint, init.kind)
        named, _ = describe_checkpoint(init.checkpoint, init.kind)
        if named is not None:
            return _with_architecture(model_cfg, named)
    return model_cfg


def _with_architecture(asked: ModelConfig, checkpoint: ModelConfig) -> ModelConfig:
    """`asked` with the checkpoint's architecture keys (those it sets), after checking that none the user set
    differs."""
    _check_same_architecture(asked, checkpoint)
    fixed = {k: getattr(checkpoint, k) for k in ARCH_KEYS if getattr(checkpoint, k) is not None}
    return replaced(asked, **fixed)


def _check_same_architecture(asked: ModelConfig, checkpoint: ModelConfig) -> None:
    """An architecture key set in the fine-tuning config must agree with the checkpoint's (it cannot change). The
    sizes default to null, so a size that is set was asked for; `model.name` has a default, so it counts only when
    the user wrote it (vit_mpp.config.engine.given_keys): otherwise a fine-tuning of a ViT-Tiny export with
    `model.name=vit_base_patch16_224` would train the tiny model under the base model's name."""
    given = {k: getattr(asked, k) for k in ARCH_KEYS
             if getattr(asked, k) is not None and (k != "name" or k in given_keys(asked))}
    if not given:
        return
    actual = architecture(checkpoint)
    differ = [f"model.{k}={v} (the checkpoint's is {_shown(actual[k])})" for k, v in given.items()
              if (v.split(".")[0] != actual[k].split(".")[0] if k == "name" else v != actual[k])]
    if differ:
        raise ConfigError(f"the checkpoint fixes the architecture, which cannot change in fine-tuning: "
                          f"{', '.join(differ)}; remove these keys or use another checkpoint")


def _shown(value: object) -> str:
    return f"{value:g}" if isinstance(value, (int, float)) else str(value)


def _chosen_stats(init: InitConfig, mean: tuple[float, ...], std: tuple[float, ...],
                  ) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """`init.mean` / `init.std` when given, else the defaults passed in."""
    return (tuple(init.mean) if init.mean is not None else tuple(mean)), \
        (tuple(init.std) if init.std is not None else tuple(std))

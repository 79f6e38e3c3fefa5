"""FSDP as an Accelerate config asks for it (`accelerate launch --config_file configs/accelerate/fsdp_vit_large.yaml`):
the settings its launcher passes to every rank in the environment (`FsdpSettings.read`), and the run settings that
cannot go with them, refused in one line before anything is written (`check_fsdp`). A DeepSpeed launch is refused
the same way (`refuse_deepspeed`): Accelerate's DeepSpeed integration needs transformers, and the run's checkpoints,
resume and exports are made for data parallel and FSDP2. The project shards the model itself
(vit_mpp/run/start/sharding.py), the same way on CPU processes and GPUs: docs/cluster.md#sharding-fsdp.
Torch-free: the entry points ask before torch is imported.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any

from vit_mpp.config.engine import ConfigError

USE_FSDP = "ACCELERATE_USE_FSDP"
USE_DEEPSPEED = "ACCELERATE_USE_DEEPSPEED"  # `accelerate launch --use_deepspeed`, or a DeepSpeed accelerate config
WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "NO_WRAP")
DEEPSPEED_REFUSED = ("the accelerate config asks for DeepSpeed, which this tool does not run (Accelerate's DeepSpeed "
                     "integration needs transformers, and the run's checkpoints, resume and exports are made for data "
                     "parallel and FSDP2): to shard the model, launch with configs/accelerate/fsdp_vit_large.yaml "
                     "(docs/cluster.md#sharding-fsdp)")


# semi.pool's teacher is the model's EMA, which is not kept when FSDP shards the model: whichever check meets the two
# first (the pool's own when train.ema_decay=0, the launch's when it is > 0) says this, so neither sends the user to
# the other.
SEMI_POOL_REFUSED = ("needs the model's EMA (train.ema_decay > 0) as its teacher, and an EMA is not kept under FSDP "
                     "(it needs the whole model on every process, and FSDP shards it): fine-tune with the pool without "
                     "the FSDP accelerate config, or without semi.pool")


def fsdp_launch(env: MutableMapping[str, str] = os.environ) -> bool:
    """Whether the launch config asks for FSDP."""
    return _flag(env, USE_FSDP)


def refuse_deepspeed(env: MutableMapping[str, str] = os.environ) -> None:
    """A ConfigError when the launch config asks for DeepSpeed (`DEEPSPEED_REFUSED`)."""
    if _flag(env, USE_DEEPSPEED):
        raise ConfigError(DEEPSPEED_REFUSED)


def _flag(env: MutableMapping[str, str], name: str, default: bool = False) -> bool:
    return env.get(name, str(default)).strip().lower() in ("1", "true", "yes")


@dataclass(frozen=True)
class FsdpSettings:
    """What the launch config asks of FSDP: each module of a class in `units` sharded as one unit (timm's `Block`),
    the root the rest; a unit's parameters freed after its forward (`reshard_after_forward`) or kept for the
    backward; activations recomputed in the backward (`activation_checkpointing`)."""

    version: int = 2
    units: tuple[str, ...] = ("Block",)
    reshard_after_forward: bool = True
    activation_checkpointing: bool = False
    offload_params: bool = False
    wrap_policy: str = "TRANSFORMER_BASED_WRAP"

    @classmethod
    def read(cls, env: MutableMapping[str, str] = os.environ) -> FsdpSettings | None:
        """The settings Accelerate's launcher put in `env` (None: the launch config does not ask for FSDP)."""
        if not _flag(env, USE_FSDP):
            return None
        policy = env.get("FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP").strip().upper() or "TRANSFORMER_BASED_WRAP"
        units = tuple(u.strip() for u in env.get("FSDP_TRANSFORMER_CLS_TO_WRAP", "Block").split(",") if u.strip())
        return cls(version=int(env.get("FSDP_VERSION", "1") or 1),
                   units=units if policy == "TRANSFORMER_BASED_WRAP" else (),
                   reshard_after_forward=_flag(env, "FSDP_RESHARD_AFTER_FORWARD", True),
                   activation_checkpointing=_flag(env, "FSDP_ACTIVATION_CHECKPOINTING"),
                   offload_params=_flag(env, "FSDP_OFFLOAD_PARAMS"),
                   wrap_policy=policy)

    def describe(self) -> str:
        units = f"each {' or '.join(self.units)} a unit" if self.units else "the whole model one unit"
        return f"{units}, {'freed' if self.reshard_after_forward else 'kept'} after its forward"


@contextlib.contextmanager
def accelerate_fsdp_off(env: MutableMapping[str, str] = os.environ) -> Iterator[None]:
    """The launcher's FSDP switch out of `env` while Accelerate's state is made: Accelerate would otherwise shard on
    GPUs its own way (and on CPU processes not at all); a run shards the same way on both
    (vit_mpp/run/start/sharding.py), from `FsdpSettings.read`."""
    switch = env.pop(USE_FSDP, None)
    try:
        yield
    finally:
        if switch is not None:
            env[USE_FSDP] = switch


def check_ema(cfg: Any) -> None:
    """Refuse a model EMA, and the pool whose teacher it is, under FSDP."""
    semi = getattr(cfg, "semi", None)
    if semi is not None and semi.pool_sets():
        raise ConfigError(f"config key 'semi.pool' {SEMI_POOL_REFUSED}")  # as the pool's own check words it
    if getattr(cfg.train, "ema_decay", 0.0) > 0:
        raise ConfigError(f"train.ema_decay={cfg.train.ema_decay:g} needs the whole model on every process, and FSDP "
                          "shards it; set train.ema_decay=0, or fine-tune without the FSDP accelerate config")


def check_fsdp(cfg: Any, env: MutableMapping[str, str] = os.environ) -> None:
    """Raise a ConfigError when the launch config asks for FSDP (`env`) with a setting that cannot go with it, or
    for DeepSpeed (`refuse_deepspeed`)."""
    refuse_deepspeed(env)
    settings = FsdpSettings.read(env)
    if settings is None:
        return
    if settings.version != 2:
        raise ConfigError(f"the accelerate config asks for FSDP version {settings.version}; this tool shards with "
                          "FSDP2 (torch's fully_shard): set fsdp_version: 2 in its fsdp_config "
                          "(configs/accelerate/fsdp_vit_large.yaml)")
    if settings.wrap_policy not in WRAP_POLICIES:
        raise ConfigError(f"fsdp_auto_wrap_policy: {settings.wrap_policy} is not supported: use TRANSFORMER_BASED_WRAP "
                          "with fsdp_transformer_layer_cls_to_wrap: Block (each timm block one unit), or NO_WRAP")
    if settings.offload_params:
        raise ConfigError("fsdp_offload_params: true (parameters and optimizer state in host memory) is not supported "
                          "yet; set it to false, and shard over more processes or use model.grad_checkpointing=true")
    tc = cfg.train
    if tc.mixed_precision == "fp16":
        raise ConfigError("train.mixed_precision=fp16 does not go with FSDP here (its loss scaler would have to see "
                          "every shard's gradients); use train.mixed_precision=bf16 (bf16 parameters, fp32 reduction)")
    check_ema(cfg)
    if tc.fp8:
        raise ConfigError("train.fp8=true has not been verified with FSDP; use train.fp8=false with the FSDP config "
                          "(train.mixed_precision=bf16 is its fast path)")

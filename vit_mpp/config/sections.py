"""The config sections both stages share (model, data, optimizer, export, run): every key a user can set, with its
default, help and check. The engine that reads them (YAML, overrides, coercion) is vit_mpp/config/engine.py."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator
from typing import Literal

from vit_mpp.config.engine import NOT_EMPTY, Check, ConfigError, above, at_least, between, items, opt

READ_TIMEOUT_S = 60.0  # no byte for this long: a read is stalled (data.read_timeout_s; every reader's default)
READ_RETRIES = 3  # a failed or stalled read is retried this many times, after 1 s, then twice that, ...

ARCH_KEYS = ("name", "patch_size", "embed_dim", "depth", "num_heads", "mlp_ratio")  # what a checkpoint fixes
# The experiment trackers Accelerate integrates (accelerate.tracking); each needs its own package installed.
PREEMPT_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP")
TRACKERS = ("tensorboard", "wandb", "comet_ml", "aim", "mlflow", "clearml", "dvclive", "swanlab", "trackio")


@dataclasses.dataclass
class ModelConfig:
    """Which timm VisionTransformer to build; `None` keeps the value of the timm model named."""

    name: str = opt("vit_tiny_patch16_224", "any timm VisionTransformer name (vit_tiny/small/base/large/huge_...)")
    img_size: int | list[int] = opt(224, "input size: an int or [height, width], divisible by the patch size",
                                    Check(lambda v: (v > 0) if isinstance(v, int) else (len(v) == 2 and min(v) > 0),
                                          "a positive int or [height, width] of positive ints"))
    patch_size: int | None = opt(None, "patch size P (default: the named model's)", at_least(1))
    embed_dim: int | None = opt(None, "width D (custom sizes; default: the named model's)", at_least(1))
    depth: int | None = opt(None, "number of blocks L (default: the named model's)", at_least(1))
    num_heads: int | None = opt(None, "attention heads (default: the named model's)", at_least(1))
    mlp_ratio: float | None = opt(None, "MLP hidden size / D (default: the named model's, 4 for ViT)", above(0))
    global_pool: Literal["token", "avg", "map"] = opt(
        "token", "what the classifier head reads (fine-tuning): token (the [class] token, as in the paper), avg (mean "
                 "of the patch tokens) or map (every token through timm's attention pool: one learned query)")
    drop_path_rate: float = opt(0.0, "stochastic depth rate", between(0, 1, hi_open=True))
    grad_checkpointing: bool = opt(False, "recompute block activations in the backward pass (saves memory)")

    def problems(self) -> Iterator[tuple[str, str]]:
        """Rules across fields; sizes left to the named model are checked when the model is built."""
        sizes = [self.img_size] * 2 if isinstance(self.img_size, int) else list(self.img_size)
        if self.patch_size and any(s % self.patch_size for s in sizes):
            yield "img_size", f"{self.img_size} must be divisible by model.patch_size={self.patch_size}"
        if self.embed_dim and self.num_heads and self.embed_dim % self.num_heads:
            yield "embed_dim", f"{self.embed_dim} must be divisible by model.num_heads={self.num_heads}"


def shard_list_problem(value: str | list[str]) -> str | None:
    """What is wrong with a list of shard-set locations (data.shards, finetune's semi.pool): an empty location, or a
    set named twice; None for a plain location."""
    if not isinstance(value, list):
        return None
    locations = [str(x) for x in value]
    if not all(x.strip() for x in locations):
        return f"holds an empty location: {value!r}"
    if len(set(locations)) != len(locations):
        return f"names a set twice: {value!r}"
    return None


def img_hw(img_size: int | list[int] | tuple[int, ...]) -> tuple[int, int]:
    """(height, width) from an int or a [height, width] pair."""
    if isinstance(img_size, int):
        return img_size, img_size
    if len(img_size) != 2:
        raise ConfigError(f"model.img_size must be an int or [height, width], got {list(img_size)}")
    return int(img_size[0]), int(img_size[1])


@dataclasses.dataclass
class DataConfig:
    """Where the shards are and how they are streamed (see vit_mpp/data/stream.py)."""

    shards: str | list[str] = opt("", "the shard set to train on: a folder or URL holding the shards and their "
                                      "_info.json (build-shards, or `build-shards index` for shards others wrote), "
                                      "or the manifest file itself; a list of them trains on their mixture")
    weights: list[float] | None = opt(None, "mixture weights, one per data.shards entry, in any unit (default: "
                                            "proportional to each set's size)", Check(
        lambda v: all(w >= 0 for w in v) and any(w > 0 for w in v) and math.isfinite(sum(v)),
        "non-negative numbers, at least one above 0, with a finite sum"))
    train_split: str = opt("train", "split used for training (in every set)")
    val_split: str = opt("val", "split used for evaluation ('' for none)")
    val_shards: str = opt("", "the shard set evaluation reads ('' = the first of data.shards)")
    num_workers: int = opt(2, "data-loader worker processes per training process", at_least(0))
    prefetch_factor: int = opt(2, "batches prefetched per worker", at_least(1))
    pin_memory: bool = opt(True, "pin host memory (CUDA only)")
    persistent_workers: bool = opt(True, "keep workers alive between epochs")
    shuffle_buffer: int = opt(1000, "per-worker shuffle buffer of encoded samples (0 or 1: no shuffle buffer)",
                              at_least(0))
    crop_scale: list[float] = opt([0.35, 1.0], "RandomResizedCrop area range [min, max] for training",
                                  items(between(0, 1, lo_open=True), 2))
    hflip: bool = opt(True, "random horizontal flips for training")
    eval_crop_pct: float = opt(0.875, "evaluation: resize to size / crop_pct, then center-crop",
                               between(0, 1, lo_open=True))
    max_bad_fraction: float = opt(0.01, "stop when more than this fraction of samples cannot be decoded",
                                  between(0, 1))
    read_timeout_s: float = opt(READ_TIMEOUT_S, "shards (local or remote): a read that brings no byte for this "
                                "long is a stall; the stream is aborted and reopened", above(0))
    read_retries: int = opt(READ_RETRIES, "shards: reopen a stalled stream (local or remote) or a broken remote "
                            "one this many times (backoff 1, 2, 4 s ...), then stop with an error", at_least(0))
    decode: Literal["cpu", "gpu"] = opt("cpu", "where training JPEGs are decoded: cpu (in the loader workers) or gpu "
                                        "(batched on the CUDA device with nvJPEG, crops and flips there too; the "
                                        "workers only read bytes)")

    def problems(self) -> Iterator[tuple[str, str]]:
        if self.crop_scale[0] > self.crop_scale[1]:
            yield "crop_scale", f"must be [min, max] with min <= max, got {self.crop_scale}"
        locations = self.shard_sets()
        if isinstance(self.shards, list) and not self.shards:
            yield "shards", "is an empty list: name at least one shard set"
        elif problem := shard_list_problem(self.shards):
            yield "shards", problem
        if self.weights is not None and len(self.weights) != len(locations):
            yield "weights", (f"gives {len(self.weights)} weight(s) for the {len(locations)} set(s) of data.shards: "
                              "one per set")
        # A share below a double's resolution is no share: the set is never drawn, and an epoch (a pass over the set
        # that runs out first) would be infinitely long
        tiny = [w for w in self.weights or () if 0 < w < math.fsum(self.weights) * 2.0**-53]
        if tiny:
            yield "weights", (f"gives {tiny[0]!r} against a sum of {math.fsum(self.weights)!r}: a share too small "
                              "to draw a sample from (below 1 in 2**53); give 0 to leave a set out")

    def shard_sets(self) -> list[str]:
        """The shard-set locations, as a list (one for a plain data.shards)."""
        return [str(x) for x in self.shards] if isinstance(self.shards, list) else [self.shards]


@dataclasses.dataclass
class OptimConfig:
    """Optimizer and learning-rate schedule; peak lr = `lr`, or base_lr * batch_size / base_batch_size (linear)."""

    name: Literal["adamw", "adam", "sgd"] = opt("adamw", "optimizer")
    lr: float | None = opt(None, "peak learning rate, used as is (null: base_lr scaled to train.batch_size)",
                           above(0))
    base_lr: float = opt(2e-4, "learning rate at base_batch_size", above(0))
    base_batch_size: int = opt(4096, "batch size at which base_lr applies", at_least(1))
    weight_decay: float = opt(0.0, "decoupled weight decay (not applied to biases, norms, embeddings, tokens)",
                              at_least(0))
    betas: list[float] = opt([0.9, 0.999], "Adam betas", items(between(0, 1, hi_open=True), 2))
    momentum: float = opt(0.9, "SGD momentum", between(0, 1, hi_open=True))
    warmup_steps: int = opt(10000, "linear warmup steps", at_least(0))
    warmup_max_fraction: float = opt(0.1, "warmup is capped at this fraction of the run, so short runs decay too",
                                     between(0, 1))
    min_lr_ratio: float = opt(0.0, "cosine decays to the peak learning rate x this ratio", between(0, 1))
    clip_grad_norm: float = opt(1.0, "clip gradients at this global norm (0 disables)", at_least(0))
    impl: Literal["auto", "fused", "foreach", "single"] = opt("auto", "optimizer kernel (auto: fused on CUDA)")

    def problems(self) -> Iterator[tuple[str, str]]:
        if self.name == "adam" and self.weight_decay:
            yield "weight_decay", "must be 0 with optim.name=adam (it would be L2 in the gradient); use adamw"


@dataclasses.dataclass
class ExportConfig:
    """What happens to the final export besides being written (a model card is always written beside it)."""

    push_to_hub: str = opt("", "Hugging Face Hub repo OWNER/NAME to upload the final export to, with its model card "
                               "and figures ('' = none); access is checked before training starts",
                           Check(lambda v: v == "" or bool(re.fullmatch(r"[\w.-]+/[\w.-]+", v)),
                                 "'' or a repo id OWNER/NAME"))
    private: bool = opt(True, "create the Hub repo as private")
    license: str = opt("", "licence named in the model card, e.g. apache-2.0 ('' = none given)")


@dataclasses.dataclass
class TrainConfig:
    """Run-level settings common to both stages."""

    run_dir: str = opt("runs/run", "run directory (config, metrics, checkpoints); re-running it resumes",
                       NOT_EMPTY)
    seed: int = opt(0, "random seed", between(0, 2**32 - 1))
    batch_size: int = opt(4096, "global batch size (all processes, after accumulation)", at_least(1))
    micro_batch_size: int | None = opt(None, "per-device batch per forward (default: batch_size / processes)",
                                       at_least(1))
    mixed_precision: Literal["no", "bf16", "fp16"] = opt("no", "mixed precision")
    compile: bool = opt(False, "torch.compile the model")
    fp8: bool = opt(False, "FP8 matmuls through torchao's float8 training (a GPU of compute capability 8.9+ and "
                           "torchao: pip install 'vit-mpp[fp8]'); the linear layers whose sizes divide by 16")
    fp8_recipe: Literal["tensorwise", "rowwise"] = opt("tensorwise", "torchao's float8 scaling with train.fp8: one "
                                                       "scale per tensor (faster) or per row (closer to bf16)")
    peak_tflops: float = opt(0.0, "peak TFLOP/s of one device at the run's precision, for the MFU the progress line "
                                  "and metrics.jsonl show (0: from a table of common GPUs; none on a CPU)", at_least(0))
    log_every: int = opt(10, "log every N optimizer steps", at_least(1))
    ckpt_every: int = opt(500, "save the full training state every N optimizer steps", at_least(1))
    ckpt_every_minutes: float = opt(0.0, "also save it when this many minutes have passed since the last one (0: "
                                         "off); every rank takes the same decision", at_least(0))
    keep_last: int = opt(2, "checkpoints to keep", at_least(1))
    trackers: list[str] = opt([], "experiment trackers (Accelerate's): " + ", ".join(TRACKERS), Check(
        lambda v: all(t in TRACKERS for t in v), "a list of tracker names from: " + ", ".join(TRACKERS)))
    project: str = opt("vit-mpp", "tracker project (W&B/MLflow); TensorBoard writes to run_dir/logs/<project>/",
                       NOT_EMPTY)
    run_name: str = opt("", "the run's name in the trackers ('' = the run directory's path)")
    resume: Literal["auto", "never", "must"] = opt(
        "auto", "auto: continue the run in train.run_dir if it holds one, else start; never: refuse a run dir that "
                "holds a run; must: refuse one that holds none")
    extend: bool = opt(False, "allow a finished run to continue to a larger train.steps / train.epochs (the learning "
                              "rate then follows the schedule of the new length from where the run stopped)")
    record_samples: bool = opt(False, "sample audit: each rank appends one line per optimizer step to "
                                      "run_dir/samples/rank_<R>.jsonl listing the keys of every sample it used")
    preempt_signals: list[str] = opt(["SIGTERM", "SIGUSR1", "SIGINT"], "signals that preempt the run: all ranks save "
                                     "a checkpoint at the next step and exit with status 75",
                                     Check(lambda v: all(x in PREEMPT_SIGNALS for x in v),
                                           "a list of signal names from: " + ", ".join(PREEMPT_SIGNALS)))
    collective_timeout_s: float = opt(600.0, "how long a rank waits in a collective for a peer before giving up "
                                             "(a dead peer must not hold the run for NCCL's 30 minutes)", above(0))

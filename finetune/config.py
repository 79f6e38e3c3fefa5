"""The fine-tuning config: which encoder to start from, model input size, data, optimizer (the paper's SGD), run."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar, Literal

from vit_mpp.config.engine import Check, above, at_least, between, given_keys, items, opt, replaced, section
from vit_mpp.config.fsdp_settings import SEMI_POOL_REFUSED, fsdp_launch
from vit_mpp.config.sections import (
    ARCH_KEYS,
    DataConfig,
    ExportConfig,
    ModelConfig,
    OptimConfig,
    TrainConfig,
    shard_list_problem,
)
from vit_mpp.data.labels import MAX_CLASSES

DESCRIPTION = "Fine-tuning a ViT encoder into a classifier (the paper's rule: zero head, resized position embeddings)."


@dataclass
class InitConfig:
    checkpoint: str = opt("", "encoder to start from: a pretrain/fine-tune export (folder, .safetensors or "
                              "local-dir:PATH), hf-hub:NAME or a timm pretrained name, a timm "
                              "state dict (.safetensors, .pth, .bin), or an original ViT .npz; '' = from scratch")
    kind: Literal["auto", "export", "hub", "timm", "npz"] = opt(
        "auto", "checkpoint format (auto: an export folder or its weights = export, hf-hub:/timm names = hub, "
                ".npz = npz, else timm)")
    grid: list[int] | None = opt(None, "the checkpoint's patch grid [rows, cols] for timm/npz checkpoints "
                                       "(default: inferred from pos_embed, assumed square)", items(at_least(1), 2))
    posemb_interp: Literal["bilinear", "bicubic"] = opt("bilinear", "position-embedding resize (paper: bilinear)")
    keep_head: bool = opt(False, "keep the checkpoint's classifier (a fine-tuned export of this run's classes, its "
                                 "head and pooling) instead of a zero head: a second fine-tuning that goes on from the "
                                 "first, as Semi-ViT's semi-supervised stage starts from its supervised one")
    mean: list[float] | None = opt(None, "input normalisation mean [r, g, b] the checkpoint was trained with "
                                         "(default: the export's, else the timm model's)", items(between(0, 1), 3))
    std: list[float] | None = opt(None, "input normalisation std [r, g, b] (default: as for mean)",
                                  items(above(0), 3))


@dataclass
class FinetuneOptimConfig(OptimConfig):
    name: Literal["adamw", "adam", "sgd"] = opt("sgd", "optimizer (paper: SGD with momentum 0.9)")
    base_lr: float = opt(0.01, "learning rate at base_batch_size (paper: one of 0.001, 0.003, 0.01, 0.03)")
    base_batch_size: int = opt(512, "batch size at which base_lr applies (paper: 512)")
    warmup_steps: int = opt(500, "linear warmup steps")
    layer_decay: float | None = opt(None, "layer-wise LR decay (e.g. 0.75 with AdamW): the head gets the LR, "
                                          "block i (0-based) of L decay^(L-i), the embeddings decay^(L+1); "
                                          "null = the same LR everywhere (paper)", between(0, 1, lo_open=True))


# timm's RandAugment string (timm.data.auto_augment.rand_augment_transform): `rand` then dash-separated sections.
# timm skips a section it does not know, clips a magnitude above mmax (10 unless set) and takes n0 as "no op": here
# each of those is an error instead, since each is a typo that would train without the augmentation asked for.
RAND_SECTION = re.compile(r"(m|n|mmax)(\d+)|(p|mstd)(\d*\.?\d+)|inc[01]|t(weights|3a|3aw)")


def is_rand_augment(text: str) -> bool:
    """Whether `text` is '' (off) or a RandAugment string timm parses as written, e.g. `rand-m9-mstd0.5-inc1`."""
    if text == "":
        return True
    head, *sections = text.split("-")
    matches = [RAND_SECTION.fullmatch(s) for s in sections]
    if head != "rand" or not all(matches):
        return False
    numbers = {m[1] or m[3]: float(m[2] or m[4]) for m in matches if m[1] or m[3]}
    return (numbers.get("m", 0) <= numbers.get("mmax", 10) and numbers.get("n", 2) >= 1
            and numbers.get("p", 0.5) <= 1)


RAND_AUGMENT = Check(is_rand_augment, "'' or a timm RandAugment string: rand then -sections from m<int> (at most "
                                      "mmax, 10 unless set), n<int> (>= 1), p<float> (<= 1), mstd<float>, mmax<int>, "
                                      "inc<0|1>, t<weights|3a|3aw> (e.g. rand-m9-mstd0.5-inc1)")


@dataclass
class AugmentConfig:
    """Training-only augmentations beyond the crops and flips of `data`: RandAugment in the data-loader workers;
    colour jitter, random erasing and mixup/cutmix on the device."""

    auto_augment: str = opt("", "RandAugment in timm's syntax, applied in the data-loader workers after crop and flip "
                                "(MAE/DeiT: rand-m9-mstd0.5-inc1); '' = off", RAND_AUGMENT)
    reprob: float = opt(0.0, "random erasing: probability per image (MAE/DeiT: 0.25; 0 = off), timm's "
                             "RandomErasing on the normalised batch", between(0, 1))
    remode: Literal["pixel", "rand", "const"] = opt(
        "pixel", "random erasing fill, in normalised units: pixel = per-pixel normal noise (MAE/DeiT), rand = one "
                 "normal colour per rectangle, const = 0 (the mean colour)")
    recount: int = opt(1, "random erasing: up to this many rectangles per erased image", at_least(1))
    color_jitter: float = opt(0.0, "brightness/contrast/saturation jitter strength (0.4 is common; 0 = off)",
                              between(0, 1))
    mixup: float = opt(0.0, "mixup alpha (0 = off)", at_least(0))
    cutmix: float = opt(0.0, "cutmix alpha (0 = off)", at_least(0))
    mix_prob: float = opt(1.0, "probability of applying mixup/cutmix to a batch", between(0, 1))
    switch_prob: float = opt(0.5, "probability of cutmix instead of mixup when both are on", between(0, 1))


@dataclass
class FinetuneTrainConfig(TrainConfig):
    run_dir: str = opt("runs/finetune", "run directory (config, metrics, checkpoints, export); re-running resumes")
    mode: Literal["finetune", "linear_probe", "attentive_probe"] = opt(
        "finetune", "finetune: train everything; linear_probe: frozen encoder (eval mode), only the head trains; "
                    "attentive_probe: the same, the head reading every token through an attention pool (its own "
                    "learned query and cross-attention block: model.global_pool=map)")
    batch_size: int = opt(512, "global batch size (all processes, after accumulation)")
    epochs: int = opt(10, "passes over the training split", at_least(1))
    label_smoothing: float = opt(0.0, "label smoothing of the cross-entropy", between(0, 1, hi_open=True))
    eval_every_epochs: int = opt(1, "evaluate on the validation split every N epochs (and at the end)", at_least(1))
    ema_decay: float = opt(0.0, "model EMA (timm's ModelEmaV3) decay per optimizer step, e.g. 0.9999 (it averages "
                                "over about 1 / (1 - decay) steps); evaluated and exported beside the model; 0 = off",
                           between(0, 1, hi_open=True))


@dataclass
class SemiConfig:
    """Semi-supervised fine-tuning from an unlabelled pool (Semi-ViT's EMA teacher, arXiv 2208.05688): the pool is read
    beside data.shards in the same stream; the model's EMA labels the weak view of each pool image (crop and flip),
    and the student learns the confident labels on the strong view (the training augmentations). Defaults are
    Semi-ViT's (main_semi.py). docs/finetune.md#semi-supervised-fine-tuning-semi."""

    pool: str | list[str] = opt("", "unlabelled shard sets read beside data.shards (a folder or URL with its "
                                    "_info.json, the manifest, or a list of them: a mixture by size); their labels, "
                                    "if any, are never trained on; '' = off (supervised fine-tuning)")
    pool_split: str = opt("train", "the split of the pool's sets that is read")
    ratio: float = opt(5.0, "pool images per labelled image, on average in every batch (Semi-ViT's mu: 5); "
                            "train.batch_size counts both", above(0))
    threshold: float = opt(0.7, "a pool image trains the student only when the teacher's top probability on its weak "
                                "view reaches this (Semi-ViT: 0.7; 0.5-0.7 in its recipes)", between(0, 1))
    weight: float = opt(5.0, "weight of the pool's loss beside the labelled loss (Semi-ViT's lambda_u: 5)",
                        at_least(0))
    strong: str = opt("", "the pool's own strong view, the one the student learns from: RandAugment in timm's syntax "
                          "on a pool image's crop in the loader workers (FixMatch's: rand-n2-m10-mstd101, two ops at "
                          "a uniform random magnitude), instead of augment.*, which then apply to labelled images "
                          "only; '' (and strong_erasing 0) = the labelled images' augmentation", RAND_AUGMENT)
    strong_erasing: float = opt(0.0, "random erasing of the pool's strong view, a probability per image (FixMatch's "
                                     "Cutout: 1), one rectangle filled with the mean colour, on the device; with it "
                                     "the strong view is the pool's own, as with semi.strong", between(0, 1))
    threshold_mode: Literal["fixed", "freematch"] = opt(
        "fixed", "fixed: a pool image passes when the teacher's top probability reaches semi.threshold; freematch: "
                 "FreeMatch's self-adaptive thresholds (arXiv 2205.07246), a global one (the running mean of the "
                 "teacher's top probability on the pool) scaled per class by the running mean of its probability of "
                 "that class over its largest; semi.threshold is then unused")
    align: bool = opt(False, "distribution alignment (ReMixMatch's): the teacher's probabilities on the pool, "
                             "multiplied by the uniform distribution over their running mean and renormalised, before "
                             "thresholding: a teacher that favours some classes labels the pool more evenly")
    gate: float = opt(0.0, "the pool's loss counts only while the teacher's kept pseudo-labels of the validation "
                           "split are at least this share right, as the last evaluation measured them "
                           "(ema_val_pseudo_acc; off until the first evaluation, re-decided at each); 0 = always on",
                      between(0, 1))
    momentum: float = opt(0.999, "momentum of the running means of semi.threshold_mode=freematch and semi.align, per "
                                 "micro-batch (FreeMatch: 0.999 over a million steps; a run of a few thousand steps "
                                 "wants about 0.99)", between(0, 1, hi_open=True))

    @property
    def own_strong_view(self) -> bool:
        """Whether the pool's student view has its own augmentation (semi.strong or semi.strong_erasing)."""
        return bool(self.strong) or self.strong_erasing > 0

    def pool_sets(self) -> list[str]:
        """The pool's shard-set locations ([] when off)."""
        return [str(x) for x in self.pool] if isinstance(self.pool, list) else [self.pool] if self.pool else []

    def unused(self) -> list[str]:
        """The semi.* settings given (in the YAML or as key=value) that do nothing: without a pool, every one."""
        return [] if self.pool_sets() else sorted(f"semi.{k}" for k in given_keys(self) - {"pool", "pool_split"})


@dataclass
class FinetuneConfig:
    # What a resumed run cannot change: the checkpoint's tensors (model, head, optimizer state, EMA weights when
    # train.ema_decay > 0) have these shapes, and a checkpoint holds EMA weights only if the run had them.
    FIXED_ON_RESUME: ClassVar[tuple[str, ...]] = (*(f"model.{k}" for k in ARCH_KEYS), "model.img_size",
                                                  "model.global_pool", "num_classes", "optim.name", "train.mode",
                                                  "init.checkpoint", "train.ema_decay", "semi.pool",
                                                  "semi.threshold_mode", "semi.align")

    LENGTH_KEY: ClassVar[str] = "train.epochs"

    def total_steps(self, steps_per_epoch: int | None = None) -> int | None:
        """The run's length in optimizer steps, given the steps of an epoch (None when unknown)."""
        return None if steps_per_epoch is None else self.train.epochs * steps_per_epoch

    def __post_init__(self) -> None:
        # The attentive probe reads the tokens through timm's attention pool: the mode sets model.global_pool=map
        # (a pool the user gave is kept, and refused by `problems` unless it is map), so that config.yaml records
        # the model the run trains.
        if self.train.mode == "attentive_probe" and "global_pool" not in given_keys(self.model):
            self.model = replaced(self.model, global_pool="map")

    def problems(self) -> Iterator[tuple[str, str]]:
        pool = self.model.global_pool
        if self.train.mode == "attentive_probe" and "global_pool" in given_keys(self.model) and pool != "map":
            yield "train.mode", (f"attentive_probe reads the tokens through an attention pool, and model.global_pool "
                                 f"is {pool}: leave model.global_pool out (the mode sets map)")
        if self.train.mode == "linear_probe" and pool == "map":
            yield "model.global_pool", ("map is an attention pool that trains, and a linear probe trains the head "
                                        "alone: use train.mode=attentive_probe")
        if self.init.keep_head and not self.init.checkpoint:
            yield "init.keep_head", ("keeps the classifier of the export fine-tuning starts from, and init.checkpoint "
                                     "is empty (from scratch): give a finetune run's export, or leave init.keep_head "
                                     "out")
        yield from self._semi_problems()

    def _semi_problems(self) -> Iterator[tuple[str, str]]:
        if not self.semi.pool_sets():
            return
        if problem := shard_list_problem(self.semi.pool):
            yield "semi.pool", problem
        if fsdp_launch():  # the launch shards the model, which then keeps no EMA: no ema_decay will do
            yield "semi.pool", SEMI_POOL_REFUSED
        elif self.train.ema_decay <= 0:
            yield "semi.pool", ("the pool's labels come from the model's EMA (the teacher): set train.ema_decay (e.g. "
                                "0.999 for a short run, Semi-ViT: 0.9999)")
        if self.augment.mixup > 0 or self.augment.cutmix > 0:
            yield "semi.pool", ("mixup and cutmix would mix labelled and pool images in a batch: set augment.mixup=0 "
                                "and augment.cutmix=0")
        if self.semi.gate > 0 and not self.data.val_split:
            yield "semi.gate", ("opens the pool when an evaluation finds the teacher's pseudo-labels of the "
                                "validation split mostly right, and data.val_split is empty: give a validation split "
                                "(data.val_shards, data.val_split), or set semi.gate=0")
        if self.data.decode == "gpu":
            yield "semi.pool", ("the teacher's weak view of a pool image is made in the loader workers: set "
                                "data.decode=cpu")

    init: InitConfig = section(InitConfig)
    model: ModelConfig = section(ModelConfig)
    num_classes: int | None = opt(None, "classes of the new head (default: from the shard manifest)",
                                  Check(lambda n: 1 <= n <= MAX_CLASSES, f"in [1, {MAX_CLASSES}]"))
    data: DataConfig = section(DataConfig)
    optim: FinetuneOptimConfig = section(FinetuneOptimConfig)
    augment: AugmentConfig = section(AugmentConfig)
    train: FinetuneTrainConfig = section(FinetuneTrainConfig)
    semi: SemiConfig = section(SemiConfig)
    export: ExportConfig = section(ExportConfig)

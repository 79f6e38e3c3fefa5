"""compare's arms: their kinds and stages, `--arms` and `--set` parsed, the checked command line (`Setup`), each
arm's stages for each seed and point of the label sweep (the plan, `plan_runs`), and the equal-compute sizing from
the lengths the stages' dry runs resolve (`set_lengths`). See docs/experiments.md#python--m-experimentscompare.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from experiments import label_sweep
from vit_mpp.config.engine import ConfigError
from vit_mpp.config.yaml_words import plain, read_yaml

KINDS = ("scratch", "mpp", "scratch_equal", "supervised", "probe", "semi", "semi_scratch", "semi2")
STAGES = {"scratch": ("finetune",), "mpp": ("pretrain", "finetune"), "scratch_equal": ("finetune",),
          "supervised": ("pretrain", "finetune"), "probe": ("finetune",), "semi": ("finetune",),
          "semi_scratch": ("finetune",), "semi2": ("finetune",)}
DEFAULT_ARMS = KINDS[:5]
READS_REFERENCE = ("probe", "semi", "semi2")  # fine-tune the reference MPP arm's export (semi2: its fine-tuning's)
POOL_KINDS = ("semi", "semi2")  # MPP with the pool at fine-tuning: semi from the pretraining, semi2 after fine-tuning
EQUAL_COMPUTE = (("scratch_equal", "finetune"), ("supervised", "pretrain"), ("semi_scratch", "finetune"))
ARM_NAME = re.compile(r"^(" + "|".join(KINDS) + r")(-[A-Za-z0-9_]+)*$")  # semi-strong-long: a variant of semi
KEY_VALUE = re.compile(r"^[A-Za-z_]\w*(\.\w+)*=")
# Keys compare sets itself: a run's place, seed and data, and (fine-tuning) where it starts and what it is scored on.
OWN_KEYS = {"pretrain": {"train.run_dir", "train.seed", "data.shards"},
            "finetune": {"train.run_dir", "train.seed", "data.shards", "init.checkpoint", "data.val_shards",
                         "data.val_split", "semi.pool"}}
# semi.gate decides with the validation split's labels: without --val compare's fine-tunings validate on --test
NO_GATE = ("compare validates every fine-tuning on --test unless --val names a validation set of its own, so a gate "
           "there would open the pool with the test split's labels: give --val SHARDS:SPLIT (docs/experiments.md)")
SCORES = "test"  # with --val, in a fine-tuning's run directory: its final export scored on --test (evaluation.json)


def config_semi(finetune_config: str) -> dict[str, Any]:
    """The `semi` section a fine-tuning config file sets ({} for none). A file that is not a mapping of sections
    gives {}: the stage's own dry run names what is wrong with it."""
    try:
        semi = plain(read_yaml(Path(finetune_config).read_text()) or {}).get("semi") or {}
    except (yaml.YAMLError, AttributeError):
        return {}
    return semi if isinstance(semi, dict) else {}


def check_no_gate(finetune_config: str) -> None:
    """Refuse a fine-tuning config that sets `semi.gate` (NO_GATE)."""
    gate = config_semi(finetune_config).get("gate", 0)
    if isinstance(gate, (int, float)) and gate > 0:
        raise ConfigError(f"--finetune-config {finetune_config} sets semi.gate {gate:g}: {NO_GATE}")


@dataclass
class Setup:
    """The checked command line: shard sets, arms, overrides, configs, where the runs go."""

    unlabelled: str
    labelled: str  # may hold {seed}
    test: str
    test_split: str
    test_samples: int
    pool_val: bool  # the unlabelled set has a 'val' split (the supervised pretraining's monitor)
    arms: list[str]
    seeds: list[int]
    configs: dict[str, str]  # module -> config file
    overrides: dict[str, list[str]]  # 'pretrain', 'finetune' (every run of that config), 'ARM.STAGE'
    out: Path
    notes: list[str] = field(default_factory=list)
    fingerprint: str = ""  # of the configs' and manifests' contents: a dry run's lengths are kept under it
    points: list[str] = field(default_factory=lambda: [""])  # the label sweep's points (k2, k20, all); "": none
    finetune_steps: int | None = None  # a sweep's fine-tuning steps at every point (None: the first point's)
    arm_steps: dict[str, int] = field(default_factory=dict)  # an arm's own fine-tuning steps in a sweep
    config_pool: bool = False  # the fine-tuning config sets semi.pool: the runs without a pool must empty it
    val: str = ""  # --val: what the fine-tunings validate on ("": --test), their final exports then scored on --test
    val_split: str = ""
    apart: str = ""  # --val when it is a subset of --labelled: the sweep's subsets are drawn apart from it

    def steps_of(self, arm: str) -> int | None:
        """The fine-tuning steps of `arm` at every point of a sweep (None: as many as at the first point)."""
        return self.arm_steps.get(arm, self.finetune_steps)

    def runs(self, arm: str, point: str) -> bool:
        """Whether `arm` runs at `point`: not a semi-supervised arm at point all when its pool is the labelled set."""
        same = Path(self.unlabelled).resolve() == Path(self.labelled).resolve()
        return not (point == "all" and same and kind(arm) in (*POOL_KINDS, "semi_scratch"))

    def labelled_of(self, seed: int, point: str) -> str:
        """The labelled set a fine-tuning of `seed` at `point` trains on: --labelled itself, or a subset of it."""
        if point in ("", "all"):
            return self.labelled.replace("{seed}", str(seed))
        return str(label_sweep.subset_folder(self.out, point, seed))

    @property
    def reference(self) -> str:
        """The MPP arm the equal-compute, supervised and probe arms are measured against: the first one."""
        return next(a for a in self.arms if kind(a) == "mpp")

    def pool_twin(self, arm: str) -> str | None:
        """The arm with the pool whose compute a semi_scratch arm is given: the semi or semi2 arm of the same suffix
        (semi_scratch-strong: semi-strong), else the first one; None without any."""
        pools = [a for a in self.arms if kind(a) in POOL_KINDS]
        suffix = arm.partition("-")[2]
        return next((a for a in pools if a.partition("-")[2] == suffix), pools[0] if pools else None)


@dataclass(eq=False)  # a stage is itself: compared by identity
class Stage:
    """One process of the plan: `python -m <module> --config <config> <overrides>` in `run_dir`."""

    name: str  # seed0/mpp/pretrain; seed0/mpp/finetune_k20 at a point of a label sweep
    module: str  # pretrain | finetune
    config: str
    run_dir: Path
    overrides: list[str]
    needs: Stage | None = None  # a stage whose export this one starts from
    score: list[str] | None = None  # with --val: finetune.evaluate's arguments that score its export on --test
    steps: int = 0  # planned optimizer steps (0: unknown)
    batch: int = 0
    point: str = ""  # the label sweep's point of a fine-tuning ("": none, or a pretraining shared by every point)

    @property
    def arm(self) -> str:
        return self.name.split("/")[1]

    @property
    def stage(self) -> str:
        """pretrain or finetune (the arm's stage, whatever its point)."""
        return self.name.split("/")[2].split("_", 1)[0]

    @property
    def key(self) -> str:
        """ARM/STAGE[_POINT]: the same for every seed (lengths are measured on the first)."""
        return self.name.split("/", 1)[1]

    @property
    def command(self) -> list[str]:
        return [sys.executable, "-m", self.module, "--config", self.config, *self.overrides]

    @property
    def score_command(self) -> list[str] | None:
        return [sys.executable, "-m", "finetune.evaluate", *self.score] if self.score else None

    @property
    def work(self) -> int:
        """Planned training images (steps x batch)."""
        return self.steps * self.batch


@dataclass(frozen=True)
class Lengths:
    """What a dry run of a stage resolves: global batch, total optimizer steps, and epochs (fine-tuning)."""

    batch: int
    steps: int
    epochs: int | None = None


def kind(arm: str) -> str:
    return arm.split("-", 1)[0]


# ----------------------------------------------------------------------------------------------- --arms and --set


def parse_overrides(items: list[str], arms: list[str], own_val: bool = False) -> dict[str, list[str]]:
    """`TARGET:KEY=VALUE` items -> target -> ['KEY=VALUE', ...]; TARGET is pretrain, finetune, ARM.pretrain or
    ARM.finetune (ARM one of --arms, with that stage); `semi.gate` only with a validation set of its own (`own_val`,
    --val)."""
    found: dict[str, list[str]] = {}
    for item in items:
        target, sep, setting = item.partition(":")
        if not sep or not KEY_VALUE.match(setting):
            raise ConfigError(f"--set {item!r}: give TARGET:KEY=VALUE, TARGET one of pretrain, finetune, ARM.pretrain, "
                              "ARM.finetune (e.g. mpp.pretrain:mpp.mask_ratio=0.15)")
        arm, dot, stage = target.rpartition(".")
        stage = stage if dot else target
        if stage not in STAGES["mpp"] or (dot and arm not in arms):
            raise ConfigError(f"--set {item!r}: unknown target {target!r} (pretrain, finetune, or ARM.STAGE for an "
                              f"arm of --arms: {', '.join(arms)})")
        if dot and stage not in STAGES[kind(arm)]:
            raise ConfigError(f"--set {item!r}: arm {arm} has no {stage} stage (it has: "
                              f"{', '.join(STAGES[kind(arm)])})")
        key = setting.split("=", 1)[0]
        config = "finetune" if stage == "finetune" or kind(arm) == "supervised" else "pretrain"
        computed = dot and (kind(arm), stage) in EQUAL_COMPUTE
        if key == "semi.gate" and config == "finetune" and not own_val:
            raise ConfigError(f"--set {item!r}: {NO_GATE}")
        if key in OWN_KEYS[config] or (key == "train.epochs" and computed):
            raise ConfigError(f"--set {item!r}: compare sets {key} itself (see python -m experiments.compare --help)")
        found.setdefault(target, []).append(setting)
    return found


def parse_arms(values: list[str]) -> list[str]:
    arms = [a for v in values for a in v.split(",") if a]
    for arm in arms:
        if not ARM_NAME.match(arm):
            raise ConfigError(f"--arms: unknown arm {arm!r} (arms: {', '.join(KINDS)}, or one of them with a "
                              "-suffix for a variant, e.g. mpp-l2)")
    if len(set(arms)) != len(arms):
        raise ConfigError(f"--arms names an arm twice: {', '.join(arms)}")
    if not any(kind(a) == "mpp" for a in arms):
        raise ConfigError("--arms has no mpp arm: the comparison is of MPP pretraining against its baselines")
    return arms


# ------------------------------------------------------------------------------------------------------- the plan


def stage_overrides(setup: Setup, arm: str, stage: str, own: list[str]) -> list[str]:
    """A stage's overrides in the order that decides (the last wins): compare's own settings (`own`: place, seed,
    data), the user's for every run of the stage's config, the arm's defining ones (`own` too: probe's
    train.mode=linear_probe), then the user's for this arm's stage. The equal-compute epochs are added last."""
    config = "finetune" if stage == "finetune" or kind(arm) == "supervised" else "pretrain"
    fixed = [o for o in own if o.split("=")[0] in OWN_KEYS[config]]
    defining = [o for o in own if o.split("=")[0] not in OWN_KEYS[config]]
    return [*fixed, *setup.overrides.get(config, []), *defining, *setup.overrides.get(f"{arm}.{stage}", [])]


def finetune_stage(point: str) -> str:
    """The fine-tuning stage's name at a point of the label sweep."""
    return f"finetune_{point}" if point else "finetune"


def arm_stages(setup: Setup, arm: str, seed: int, made: dict[Any, Stage], point: str = "") -> list[Stage]:
    """The stages of one arm for one seed at one point of the label sweep. `made` holds this seed's stages so far:
    (arm, "pretrain") and (arm, point) -> the arm's pretraining and fine-tuning, and each pretraining's command
    (without its run directory) -> its stage. A pretraining is made at the first point and shared by the others, and
    a pretraining (MPP or supervised) whose command another arm's already runs is that one (a variant that changes
    only fine-tuning settings reads the reference's pretraining, or the `supervised` arm's; the supervised
    pretraining's equal-compute length is the same for every supervised arm). Only those are shared: the length of a
    fine-tuning or of an equal-compute run is not in its command until `set_lengths`. Returns the stages new to the
    plan."""
    base = setup.out / f"seed{seed}" / arm
    k, name = kind(arm), f"seed{seed}/{arm}"
    val, val_split = (setup.val, setup.val_split) if setup.val else (setup.test, setup.test_split)
    scored = [f"data.shards={setup.labelled_of(seed, point)}", f"train.seed={seed}", f"data.val_shards={val}",
              f"data.val_split={val_split}"]
    score = ["--checkpoint", str(base / finetune_stage(point) / "export"), "--shards", setup.test, "--split",
             setup.test_split, "--out", str(base / finetune_stage(point) / SCORES)] if setup.val else None
    where = finetune_stage(point)
    new: list[Stage] = []

    # Compare decides which runs read the pool: one whose fine-tuning config sets a pool is not plain fine-tuning
    no_pool = ("semi.pool=",) if setup.config_pool else ()

    def finetune(init: Stage | None, extra: tuple[str, ...] = no_pool) -> None:
        checkpoint = f"init.checkpoint={init.run_dir / 'export'}" if init else "init.checkpoint="
        made[arm, point] = Stage(f"{name}/{where}", "finetune", setup.configs["finetune"], base / where,
                                 [f"train.run_dir={base / where}", *stage_overrides(
                                     setup, arm, "finetune", [*scored, checkpoint, *extra])], init, score=score,
                                 point=point)
        new.append(made[arm, point])

    if k in ("mpp", "supervised") and (arm, "pretrain") not in made:
        if k == "mpp":
            own = [f"data.shards={setup.unlabelled}", f"train.seed={seed}"]
            pre = Stage(f"{name}/pretrain", "pretrain", setup.configs["pretrain"], base / "pretrain",
                        [f"train.run_dir={base / 'pretrain'}", *stage_overrides(setup, arm, "pretrain", own)])
        else:
            own = [f"data.shards={setup.unlabelled}", f"train.seed={seed}", "data.val_shards=",
                   f"data.val_split={'val' if setup.pool_val else ''}", "init.checkpoint=", *no_pool]
            pre = Stage(f"{name}/pretrain", "finetune", setup.configs["finetune"], base / "pretrain",
                        [f"train.run_dir={base / 'pretrain'}", *stage_overrides(setup, arm, "pretrain", own)])
        command = (pre.module, *pre.overrides[1:])  # its run directory, first, left out
        pre = made.setdefault(command, pre)
        if pre.arm == arm:  # not another arm's, shared
            new.append(pre)
        made[arm, "pretrain"] = pre
    pool = (f"semi.pool={setup.unlabelled}",)  # semi-supervised: the unlabelled set is the pool
    if k in ("mpp", "supervised"):
        finetune(made[arm, "pretrain"])
    elif k == "probe":
        finetune(made[setup.reference, "pretrain"], ("train.mode=linear_probe", *no_pool))
    elif k == "semi":
        finetune(made[setup.reference, "pretrain"], pool)
    elif k == "semi2":  # Semi-ViT's two stages: the reference's fine-tuning, then the pool from its export, head kept
        finetune(made[setup.reference, point], (*pool, "init.keep_head=true"))
    else:
        finetune(None, pool if k == "semi_scratch" else no_pool)
    return new


def plan_runs(setup: Setup) -> tuple[list[Stage], dict[tuple[int, str, str], list[Stage]]]:
    """Every stage of every seed and point (lengths not yet known), each command once, and (seed, arm, point) -> the
    stages its result depends on."""
    stages, of_arm = [], {}
    for seed in setup.seeds:
        made: dict[Any, Stage] = {}
        for point in setup.points:
            for arm in sorted(setup.arms, key=lambda a: kind(a) != "mpp"):  # mpp arms first: the others read one
                if not setup.runs(arm, point):
                    continue
                stages += arm_stages(setup, arm, seed, made, point)
                reads = {"semi2": [made[setup.reference, "pretrain"], made[setup.reference, point]]}.get(kind(arm))
                if reads is None:
                    before = made[setup.reference, "pretrain"] if kind(arm) in READS_REFERENCE else made.get(
                        (arm, "pretrain"))
                    reads = [before] if before is not None else []
                of_arm[seed, arm, point] = [*reads, made[arm, point]]
    return stages, of_arm


# -------------------------------------------------------------------------------------------------- equal compute


def equal_epochs(images: int, steps_per_epoch: int, batch: int) -> int:
    """Epochs of a run of `steps_per_epoch` steps of `batch` images each that sees about `images` images (at
    least one epoch)."""
    return max(1, int(images / (steps_per_epoch * batch) + 0.5))


def point_lengths(setup: Setup, point: str, here: list[Stage], lengths: dict[str, Lengths]) -> dict[str, Lengths]:
    """The lengths of the stages `here` at one point of a sweep, each fine-tuning with its arm's steps (its own,
    --finetune-steps, or as many as at the first point) in whole epochs of the point's labelled set."""
    got = {}
    for s in here:
        length = lengths[s.key]
        if s.key.endswith(f"/finetune_{point}"):
            steps, first = setup.steps_of(s.arm), s.key.replace(f"_{point}", f"_{setup.points[0]}")
            if steps is None and point != setup.points[0] and first in lengths:
                steps = lengths[first].steps
            if steps is not None:
                length = label_sweep.same_steps(steps, length)
        got[s.key] = length
    return got


def set_lengths(setup: Setup, stages: list[Stage], lengths: dict[str, Lengths]) -> dict[str, int]:
    """Give each stage its steps and batch, and the equal-compute arms their epochs: scratch_equal sees as many
    images as the reference MPP arm's pretraining and fine-tuning together, the supervised pretraining as many as
    the MPP pretraining, semi_scratch as many as its pool twin's stages (`Setup.pool_twin`: the MPP pretraining, the
    twin's fine-tuning, and for semi2 the reference's fine-tuning too; its own fine-tuning as configured without
    one). In a label sweep every fine-tuning makes its arm's --finetune-steps at each point, or as many as it makes
    at the first (`label_sweep.same_steps`), and the equal-compute arms are sized per point.
    Returns arm -> epochs set ('arm@point' in a sweep)."""
    ref = setup.reference
    pre = lengths[f"{ref}/pretrain"]
    epochs = {}
    for point in setup.points:
        here = [s for s in stages if s.point == point or (point == setup.points[0] and s.stage == "pretrain")]
        got = point_lengths(setup, point, here, lengths)

        def images(arm: str, got: dict[str, Lengths] = got, point: str = point) -> int:
            """Training images of `arm`'s fine-tuning at this point (0 when it has none here)."""
            length = got.get(f"{arm}/{finetune_stage(point)}")
            return length.batch * length.steps if length else 0

        targets = {"scratch_equal": pre.batch * pre.steps + images(ref), "supervised": pre.batch * pre.steps}
        for s in here:
            length = got[s.key]
            if (kind(s.arm), s.stage) in EQUAL_COMPUTE:
                per_epoch = length.steps // length.epochs
                target = targets.get(kind(s.arm), pre.batch * pre.steps + length.batch * length.steps)
                twin = setup.pool_twin(s.arm) if kind(s.arm) == "semi_scratch" else None
                if twin is not None and images(twin):  # the pool's arm it is the baseline of, its stages together
                    target = pre.batch * pre.steps + images(twin) + (images(ref) if kind(twin) == "semi2" else 0)
                e = equal_epochs(target, per_epoch, length.batch)
                epochs[f"{s.arm}@{point}" if point and s.stage == "finetune" else s.arm] = e
                s.overrides.append(f"train.epochs={e}")
                s.steps, s.batch = e * per_epoch, length.batch
            else:
                if length.epochs is not None and length != lengths[s.key]:  # a sweep's point: its own epochs
                    s.overrides.append(f"train.epochs={length.epochs}")
                s.steps, s.batch = length.steps, length.batch
    return epochs

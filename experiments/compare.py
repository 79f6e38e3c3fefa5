"""`python -m experiments.compare --unlabelled SHARDS --labelled SHARDS --test SHARDS[:SPLIT] --out DIR ...`: does MPP
pretraining earn its keep? Per seed, each arm's product commands (`python -m pretrain`, `python -m finetune`) run
as subprocesses into their own run directories; the table pairs the arms' final test top-1 by seed. Resumable.
See docs/experiments.md.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import hashlib
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from experiments import label_sweep, monitor_ranks
from vit_mpp.cli import ArgumentParser, run_main
from vit_mpp.config.engine import ConfigError
from vit_mpp.data.manifest import check_manifest, manifest_classes, manifest_file, read_manifest
from vit_mpp.durable import write_atomic
from vit_mpp.errors import EXIT_PREEMPTED, Stopped, UserError
from vit_mpp.models.export_folder import is_export
from vit_mpp.progress import format_duration
from vit_mpp.run.metering.metrics_log import read_metrics
from vit_mpp.run.metering.summary import wall_time_s
from vit_mpp.run.start.run_dir import lock_run_dir
from vit_mpp.tools.args import check_out_folder, make_out_folder, open_out_file

KINDS = ("scratch", "mpp", "scratch_equal", "supervised", "probe", "semi", "semi_scratch")
STAGES = {"scratch": ("finetune",), "mpp": ("pretrain", "finetune"), "scratch_equal": ("finetune",),
          "supervised": ("pretrain", "finetune"), "probe": ("finetune",), "semi": ("finetune",),
          "semi_scratch": ("finetune",)}
DEFAULT_ARMS = KINDS[:5]
READS_REFERENCE = ("probe", "semi")  # fine-tune the reference MPP arm's export
EQUAL_COMPUTE = (("scratch_equal", "finetune"), ("supervised", "pretrain"), ("semi_scratch", "finetune"))
ARM_NAME = re.compile(r"^(" + "|".join(KINDS) + r")(-[A-Za-z0-9_]+)?$")
KEY_VALUE = re.compile(r"^[A-Za-z_]\w*(\.\w+)*=")
# Keys compare sets itself: a run's place, seed and data, and (fine-tuning) where it starts and what it is scored on.
OWN_KEYS = {"pretrain": {"train.run_dir", "train.seed", "data.shards"},
            "finetune": {"train.run_dir", "train.seed", "data.shards", "init.checkpoint", "data.val_shards",
                         "data.val_split", "semi.pool"}}
SIDECAR = "compare_run.json"  # in each run directory: the command compare ran there
DRY_RUNS = "dry_runs.json"  # in --out: what each stage command's dry run resolved (batch, steps, epochs)
DRY_RUN_HEAD = "dry run: nothing is written; the resolved config:"


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

    def runs(self, arm: str, point: str) -> bool:
        """Whether `arm` runs at `point`: not a semi-supervised arm at point all when its pool is the labelled set."""
        same = Path(self.unlabelled).resolve() == Path(self.labelled).resolve()
        return not (point == "all" and same and kind(arm) in ("semi", "semi_scratch"))

    def labelled_of(self, seed: int, point: str) -> str:
        """The labelled set a fine-tuning of `seed` at `point` trains on: --labelled itself, or a subset of it."""
        if point in ("", "all"):
            return self.labelled.replace("{seed}", str(seed))
        return str(label_sweep.subset_folder(self.out, point, seed))

    @property
    def reference(self) -> str:
        """The MPP arm the equal-compute, supervised and probe arms are measured against: the first one."""
        return next(a for a in self.arms if kind(a) == "mpp")


@dataclass(eq=False)  # a stage is itself: compared by identity
class Stage:
    """One process of the plan: `python -m <module> --config <config> <overrides>` in `run_dir`."""

    name: str  # seed0/mpp/pretrain; seed0/mpp/finetune_k20 at a point of a label sweep
    module: str  # pretrain | finetune
    config: str
    run_dir: Path
    overrides: list[str]
    needs: Stage | None = None  # a stage whose export this one starts from
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


# ---------------------------------------------------------------------------------------------------------- checks


def parse_test(value: str) -> tuple[str, str | None]:
    """`SHARDS[:SPLIT]` -> (shards, split or None); a ':' in a URL's scheme or a path is not a split."""
    location, sep, split = value.rpartition(":")
    if sep and location and split and "/" not in split and not Path(value).exists():
        return location, split
    return value, None


def check_shards(location: str, split: str | None, what: str, labelled: bool) -> dict[str, Any]:
    """The manifest of a shard set that has `split` (any split: None) and labels when `labelled`; else one line
    naming the flag."""
    try:
        info = read_manifest(location)
        check_manifest(info, manifest_file(location))
    except UserError as e:
        raise ConfigError(f"{what}: {error_of(str(e))}") from None
    if split is not None and split not in info["splits"]:
        raise ConfigError(f"{what} {location} has no split '{split}' (it has: {', '.join(info['splits'])})")
    if labelled and not manifest_classes(info):
        raise ConfigError(f"{what} {location} carries no labels (its manifest counts no classes): the fine-tunings "
                          "train and are scored on labels")
    return info


def parse_overrides(items: list[str], arms: list[str]) -> dict[str, list[str]]:
    """`TARGET:KEY=VALUE` items -> target -> ['KEY=VALUE', ...]; TARGET is pretrain, finetune, ARM.pretrain or
    ARM.finetune (ARM one of --arms, with that stage)."""
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


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m experiments.compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--unlabelled", required=True, metavar="SHARDS",
                   help="the pool: MPP pretraining reads its train split without labels (and its val split for its "
                   "validation); the supervised arm pretrains on it with its labels")
    p.add_argument("--labelled", required=True, metavar="SHARDS",
                   help="the labelled training set of every fine-tuning (its train split); '{seed}' in the path is "
                   "replaced by the seed, for a labelled subset drawn per seed")
    p.add_argument("--test", required=True, metavar="SHARDS[:SPLIT]",
                   help="what every fine-tuning is scored on (default split: test if the set has one, else val)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="one run of every arm per seed")
    p.add_argument("--pretrain-config", required=True, metavar="YAML", help="the MPP pretraining config")
    p.add_argument("--finetune-config", required=True, metavar="YAML",
                   help="the fine-tuning config (every arm's last stage, and the supervised arm's pretraining)")
    p.add_argument("--arms", nargs="+", default=[",".join(DEFAULT_ARMS)], metavar="ARM[,ARM...]",
                   help=f"arms to run: {', '.join(KINDS)} (default: {','.join(DEFAULT_ARMS)}); semi and "
                   "semi_scratch fine-tune with the unlabelled set as their pool (semi-supervised; they need "
                   "finetune:train.ema_decay=...), semi from the reference MPP arm, semi_scratch from scratch at "
                   "equal compute; a -suffix makes a variant (mpp-l2) to give its own --set; the first mpp arm is "
                   "the reference the equal-compute, supervised, probe and semi arms are measured against")
    p.add_argument("--set", nargs="+", action="extend", default=[], metavar="TARGET:KEY=VALUE", dest="overrides",
                   help="config overrides: pretrain:KEY=VALUE (every MPP pretraining), finetune:KEY=VALUE (every "
                   "run of the fine-tuning config), ARM.pretrain:KEY=VALUE or ARM.finetune:KEY=VALUE (one arm's "
                   "stage, applied last), e.g. mpp.pretrain:mpp.target=l2 probe.finetune:model.global_pool=avg")
    p.add_argument("--labels-per-class", nargs="+", default=None, metavar="K",
                   help="the label-efficiency curve: every fine-tuning at each point (e.g. 2 20 100 all), on K "
                   "labelled images of each class drawn per seed from --labelled (build-shards subset) or on all "
                   "of it, as many steps at each point (--finetune-steps); the pretrainings are shared by the points, "
                   "the equal-compute arms sized per point; one table per point, the curve, and labels.png")
    p.add_argument("--finetune-steps", type=int, default=None, metavar="N",
                   help="with --labels-per-class: each fine-tuning makes about N steps at every point (its epochs "
                   "set per point); default: as many as the fine-tuning config makes at the first point")
    p.add_argument("--out", required=True, type=Path, metavar="DIR",
                   help="where the run directories (DIR/seedS/ARM/STAGE), logs and tables go")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="threads per run (default: cores / jobs)")
    p.add_argument("--dry-run", action="store_true", help="check everything, print the runs, run nothing")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: make the table from the run directories in --out")
    return p


def check_args(argv: list[str] | None) -> tuple[Setup, Any]:
    """The command line checked, shard sets included, before anything runs: (setup, parsed flags)."""
    args = build_parser().parse_args(argv)
    if args.jobs < 1 or (args.threads is not None and args.threads < 1):
        raise ConfigError(f"--jobs and --threads must be at least 1, got {args.jobs} and {args.threads}")
    if len(set(args.seeds)) != len(args.seeds) or min(args.seeds) < 0:
        raise ConfigError(f"--seeds must be distinct and >= 0, got {' '.join(map(str, args.seeds))}")
    arms = parse_arms(args.arms)
    overrides = parse_overrides(args.overrides, arms)
    for flag, path in (("--pretrain-config", args.pretrain_config), ("--finetune-config", args.finetune_config)):
        if not Path(path).is_file():
            raise ConfigError(f"{flag} {path}: no such file")
    check_out_folder(args.out)
    pool = check_shards(args.unlabelled, "train", "--unlabelled", labelled=False)
    read = [pool]
    for seed in args.seeds:
        labelled_info = check_shards(args.labelled.replace("{seed}", str(seed)), "train", "--labelled", True)
        read.append(labelled_info)
    test, split = parse_test(args.test)
    if split is None:
        splits = check_shards(test, None, "--test", labelled=True)["splits"]
        split = "test" if "test" in splits else "val" if "val" in splits else None
        if split is None:
            raise ConfigError(f"--test {test} has no split named test or val: give SHARDS:SPLIT")
    test_info = check_shards(test, split, "--test", labelled=True)
    if manifest_classes(test_info) != manifest_classes(labelled_info):
        raise ConfigError(f"--test {test} counts {manifest_classes(test_info)} classes, --labelled "
                          f"{manifest_classes(labelled_info)}: the classifier is scored on the classes it learns")
    setup = Setup(args.unlabelled, args.labelled, test, split, test_info["splits"][split]["num_samples"],
                  "val" in pool["splits"], arms, args.seeds,
                  {"pretrain": args.pretrain_config, "finetune": args.finetune_config}, overrides, args.out)
    contents = [Path(args.pretrain_config).read_text(), Path(args.finetune_config).read_text(), *read, test_info]
    setup.fingerprint = hashlib.sha256(json.dumps(contents, sort_keys=True).encode()).hexdigest()
    setup.points = label_sweep.parse_points(args.labels_per_class, args.labelled)
    if args.finetune_steps is not None and (args.finetune_steps < 1 or setup.points == [""]):
        raise ConfigError(f"--finetune-steps {args.finetune_steps}: give a count >= 1, with --labels-per-class (a "
                          "single comparison's fine-tuning length is its config's train.epochs)")
    setup.finetune_steps = args.finetune_steps
    if "all" in setup.points and not all(setup.runs(a, "all") for a in setup.arms):
        setup.notes.append("semi-supervised arms not run at point all: their pool, --unlabelled, is the labelled set "
                           "itself there")
    if not manifest_classes(pool) and any(kind(a) == "supervised" for a in arms):
        setup.arms = [a for a in arms if kind(a) != "supervised"]
        setup.notes.append(f"supervised arm skipped: the pool {args.unlabelled} carries no labels (its manifest "
                           "counts no classes)")
    return setup, args


# ------------------------------------------------------------------------------------------------------- the plan


def equal_epochs(images: int, steps_per_epoch: int, batch: int) -> int:
    """Epochs of a run of `steps_per_epoch` steps of `batch` images each that sees about `images` images (at
    least one epoch)."""
    return max(1, int(images / (steps_per_epoch * batch) + 0.5))


def stage_overrides(setup: Setup, arm: str, stage: str, own: list[str]) -> list[str]:
    """A stage's overrides in the order that decides (the last wins): compare's own settings (`own`: place, seed,
    data), the user's for every run of the stage's config, the arm's defining ones (`own` too: probe's
    train.mode=linear_probe), then the user's for this arm's stage. The equal-compute epochs are added last."""
    config = "finetune" if stage == "finetune" or kind(arm) == "supervised" else "pretrain"
    fixed = [o for o in own if o.split("=")[0] in OWN_KEYS[config]]
    defining = [o for o in own if o.split("=")[0] not in OWN_KEYS[config]]
    return [*fixed, *setup.overrides.get(config, []), *defining, *setup.overrides.get(f"{arm}.{stage}", [])]


def arm_stages(setup: Setup, arm: str, seed: int, pretrained: dict[str, Stage], point: str = "") -> list[Stage]:
    """The stages of one arm for one seed at one point of the label sweep; a pretraining is made at the first point
    and shared by the others (`pretrained`: this seed's pretraining stage of each arm that has one). Returns the
    stages new to the plan."""
    base = setup.out / f"seed{seed}" / arm
    k, name = kind(arm), f"seed{seed}/{arm}"
    scored = [f"data.shards={setup.labelled_of(seed, point)}", f"train.seed={seed}",
              f"data.val_shards={setup.test}", f"data.val_split={setup.test_split}"]
    where = finetune_stage(point)

    def finetune(init: Stage | None, extra: tuple[str, ...] = ()) -> Stage:
        checkpoint = f"init.checkpoint={init.run_dir / 'export'}" if init else "init.checkpoint="
        return Stage(f"{name}/{where}", "finetune", setup.configs["finetune"], base / where,
                     [f"train.run_dir={base / where}", *stage_overrides(setup, arm, "finetune",
                                                                        [*scored, checkpoint, *extra])], init,
                     point=point)

    if k in ("mpp", "supervised"):
        pre, new = pretrained.get(arm), []
        if pre is None and k == "mpp":
            pre = Stage(f"{name}/pretrain", "pretrain", setup.configs["pretrain"], base / "pretrain",
                        [f"train.run_dir={base / 'pretrain'}", *stage_overrides(
                            setup, arm, "pretrain", [f"data.shards={setup.unlabelled}", f"train.seed={seed}"])])
            new = [pre]
        elif pre is None:
            own = [f"data.shards={setup.unlabelled}", f"train.seed={seed}", "data.val_shards=",
                   f"data.val_split={'val' if setup.pool_val else ''}", "init.checkpoint="]
            pre = Stage(f"{name}/pretrain", "finetune", setup.configs["finetune"], base / "pretrain",
                        [f"train.run_dir={base / 'pretrain'}", *stage_overrides(setup, arm, "pretrain", own)])
            new = [pre]
        pretrained[arm] = pre
        return [*new, finetune(pre)]
    if k == "probe":
        return [finetune(pretrained[setup.reference], ("train.mode=linear_probe",))]
    pool = (f"semi.pool={setup.unlabelled}",)  # semi-supervised: the unlabelled set is the pool
    if k == "semi":
        return [finetune(pretrained[setup.reference], pool)]
    return [finetune(None, pool if k == "semi_scratch" else ())]


def plan_runs(setup: Setup) -> tuple[list[Stage], dict[tuple[int, str, str], list[Stage]]]:
    """Every stage of every seed and point (lengths not yet known), and (seed, arm, point) -> the stages its result
    depends on."""
    stages, of_arm = [], {}
    for seed in setup.seeds:
        pretrained: dict[str, Stage] = {}
        for point in setup.points:
            for arm in sorted(setup.arms, key=lambda a: kind(a) != "mpp"):  # mpp arms first: probe starts from one
                if not setup.runs(arm, point):
                    continue
                new = arm_stages(setup, arm, seed, pretrained, point)
                stages += new
                before = pretrained[setup.reference] if kind(arm) in READS_REFERENCE else pretrained.get(arm)
                of_arm[seed, arm, point] = ([before] if before is not None else []) + [new[-1]]
    return stages, of_arm


# --------------------------------------------------------------------------------------------- dry runs (lengths)


def dry_run(cmd: list[str]) -> subprocess.CompletedProcess:
    """A stage's own `--dry-run`: every check a run makes at start, nothing written."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return children.capture([*cmd, "--dry-run"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def parse_dry_run(text: str) -> Lengths:
    """Batch, steps and epochs from a dry run's output (its resolved config, then `would ... N steps`)."""
    lines = text.splitlines()
    start = lines.index(DRY_RUN_HEAD) + 1
    end = next(i for i in range(start, len(lines)) if not re.match(r"^(\s|- |[\w]+:( |$))", lines[i]))
    cfg = yaml.safe_load("\n".join(lines[start:end]))
    steps = next(int(m.group(1)) for line in reversed(lines) if (m := re.match(r"^would start .*, (\d+) steps$", line)))
    return Lengths(int(cfg["train"]["batch_size"]), steps, cfg["train"].get("epochs"))


def error_of(text: str) -> str:
    """The `error: ...` line of a stage's output, else its last line."""
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    line = next((ln for ln in reversed(lines) if ln.startswith("error: ")), lines[-1] if lines else "no output")
    return line.removeprefix("error: ")


def read_cache(cache: Path | None) -> dict[str, Any]:
    """The dry runs' lengths kept in `cache`; one that cannot be read (written by an older compare killed while it
    wrote it) is only a cache: its dry runs are run again."""
    try:
        known = json.loads(cache.read_text()) if cache is not None and cache.is_file() else {}
    except (ValueError, UnicodeDecodeError):
        return {}
    return known if isinstance(known, dict) else {}


def measure(stages: list[Stage], jobs: int, fingerprint: str, cache: Path | None,
            shards: dict[str, str] | None = None) -> dict[str, Lengths]:
    """Dry-run each distinct stage command of the first seed (from scratch for fine-tunings: the export it starts
    from does not exist yet); a failing one is this command's one error line. A command already dry-run on the same
    configs and manifests (`fingerprint`) is not run again: its lengths are kept in `cache` (None: not kept).
    `shards` reads a data.shards elsewhere (a --dry-run's labelled subsets, drawn into a temporary folder).
    Returns 'ARM/STAGE' -> lengths."""
    first, nowhere = stages[0].name.split("/")[0], stages[0].run_dir.parents[2] / ".dry-run"  # never written
    moved = {f"data.shards={a}": f"data.shards={b}" for a, b in (shards or {}).items()}
    checks: dict[tuple[str, ...], list[Stage]] = {}
    for s in stages:
        if s.name.startswith(first + "/"):
            cmd = ["init.checkpoint=" if c.startswith("init.checkpoint=") else f"train.run_dir={nowhere}"
                   if c.startswith("train.run_dir=") else moved.get(c, c) for c in s.command[1:]]  # no interpreter
            checks.setdefault(tuple(cmd), []).append(s)
    known = read_cache(cache)
    keys = {cmd: hashlib.sha256(json.dumps([cmd, fingerprint]).encode()).hexdigest() for cmd in checks}
    pool = ThreadPoolExecutor(jobs)
    try:
        results = {cmd: pool.submit(dry_run, [sys.executable, *cmd]) for cmd in checks if keys[cmd] not in known}
        for cmd, future in results.items():
            result = future.result()
            if result.returncode != 0:
                which = checks[cmd][0].name.split("/", 1)[1]
                raise ConfigError(f"{which}: {error_of(result.stderr + result.stdout)}")
            known[keys[cmd]] = list(dataclasses.astuple(parse_dry_run(result.stdout)))
    finally:  # on an error or Ctrl-C the dry runs not started yet are not waited for
        pool.shutdown(wait=False, cancel_futures=True)
    if results and cache is not None:
        make_out_folder(cache.parent)
        write_atomic(cache, json.dumps(known, indent=1) + "\n")  # a compare killed here leaves the old one whole
    return {s.key: Lengths(*known[keys[cmd]]) for cmd, group in checks.items() for s in group}


def set_lengths(setup: Setup, stages: list[Stage], lengths: dict[str, Lengths]) -> dict[str, int]:
    """Give each stage its steps and batch, and the equal-compute arms their epochs: scratch_equal sees as many
    images as the reference MPP arm's pretraining and fine-tuning together, the supervised pretraining as many as
    the MPP pretraining, semi_scratch as many as the MPP pretraining and the first semi arm's fine-tuning (its own
    fine-tuning as configured without one). In a label sweep every fine-tuning makes --finetune-steps at each point,
    or as many as it makes at the first (`label_sweep.same_steps`), and the equal-compute arms are sized per point.
    Returns arm -> epochs set ('arm@point' in a sweep)."""
    ref = setup.reference
    pre = lengths[f"{ref}/pretrain"]
    semi = [a for a in setup.arms if kind(a) == "semi"]
    epochs = {}
    for point in setup.points:
        here = [s for s in stages if s.point == point or (point == setup.points[0] and s.stage == "pretrain")]
        got = {s.key: lengths[s.key] for s in here}
        if point != setup.points[0] and not setup.finetune_steps:  # the other points: the first point's steps
            first = {key: key.replace(f"_{point}", f"_{setup.points[0]}") for key in got}
            got = {key: label_sweep.same_steps(lengths[first[key]].steps, length)
                   if key.endswith(f"/finetune_{point}") and first[key] in lengths else length
                   for key, length in got.items()}
        if setup.finetune_steps:
            got = {key: label_sweep.same_steps(setup.finetune_steps, length) if key.endswith(f"/finetune_{point}")
                   else length for key, length in got.items()}
        ft = got[f"{ref}/{finetune_stage(point)}"]
        targets = {"scratch_equal": pre.batch * pre.steps + ft.batch * ft.steps, "supervised": pre.batch * pre.steps}
        if semi and f"{semi[0]}/{finetune_stage(point)}" in got:
            semi_ft = got[f"{semi[0]}/{finetune_stage(point)}"]
            targets["semi_scratch"] = pre.batch * pre.steps + semi_ft.batch * semi_ft.steps
        for s in here:
            length = got[s.key]
            if (kind(s.arm), s.stage) in EQUAL_COMPUTE:
                per_epoch = length.steps // length.epochs
                target = targets.get(kind(s.arm), pre.batch * pre.steps + length.batch * length.steps)
                e = equal_epochs(target, per_epoch, length.batch)
                epochs[f"{s.arm}@{point}" if point and s.stage == "finetune" else s.arm] = e
                s.overrides.append(f"train.epochs={e}")
                s.steps, s.batch = e * per_epoch, length.batch
            else:
                if length.epochs is not None and length != lengths[s.key]:  # a sweep's point: its own epochs
                    s.overrides.append(f"train.epochs={length.epochs}")
                s.steps, s.batch = length.steps, length.batch
    return epochs


def finetune_stage(point: str) -> str:
    """The fine-tuning stage's name at a point of the label sweep."""
    return f"finetune_{point}" if point else "finetune"


# ---------------------------------------------------------------------------------------------- runs on disk


def finished(stage: Stage) -> bool:
    """The stage's run reached its last step and wrote its export."""
    steps = [int(r["step"]) for r in read_metrics(stage.run_dir) if isinstance(r.get("step"), int)]
    return is_export(stage.run_dir / "export") and bool(steps) and max(steps) >= stage.steps > 0


def check_run_dirs(stages: list[Stage]) -> None:
    """A run directory that exists holds a run of this very command (a rerun resumes or reuses it), else one line
    before anything runs: settings changed under a run must not mix two recipes in one table."""
    for s in stages:
        if not s.run_dir.exists() or not any(s.run_dir.iterdir()):
            continue
        side = s.run_dir / SIDECAR
        if not side.is_file():
            raise ConfigError(f"{s.run_dir} holds something compare did not start: give another --out")
        before = json.loads(side.read_text())["command"]
        now = [s.module, s.config, *s.overrides]
        if before != now:
            changed = [o for o in now if o not in before] or [o for o in before if o not in now] or ["their order"]
            raise ConfigError(f"{s.run_dir} holds a run of other settings (now {changed[0]}): give another --out, or "
                              "remove that run directory to run it again")


class Children:
    """The stages' processes under way. A stop signal to compare (a scheduler's SIGTERM, Ctrl-C, a hang-up) reaches
    each of them as SIGTERM, their preemption signal: they save a checkpoint and exit 75, and compare starts nothing
    new; without it a compare killed with `kill` left its runs training, holding their run directories."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running: set[subprocess.Popen] = set()
        self.stopped_by: int | None = None

    def run(self, command: list[str], **popen: Any) -> int:
        """Run `command` to its end (not at all once a stop signal came: 128 + its number); its exit status."""
        return self.capture(command, **popen).returncode

    def capture(self, command: list[str], **popen: Any) -> subprocess.CompletedProcess:
        """`run`, with what it printed to the pipes `popen` asks for (a dry run's output)."""
        with self.lock:
            if self.stopped_by is not None:
                return subprocess.CompletedProcess(command, 128 + self.stopped_by, "", "")
            proc = subprocess.Popen(command, **popen)
            self.running.add(proc)
        try:
            out, err = proc.communicate()
            return subprocess.CompletedProcess(command, proc.returncode, out, err)
        finally:
            with self.lock:
                self.running.discard(proc)

    def stop(self, signum: int, frame: Any = None) -> None:
        """The signal handler: stop every stage under way (once each is enough: later signals change nothing)."""
        if self.stopped_by is None:
            self.stopped_by = signum
            with self.lock:
                for proc in self.running:
                    if proc.poll() is None:
                        proc.send_signal(signal.SIGTERM)

    def stop_signals(self) -> contextlib.AbstractContextManager[None]:
        """`stop` handles the stop signals while the stages run."""
        return handling_stop_signals(self.stop)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)
children = Children()


@contextlib.contextmanager
def handling_stop_signals(handler: Callable[[int, Any], None]) -> Iterator[None]:
    """`handler` handles the STOP_SIGNALS in the main thread (the previous handlers come back), but not one that
    compare's parent set to be ignored: `nohup` ignores SIGHUP so that a sweep outlives its terminal, and a background
    job of a non-interactive shell ignores SIGINT."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS if signal.getsignal(sig) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for sig, before in previous.items():
            signal.signal(sig, before)


def launch(stage: Stage, log: Path, threads: int) -> int:
    """Run one stage as a subprocess, its output appended to `log`; its exit status."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    with log.open("a") as f:
        f.write(f"$ {shlex.join(stage.command)}\n")
        f.flush()
        return children.run(stage.command, stdout=f, stderr=subprocess.STDOUT, env=env)


@dataclass
class Progress:
    """Progress over the runs of one invocation: which run of how many, elapsed, and an ETA from the runs finished
    so far: a run's time fitted as a start-up cost plus a cost per planned training image (steps x batch)."""

    total: int
    jobs: int
    start: float = field(default_factory=time.monotonic)
    started: dict[str, float] = field(default_factory=dict)
    history: list[tuple[int, float]] = field(default_factory=list)  # (images, seconds) of the runs finished
    count: int = 0

    def begin(self, stage: Stage) -> str:
        self.count += 1
        self.started[stage.name] = time.monotonic()
        return f"[{self.count}/{self.total}] {stage.name} started"

    def seconds(self, work: int) -> float:
        """A run's expected seconds: a least-squares line through the finished runs (one run: proportional)."""
        n = len(self.history)
        mean_w, mean_t = (sum(h[i] for h in self.history) / n for i in (0, 1))
        var = sum((w - mean_w) ** 2 for w, _ in self.history)
        slope = (sum((w - mean_w) * (t - mean_t) for w, t in self.history) / var if var else 0.0)
        if slope <= 0 or mean_t - slope * mean_w < 0:  # too few or too odd points for a line: proportional
            return work * sum(t for _, t in self.history) / max(1, sum(w for w, _ in self.history))
        return mean_t + slope * (work - mean_w)

    def end(self, stage: Stage, pending: list[Stage], running: list[Stage]) -> str:
        now = time.monotonic()
        took = now - self.started.pop(stage.name)
        self.history.append((stage.work, took))
        left = sum(self.seconds(s.work) for s in pending) + sum(
            max(0.0, self.seconds(s.work) - (now - self.started[s.name])) for s in running)
        eta = left / min(self.jobs, max(1, len(pending) + len(running)))
        return (f"{stage.name} finished in {format_duration(took)}; {self.total - len(pending) - len(running)}/"
                f"{self.total} done, {format_duration(now - self.start)} elapsed, eta {format_duration(eta)}")


def execute(stages: list[Stage], out: Path, jobs: int, threads: int) -> None:
    """Run the stages not finished yet, `jobs` at a time, each after the stage it starts from; stops starting new
    ones at the first failure and raises it as one line once the running ones end. A stop signal stops the running
    ones (each saves a checkpoint) and ends compare with status 75: the same command resumes."""
    todo = [s for s in stages if not finished(s)]
    reused = len(stages) - len(todo)
    if reused:
        print(f"{reused} of {len(stages)} runs finished earlier: reused", flush=True)
    if not todo:
        return
    logs = make_out_folder(out / "logs")
    users = {id(s.needs) for s in todo if s.needs}
    pending = sorted(todo, key=lambda s: (id(s) not in users, -s.work))  # what others start from first, then long
    progress, running, failed, stopped = Progress(len(todo), jobs), {}, None, []
    print(f"{len(todo)} runs, {jobs} at a time, {threads} thread(s) each; logs in {logs}", flush=True)
    children.stopped_by = None
    with children.stop_signals(), ThreadPoolExecutor(jobs) as pool:
        while pending or running:
            waiting = [*pending, *running.values()]  # a stage starts once the one it starts from is done
            go = failed is None and children.stopped_by is None
            for s in [s for s in pending if go and s.needs not in waiting][:jobs - len(running)]:
                pending.remove(s)
                make_out_folder(s.run_dir, "train.run_dir")
                write_atomic(s.run_dir / SIDECAR, json.dumps({"command": [s.module, s.config, *s.overrides]}) + "\n")
                print(progress.begin(s), flush=True)
                log = logs / (s.name.replace("/", "_") + ".log")
                running[pool.submit(launch, s, log, threads)] = s
            if not running:
                break
            done, _ = wait(list(running), return_when=FIRST_COMPLETED)
            for future in done:
                s, status = running.pop(future), future.result()
                log = logs / (s.name.replace("/", "_") + ".log")
                if status == 0:
                    print(progress.end(s, pending, list(running.values())), flush=True)
                elif children.stopped_by is not None and (status == EXIT_PREEMPTED or status > 128 or status < 0):
                    stopped.append((s.name, status))  # saved (75), or stopped before anything was saved
                elif failed is None:
                    failed = (f"{s.name} failed with exit status {status}: "
                              f"{error_of(log.read_text())} (log: {log}); run the same command to resume")
                    print(f"{s.name} failed; waiting for the runs under way", flush=True)
    if failed:
        raise ConfigError(failed)
    if children.stopped_by is not None:
        saved = [name for name, status in stopped if status == EXIT_PREEMPTED]
        raise Stopped(f"compare stopped by {signal.Signals(children.stopped_by).name}: "
                      f"{len(stopped)} run(s) under way stopped, {len(saved)} of them with a checkpoint saved"
                      f"{' (' + ', '.join(saved) + ')' if saved else ''}; {len(pending) + len(stopped)} of "
                      f"{len(todo)} not finished; run the same command to resume")


# ------------------------------------------------------------------------------------------------------ the table


def final_top1(run_dir: Path) -> float | None:
    """The last `val_top1` a run logged (its evaluation after the last step), or None."""
    values = [r["val_top1"] for r in read_metrics(run_dir) if isinstance(r.get("val_top1"), (int, float))]
    return float(values[-1]) if values else None


def images_seen(run_dir: Path) -> int:
    """Training images of a run: its last step x its global batch (config.yaml)."""
    steps = [int(r["step"]) for r in read_metrics(run_dir) if isinstance(r.get("step"), int)]
    path = run_dir / "config.yaml"
    cfg = yaml.safe_load(path.read_text()) if path.is_file() else {}
    return max(steps, default=0) * int(((cfg or {}).get("train") or {}).get("batch_size") or 0)


def mean_std(values: list[float]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (None for fewer than 2 values)."""
    if not values:
        return None, None
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else None)


def differences(arms: list[str]) -> list[tuple[str, str]]:
    """(a, b) pairs shown as a - b: the reference MPP arm against every other arm that is not MPP, and every other MPP
    arm against the reference and every baseline (scratch, equal compute, supervised; not the probes, which read
    the reference's pretraining)."""
    mpp = [a for a in arms if kind(a) == "mpp"]
    ref = mpp[0]
    baselines = [b for b in arms if kind(b) not in ("mpp", "probe", "semi")]
    pairs = [(ref, b) for b in arms if kind(b) != "mpp"]
    for variant in mpp[1:]:
        pairs += [(variant, ref)] + [(variant, b) for b in baselines]
    for semi in [a for a in arms if kind(a) == "semi"]:  # MPP with the pool against the baselines given it or more
        pairs += [(semi, b) for b in arms if kind(b) in ("semi_scratch", "supervised", "scratch_equal")]
    return pairs


def table(top1: dict[str, dict[int, float | None]], arms: list[str], seeds: list[int]) -> dict[str, Any]:
    """The paired table from each arm's final test top-1 per seed: per arm and per difference (paired by seed, on
    the seeds where both arms have a result), the values per seed and their mean and sample std."""
    rows: dict[str, Any] = {"arms": {}, "differences": {}}
    for arm in arms:
        values = {s: top1[arm].get(s) for s in seeds}
        mean, std = mean_std([v for v in values.values() if v is not None])
        rows["arms"][arm] = {"per_seed": values, "mean": mean, "std": std}
    for a, b in differences(arms):
        values = {s: top1[a][s] - top1[b][s] for s in seeds
                  if top1[a].get(s) is not None and top1[b].get(s) is not None}
        mean, std = mean_std(list(values.values()))
        rows["differences"][f"{a} - {b}"] = {"per_seed": values, "mean": mean, "std": std}
    return rows


def shown(mean: float | None, std: float | None, signed: bool = False) -> str:
    if mean is None:
        return "–"
    text = f"{mean:+.3f}" if signed else f"{mean:.3f}"
    return text + (f" ± {std:.3f}" if std is not None else "")


def markdown(report: dict[str, Any]) -> str:
    """The report as markdown: the arms, then the differences paired by seed, then the notes."""
    seeds = report["seeds"]
    cells = " | ".join(f"seed {s}" for s in seeds)
    lines = [f"Final test top-1 on {report['test_samples']:,} images ({report['test']}:{report['test_split']}), "
             f"seeds {', '.join(map(str, seeds))}; mean ± sample std over seeds", "",
             f"| arm | mean ± std | {cells} | training images | minutes |", "|" + " --- |" * (len(seeds) + 4)]
    for arm, row in report["table"]["arms"].items():
        per = " | ".join("–" if row["per_seed"][s] is None else f"{row['per_seed'][s]:.3f}" for s in seeds)
        cost = report["cost"][arm]
        lines.append(f"| {arm} | {shown(row['mean'], row['std'])} | {per} | {cost['images']:,} | "
                     f"{cost['minutes']:.1f} |")
    lines += ["", "Differences, paired by seed", "", f"| difference | mean ± std | {cells} |",
              "|" + " --- |" * (len(seeds) + 2)]
    for name, row in report["table"]["differences"].items():
        per = " | ".join(f"{row['per_seed'][s]:+.3f}" if s in row["per_seed"] else "–" for s in seeds)
        lines.append(f"| {name} | {shown(row['mean'], row['std'], signed=True)} | {per} |")
    lines += ["", "Training images and minutes: per seed (mean), of every run an arm's result depends on (probe, "
              "semi: the reference MPP pretraining and their fine-tuning); minutes of training as the runs logged "
              "them (elapsed_s), start-up not included."]
    if report["epochs"]:
        lines.append("Equal-compute epochs: " + ", ".join(f"{a} {e}" for a, e in report["epochs"].items()) + ".")
    lines += [f"Note: {n}" for n in report["notes"]]
    if "monitors" in report:
        lines += ["", monitor_ranks.monitor_markdown(report["monitors"]).rstrip("\n")]
    return "\n".join(lines) + "\n"


def write_csv(report: dict[str, Any], path: Path) -> None:
    """One row per arm and per difference: what, name, mean, std, then one column per seed; a label sweep's rows
    start with their point."""
    seeds, points = report["seeds"], report.get("points")
    with open_out_file(path) as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow([*(["point"] if points else []), "what", "name", "mean", "std", *[f"seed_{s}" for s in seeds]])
        for point, part in (points or {"": report}).items():
            for what, rows in (("arm", part["table"]["arms"]), ("difference", part["table"]["differences"])):
                for name, row in rows.items():
                    w.writerow([*([point] if points else []), what, name, row["mean"], row["std"],
                                *[row["per_seed"].get(s) for s in seeds]])


def make_report(setup: Setup, of_arm: dict[tuple[int, str, str], list[Stage]], epochs: dict[str, int],
                point: str = "") -> dict[str, Any]:
    """Read every arm's result at one point of the sweep from its run directories; the table, costs and notes as
    one JSON-able dict."""
    top1: dict[str, dict[int, float | None]] = {a: {} for a in setup.arms}
    cost = {}
    notes = list(setup.notes) if point in ("", setup.points[0]) else []
    for arm in setup.arms:
        images, minutes = [], []
        for seed in setup.seeds:
            stages = of_arm.get((seed, arm, point), [])
            if not stages:  # not run at this point
                top1[arm][seed] = None
                continue
            top1[arm][seed] = final_top1(stages[-1].run_dir)
            if top1[arm][seed] is None:
                notes.append(f"{stages[-1].name}: no test result in {stages[-1].run_dir}")
            images.append(sum(images_seen(s.run_dir) for s in stages))
            minutes.append(sum((wall_time_s(read_metrics(s.run_dir)) or 0.0) / 60 for s in stages))
        cost[arm] = {"images": round(statistics.mean(images or [0])), "minutes": statistics.mean(minutes or [0.0])}
    runs = {s.name: str(s.run_dir) for (_, _, p), stages in of_arm.items() if p == point for s in stages}
    here = {k: v for k, v in epochs.items() if "@" not in k or k.endswith(f"@{point}")}
    mpp = [(arm, seed, of_arm[seed, arm, point][0].run_dir, top1[arm][seed]) for arm in setup.arms
           if kind(arm) == "mpp" for seed in setup.seeds if (seed, arm, point) in of_arm]
    monitors = monitor_ranks.monitor_table(mpp)
    return {"test": setup.test, "test_split": setup.test_split, "test_samples": setup.test_samples,
            "seeds": setup.seeds, "table": table(top1, setup.arms, setup.seeds), "cost": cost, "epochs": here,
            "notes": notes, "runs": runs, **({"monitors": monitors} if monitors["spearman"] else {})}


def has_result(report: dict[str, Any]) -> bool:
    return any(v is not None for row in report["table"]["arms"].values() for v in row["per_seed"].values())


def sweep_report(setup: Setup, of_arm: dict[tuple[int, str, str], list[Stage]], epochs: dict[str, int],
                 ) -> dict[str, Any]:
    """The label sweep's report: each point's (as `make_report`), and the curve (each arm's mean and std per point,
    at labels per class)."""
    points = {p: make_report(setup, of_arm, epochs, p) for p in setup.points}
    curve = {"seeds": setup.seeds,
             "points": [{"name": p, "per_class": label_sweep.labels_per_class(setup.labelled, p)} for p in points],
             "arms": {a: {p: (r["table"]["arms"][a]["mean"], r["table"]["arms"][a]["std"]) for p, r in points.items()}
                      for a in setup.arms}}
    return {"seeds": setup.seeds, "points": points, "curve": curve}


def write_report(report: dict[str, Any], out: Path) -> str:
    """compare.md, compare.csv and compare.json in `out` (a sweep: the curve first, then each point's tables, and
    labels.png); returns the markdown."""
    make_out_folder(out)
    if "points" in report:
        parts = [label_sweep.curve_markdown(report["curve"])]
        for point, part in report["points"].items():
            parts.append(f"\n## {point}: {label_sweep.labels_per_class_text(report['curve'], point)}\n\n"
                         + markdown(part))
        text = "\n".join(parts)
        label_sweep.plot_curve(report["curve"], out / "labels.png", f"{out.name}: top-1 against labels per class")
    else:
        text = markdown(report)
    write_csv(report, out / "compare.csv")
    (out / "compare.md").write_text(text)
    (out / "compare.json").write_text(json.dumps(report, indent=1) + "\n")
    return text


@contextlib.contextmanager
def stopped_before_the_runs() -> Iterator[None]:
    """A stop signal while compare draws subsets or dry-runs the stages (a minute under load), before any run starts
    (a terminal's Ctrl-C, a scheduler's SIGTERM): the dry runs under way are stopped, and compare ends with one line
    and status 128 + the signal's number, not a traceback or the signal's own death (an interrupted draw is drawn
    again whole by the same command; a draw the signal did not reach ends first). The handler only stops: an
    exception raised from it into threading's own code (the dry runs' pool) breaks its locks. The error of a dry run
    or a draw the signal stopped (or of one never started after it) becomes the stop's line here."""
    with handling_stop_signals(children.stop):
        try:
            yield
        except UserError:
            if children.stopped_by is None:
                raise
        if children.stopped_by is not None:
            raise stopped_while_checking(children.stopped_by) from None


def stopped_while_checking(signum: int) -> Stopped:
    """The line of a compare stopped before any run started."""
    return Stopped(f"compare stopped by {signal.Signals(signum).name} while checking its runs: no run was started; "
                   "run the same command to start", 128 + signum)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Check, plan, run what is not finished, and print and write the table; returns the report."""
    setup, args = check_args(argv)
    for note in setup.notes:
        print(f"note: {note}", flush=True)
    stages, of_arm = plan_runs(setup)
    epochs: dict[str, int] = {}
    sweep = setup.points != [""]
    if not (args.dry_run or args.report_only):  # one compare at a time runs in DIR (the runs lock their own too);
        lock_run_dir(make_out_folder(setup.out), "--out")  # a table of what is there so far may be made meanwhile
    if not args.report_only:
        started = time.monotonic()
        moved, keep = {}, None
        with stopped_before_the_runs():
            if sweep and args.dry_run:  # the first seed's subsets, for the stages' dry runs; nothing under --out
                moved, keep = label_sweep.draft_subsets(setup.labelled, setup.points, setup.seeds[0], setup.out)
            elif sweep:
                label_sweep.make_subsets(setup.labelled, setup.points, setup.seeds, setup.out)
            points = f" x {len(setup.points)} points" if sweep else ""
            print(f"checking {len(stages)} runs ({len(setup.arms)} arms x {len(setup.seeds)} seeds{points}) with the "
                  "stages' own --dry-run ...", flush=True)
            lengths = measure(stages, args.jobs, setup.fingerprint, None if args.dry_run else setup.out / DRY_RUNS,
                              moved)
            epochs = set_lengths(setup, stages, lengths)
            check_run_dirs(stages)
        print(f"checked in {format_duration(time.monotonic() - started)}"
              + "".join(f"; {arm}: {e} epochs (equal compute)" for arm, e in epochs.items()), flush=True)
        if args.dry_run:
            for s in stages:
                print(f"{s.name}: {s.steps} steps x {s.batch}{' (finished)' if finished(s) else ''}\n  "
                      f"{shlex.join(s.command)}")
            if keep is not None:
                keep.cleanup()
            return {}
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        execute(stages, setup.out, args.jobs, args.threads or max(1, cores // args.jobs))
    report = sweep_report(setup, of_arm, epochs) if sweep else make_report(setup, of_arm, epochs)
    if not any(has_result(r) for r in (report["points"].values() if sweep else [report])):
        raise ConfigError(f"no run in {setup.out} has a test result yet: run the same command without --report-only")
    text = write_report(report, setup.out)
    figure = ", labels.png" if sweep else ""
    print("\n" + text + f"\nwrote {setup.out / 'compare.md'}, compare.csv, compare.json{figure}", flush=True)
    return report


if __name__ == "__main__":
    run_main(main)

"""`python -m experiments.compare --unlabelled SHARDS --labelled SHARDS --test SHARDS[:SPLIT] --out DIR ...`: does MPP
pretraining earn its keep? Per seed, each arm's product commands (`python -m pretrain`, `python -m finetune`) run
as subprocesses into their own run directories; the table pairs the arms' final test top-1 by seed. Resumable.
See docs/experiments.md.

The command: its flags and their checks, and the order of things (check, plan, dry-run, run, report). The arms and
their plan are in experiments/compare_arms.py, the stages' processes (dry runs, runs, stop signals) in
experiments/run_scheduler.py, the report in experiments/compare_report.py, the label sweep in
experiments/label_sweep.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import time
from pathlib import Path
from typing import Any

from experiments import label_sweep
from experiments.compare_arms import (
    DEFAULT_ARMS,
    EQUAL_COMPUTE,
    KINDS,
    Setup,
    Stage,
    check_no_gate,
    config_semi,
    kind,
    parse_arms,
    parse_overrides,
    plan_runs,
    set_lengths,
)
from experiments.compare_report import has_result, make_report, sweep_report, write_report
from experiments.run_scheduler import (
    DRY_RUNS,
    check_run_dirs,
    error_of,
    execute,
    finished,
    measure,
    read_cache,
    stopped_before_the_runs,
    write_cache,
)
from vit_mpp.cli import ArgumentParser
from vit_mpp.config.engine import ConfigError
from vit_mpp.data.lineage import Keys, SplitOf, shared_samples
from vit_mpp.data.manifest import check_manifest, load_split, manifest_classes, manifest_file, read_manifest
from vit_mpp.data.training_data import shard_identity
from vit_mpp.errors import UserError
from vit_mpp.processes.exits import run_main
from vit_mpp.processes.run_dir_lock import check_not_locked, lock_run_dir
from vit_mpp.progress import format_duration
from vit_mpp.tools.args import check_out_folder, make_out_folder


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


def check_val(value: str, apart: list[tuple[str, str, str]], labelled_info: dict[str, Any],
              ) -> tuple[str, str, dict[str, Any]]:
    """--val SHARDS:SPLIT checked: a labelled split of the classes learned, that shares no shard with the sets it
    must stand apart from (`apart`: (flag, location, split): --test's, each seed's --labelled train split); returns
    (location, split, manifest)."""
    val, split = parse_test(value)
    if value.startswith(":"):
        raise ConfigError(f"--val {value}: give the shards before the split, SHARDS:SPLIT")
    if split is None:
        raise ConfigError(f"--val {value}: give the split too, SHARDS:SPLIT (a subset's own images are its train "
                          "split; its val names the source's)")
    info = check_shards(val, split, "--val", labelled=True)
    if manifest_classes(info) != manifest_classes(labelled_info):
        raise ConfigError(f"--val {val} counts {manifest_classes(info)} classes, --labelled "
                          f"{manifest_classes(labelled_info)}: the classifier is validated on the classes it learns")
    shards = {shard_identity(u) for u in load_split(val, split)[0].urls}
    for flag, location, its_split in apart:
        if shared := [u for u in load_split(location, its_split)[0].urls if shard_identity(u) in shards]:
            raise ConfigError(f"--val {value} holds the shard {shared[0]} of {flag}: validate on a set apart from "
                              + ("the one the table reports" if flag == "--test" else "the images the runs train on "
                                 "(build-shards subset --exclude draws one)"))
    return val, split, info


def val_split_of(setup: Setup) -> SplitOf:
    """--val's split with its manifest, read once for the checks below."""
    return SplitOf(setup.val, setup.val_split, read_manifest(setup.val))


def val_overlap(val: SplitOf, labelled: str | Path, known: Keys) -> int:
    """How many of --val's images the train split of `labelled` holds, as far as the subset records tell
    (vit_mpp/data/lineage.py: sets of unrelated origins share none); --val's keys read once per `known`."""
    return shared_samples(SplitOf(str(labelled), "train", read_manifest(labelled)), val, known=known)


def check_val_samples(setup: Setup) -> None:
    """--val holds none of the images the fine-tunings train on: each seed's --labelled without a sweep (a sweep's
    subsets are checked as they are drawn, `check_subsets_apart`); at point all, a note."""
    val, known = val_split_of(setup), {}
    if setup.points == [""]:
        for seed in setup.seeds:
            labelled = setup.labelled.replace("{seed}", str(seed))
            if n := val_overlap(val, labelled, known):
                raise ConfigError(f"--val {setup.val}:{setup.val_split} holds {n} of the images of --labelled "
                                  f"{labelled} (drawn from the same source): validate on a set apart from the images "
                                  "the runs train on (build-shards subset --exclude draws one)")
    elif "all" in setup.points and (n := val_overlap(val, setup.labelled, known)):
        setup.notes.append(f"at point all the fine-tunings train on --labelled whole, {n} of --val {setup.val}'s "
                           "images among them")


def check_subsets_apart(setup: Setup, root: Path, seeds: list[int]) -> None:
    """Each label-sweep subset drawn under `root` holds none of --val's images (drawn apart from it when --val is a
    subset of --labelled; a --val drawn otherwise from the same source may not be)."""
    if not setup.val:
        return
    val, known = val_split_of(setup), {}
    for point in (p for p in setup.points if p.startswith("k")):
        for seed in seeds:
            if n := val_overlap(val, label_sweep.subset_folder(root, point, seed), known):
                raise ConfigError(f"--val {setup.val}:{setup.val_split} holds {n} of the images of the subset "
                                  f"{point} of seed {seed} (drawn from the same source): draw --val from --labelled "
                                  "(build-shards subset LABELLED VAL ...), and the sweep draws its subsets apart")


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
    p.add_argument("--val", metavar="SHARDS:SPLIT", default=None,
                   help="what every fine-tuning validates on (its logs, its best export, semi.gate) instead of "
                   "--test, which then scores each final export once (python -m finetune.evaluate): a labelled set "
                   "apart from --labelled and --test (build-shards subset --exclude); needed for semi.gate")
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
    p.add_argument("--finetune-steps", nargs="+", default=None, metavar="N|ARM=N",
                   help="with --labels-per-class: each fine-tuning makes about N steps at every point (its epochs "
                   "set per point), and ARM=N gives one arm its own (mpp-long=4800: plain fine-tuning given the steps "
                   "of a longer recipe); default: as many as the fine-tuning config makes at the first point")
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
    for flag, value in (("--jobs", args.jobs), ("--threads", args.threads)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} {value}: give at least 1 "
                              f"({'runs at a time' if flag == '--jobs' else 'threads per run'})")
    if len(set(args.seeds)) != len(args.seeds) or min(args.seeds) < 0:
        raise ConfigError(f"--seeds must be distinct and >= 0, got {' '.join(map(str, args.seeds))}")
    arms = parse_arms(args.arms)
    overrides = parse_overrides(args.overrides, arms, own_val=args.val is not None)
    for flag, path in (("--pretrain-config", args.pretrain_config), ("--finetune-config", args.finetune_config)):
        if not Path(path).is_file():
            raise ConfigError(f"{flag} {path}: no such file")
    if args.val is None:
        check_no_gate(args.finetune_config)
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
    apart = [("--test", test, split), *(("--labelled", args.labelled.replace("{seed}", str(s)), "train")
                                        for s in args.seeds)]
    val, val_split, val_info = check_val(args.val, apart, labelled_info) if args.val is not None else ("", "", {})
    if val:
        read.append(val_info)
    setup = Setup(args.unlabelled, args.labelled, test, split, test_info["splits"][split]["num_samples"],
                  "val" in pool["splits"], arms, args.seeds,
                  {"pretrain": args.pretrain_config, "finetune": args.finetune_config}, overrides, args.out)
    contents = [Path(args.pretrain_config).read_text(), Path(args.finetune_config).read_text(), *read, test_info]
    setup.config_pool = bool(config_semi(args.finetune_config).get("pool"))
    setup.val, setup.val_split = val, val_split
    setup.fingerprint = hashlib.sha256(json.dumps(contents, sort_keys=True).encode()).hexdigest()
    setup.points = label_sweep.parse_points(args.labels_per_class, args.labelled)
    setup.finetune_steps, setup.arm_steps = parse_finetune_steps(args.finetune_steps, setup)
    if val_split == "train" and setup.points != [""] and label_sweep.drawn_from(val_info, args.labelled):
        setup.apart = val  # the sweep's subsets are drawn apart from the validation images
    if val:
        check_val_samples(setup)
    if "all" in setup.points and not all(setup.runs(a, "all") for a in setup.arms):
        setup.notes.append("semi-supervised arms not run at point all: their pool, --unlabelled, is the labelled set "
                           "itself there")
    if not manifest_classes(pool) and any(kind(a) == "supervised" for a in arms):
        setup.arms = [a for a in arms if kind(a) != "supervised"]
        setup.notes.append(f"supervised arm skipped: the pool {args.unlabelled} carries no labels (its manifest "
                           "counts no classes)")
    return setup, args


def parse_finetune_steps(values: list[str] | None, setup: Setup) -> tuple[int | None, dict[str, int]]:
    """`--finetune-steps N ARM=N ...` -> (every fine-tuning's steps, or None; arm -> its own)."""
    if not values:
        return None, {}
    if setup.points == [""]:
        raise ConfigError(f"--finetune-steps {' '.join(values)}: it sets the fine-tuning length of a label sweep "
                          "(--labels-per-class); a single comparison's is its config's train.epochs (--set "
                          "finetune:train.epochs=N)")
    every, own = None, {}
    for value in (v for item in values for v in item.split(",") if v):
        arm, sep, count = value.rpartition("=")
        if not count.isdigit() or int(count) < 1:
            raise ConfigError(f"--finetune-steps {value}: give a number of optimizer steps >= 1, alone or as ARM=N")
        if not sep:
            every = int(count)
        elif arm not in setup.arms:
            raise ConfigError(f"--finetune-steps {value}: {arm} is not an arm of --arms ({', '.join(setup.arms)})")
        elif (kind(arm), "finetune") in EQUAL_COMPUTE:
            raise ConfigError(f"--finetune-steps {value}: compare gives {arm} its length itself (equal compute)")
        else:
            own[arm] = int(count)
    return every, own


def run_plan(setup: Setup, args: Any, stages: list[Stage]) -> dict[str, int]:
    """Check every run (the first seed's subsets drawn into a temporary folder, each stage's own --dry-run, the run
    directories), and only then write under --out: take it (one compare at a time; the runs lock their own too),
    draw the subsets, keep the dry runs' lengths, and run what is not finished; with --dry-run print the runs
    instead. Returns the equal-compute epochs."""
    started, sweep, cache = time.monotonic(), setup.points != [""], setup.out / DRY_RUNS
    if not args.dry_run:
        check_not_locked(setup.out, "--out")  # a second compare on DIR: its line now, not after a minute of checks
    with stopped_before_the_runs():
        moved, draft = label_sweep.draft_subsets(setup.labelled, setup.points, setup.seeds[0], setup.out,
                                                 setup.apart) if sweep else ({}, None)
        try:
            if draft is not None:
                check_subsets_apart(setup, Path(draft.name), setup.seeds[:1])
            points = f" x {len(setup.points)} points" if sweep else ""
            print(f"checking {len(stages)} runs ({len(setup.arms)} arms x {len(setup.seeds)} seeds{points}) with the "
                  "stages' own --dry-run ...", flush=True)
            known = read_cache(cache)
            epochs = set_lengths(setup, stages, measure(stages, args.jobs, setup.fingerprint, known, moved))
            check_run_dirs(stages)
        finally:
            if draft is not None:
                draft.cleanup()
        print(f"checked in {format_duration(time.monotonic() - started)}"
              + "".join(f"; {arm}: {e} epochs (equal compute)" for arm, e in epochs.items()), flush=True)
        if args.dry_run:
            for s in stages:
                print(f"{s.name}: {s.steps} steps x {s.batch}{' (finished)' if finished(s) else ''}\n  "
                      f"{shlex.join(s.command)}" + (f"\n  then {shlex.join(s.score_command)}" if s.score_command
                                                    else ""))
            return epochs
        lock_run_dir(make_out_folder(setup.out), "--out")  # a table of what is there so far may be made meanwhile
        write_cache(cache, known)
        if sweep:
            label_sweep.make_subsets(setup.labelled, setup.points, setup.seeds, setup.out, setup.apart)
            check_subsets_apart(setup, setup.out, setup.seeds)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    execute(stages, setup.out, args.jobs, args.threads or max(1, cores // args.jobs))
    return epochs


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Check, plan, run what is not finished, and print and write the table; returns the report."""
    setup, args = check_args(argv)
    for note in setup.notes:
        print(f"note: {note}", flush=True)
    stages, of_arm = plan_runs(setup)
    epochs: dict[str, int] = {}
    sweep = setup.points != [""]
    if not args.report_only:
        epochs = run_plan(setup, args, stages)
        if args.dry_run:
            return {}
    report = sweep_report(setup, of_arm, epochs) if sweep else make_report(setup, of_arm, epochs)
    if not any(has_result(r) for r in (report["points"].values() if sweep else [report])):
        raise ConfigError(f"no run in {setup.out} has a test result yet: run the same command without --report-only")
    text = write_report(report, setup.out)
    figure = ", labels.png" if sweep else ""
    print("\n" + text + f"\nwrote {setup.out / 'compare.md'}, compare.csv, compare.json{figure}", flush=True)
    return report


if __name__ == "__main__":
    run_main(main)

"""Does MPP pretraining help? Pretrained vs from-scratch fine-tuning on real images (scikit-learn's digits).

    python experiments/pretrain_vs_scratch.py                   # the main comparison, 3 seeds (see docs/results.md)
    python experiments/pretrain_vs_scratch.py --ablations       # plus the target and mask-ratio ablations
    python experiments/pretrain_vs_scratch.py --seeds 0 --pretrain-steps 200 --finetune-epochs 10   # a quick look
    python experiments/pretrain_vs_scratch.py --data-only --seeds 0   # only the data the digits configs read

What it does, with the real commands as subprocesses (so it measures the product, not a re-implementation):

1. Writes the 1,797 digits (8x8, 17 grey levels) as PNGs upsampled to --size with nearest neighbour, in a
   class-folder tree `images/{train,val}/<digit>/<index>.png` with a fixed stratified split (--val-fraction,
   split seed 0, the same for every run), then `build-shards --existing-splits` on it.
2. Per seed: `python -m pretrain --config configs/pretrain/digits.yaml` on ALL training images, labels unused.
3. Per seed: the labelled subset (--labels-per-class images of each digit, drawn with that seed; 0 = all) is
   written as shards, and `python -m finetune --config configs/finetune/digits.yaml` runs from the pretrained
   encoder and, with the same steps and recipe, from scratch; and linear probes of the pretrained encoder (on the
   [class] token and on the mean of the patch tokens; --no-probe skips them).
4. Reads each run's `metrics.jsonl` and prints one table: top-1 on the 360 validation images (mean +- sample
   standard deviation over seeds, and every seed), the paired difference, and minutes of wall time per run; with a
   logistic regression on the raw pixels of the same labelled images as a reference.
5. Two checks on --extra-seeds: both arms fine-tuned on every training label, and a from-scratch run given about the
   pretrained arm's total training images (is pretraining more than extra compute?). --ablations adds the
   mpp.target and mpp.mask_ratio ablations (pretrained for --ablation-steps, then fine-tuned like the main runs).

Runs go to runs/experiments/digits/ (gitignored); each run directory is removed before its run, so numbers are
always fresh, unless --reuse keeps the finished ones (to add seeds or arms to an earlier run). --jobs runs that
many processes at once, each with cores / jobs threads: on 2 cores two single-threaded runs of a model this small
get more done than one two-threaded run.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
PRETRAIN_CONFIG = "configs/pretrain/digits.yaml"
FINETUNE_CONFIG = "configs/finetune/digits.yaml"
WALL_FILE = "bench_wall.json"  # written into each run directory: its wall time, for --report-only
ABLATIONS = {  # name -> pretrain overrides; each is pretrained at --ablation-steps and fine-tuned like the main runs
    "mean_color, 50%": ["mpp.target=mean_color", "mpp.mask_ratio=0.5"],
    "pixels_4x4, 50%": ["mpp.target=pixels_4x4", "mpp.mask_ratio=0.5"],
    "l2, 50%": ["mpp.target=l2", "mpp.mask_ratio=0.5"],
    "mean_color, 15%": ["mpp.target=mean_color", "mpp.mask_ratio=0.15"],
}


def write_digits(root: Path, size: int, val_fraction: float) -> dict[str, list[tuple[str, int]]]:
    """The digits as PNGs in `root/{train,val}/<digit>/<index>.png`; returns split -> [(relative path, label)].

    Grey levels 0..16 map to 0..255; nearest-neighbour upsampling keeps the 8x8 pixels as sharp squares and adds no
    made-up detail (at 16x16 a 4x4 patch is exactly 2x2 original pixels).
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    pixels = np.rint(digits.images * (255 / 16)).astype(np.uint8)  # (1797, 8, 8)
    index = np.arange(len(pixels))
    train_idx, val_idx = train_test_split(index, test_size=val_fraction, stratify=digits.target, random_state=0)
    items: dict[str, list[tuple[str, int]]] = {}
    for split, idx in (("train", train_idx), ("val", val_idx)):
        items[split] = []
        for i in sorted(idx.tolist()):
            label = int(digits.target[i])
            rel = f"{split}/{label}/{i:04d}.png"
            path = root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(pixels[i], mode="L").resize((size, size), Image.NEAREST).save(path)
            items[split].append((rel, label))
    return items


def labelled_subset(items: dict[str, list[tuple[str, int]]], per_class: int, seed: int) -> list[tuple[str, int]]:
    """`per_class` training images of each digit, drawn with `seed` (0: all of them)."""
    if per_class <= 0:
        return list(items["train"])
    rng = np.random.default_rng(seed)
    chosen = []
    for label in sorted({lab for _, lab in items["train"]}):
        paths = [it for it in items["train"] if it[1] == label]
        chosen += [paths[j] for j in sorted(rng.permutation(len(paths))[:per_class].tolist())]
    return chosen


def pixel_baseline(items: dict[str, list[tuple[str, int]]], per_class: int, seed: int) -> float:
    """Validation top-1 of a logistic regression on the raw 64 pixels, trained on the same labelled subset: a
    reference for what the labels alone give on this easy dataset."""
    from sklearn.datasets import load_digits
    from sklearn.linear_model import LogisticRegression

    x, y = load_digits(return_X_y=True)
    train = [int(Path(p).stem) for p, _ in labelled_subset(items, per_class, seed)]  # file stem = sklearn index
    val = [int(Path(p).stem) for p, _ in items["val"]]
    clf = LogisticRegression(max_iter=5000).fit(x[train] / 16, y[train])
    return float((clf.predict(x[val] / 16) == y[val]).mean())


def build_shards(source: Path, out: Path) -> None:
    """`build-shards` with the source's own train/val splits, PNG bytes kept as they are."""
    # `python -m data_tools.cli` is the `build-shards` command, without relying on the venv's bin/ on PATH.
    cmd = [sys.executable, "-m", "data_tools.cli", str(source), str(out), "--existing-splits",
           "--format", "png", "--shard-size", "250", "--min-side", "8", "--max-side", "0", "--workers", "1",
           "--overwrite"]
    subprocess.run(cmd, check=True, cwd=REPO, capture_output=True, text=True)


def make_data(out: Path, size: int, val_fraction: float, per_class: int, seeds: list[int],
              ) -> tuple[dict[str, list[tuple[str, int]]], dict[int, Path]]:
    """Images, the all-images shards (for pretraining) and each seed's labelled shards: (items, seed -> shards)."""
    images = out / "images"
    shutil.rmtree(images, ignore_errors=True)
    items = write_digits(images, size, val_fraction)
    build_shards(images, out / "shards" / "all")
    if per_class <= 0:
        return items, {s: out / "shards" / "all" for s in seeds}
    labelled = {}
    for seed in seeds:
        # A list source (path, label, split) over the same PNGs: only the train split is subsampled.
        listing = images / f"labelled_k{per_class}_s{seed}.csv"
        with listing.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["path", "label", "split"])
            w.writerows([(p, lab, "train") for p, lab in labelled_subset(items, per_class, seed)])
            w.writerows([(p, lab, "val") for p, lab in items["val"]])
        labelled[seed] = out / "shards" / f"labelled_k{per_class}_s{seed}"
        build_shards(listing, labelled[seed])
    return items, labelled


@dataclass
class Run:
    """One stage process: its command, where it writes, and (after it ran) its wall time."""

    name: str
    module: str
    config: str
    run_dir: Path
    overrides: list[str]
    minutes: float = 0.0
    then: list[Run] = field(default_factory=list)  # runs that need this one's export; started after it


def execute(run: Run, threads: int, log_dir: Path, reuse: bool = False) -> None:
    """Run `python -m <module>` (fresh run directory), then the runs that depend on it. With `reuse`, a run whose
    directory holds a finished run (its wall-time file) is kept, not run again."""
    if reuse and (run.run_dir / WALL_FILE).is_file():
        run.minutes = json.loads((run.run_dir / WALL_FILE).read_text())["minutes"]
        print(f"  {run.name}: reused ({run.minutes:.1f} min when it ran)", flush=True)
        for child in run.then:
            execute(child, threads, log_dir, reuse)
        return
    shutil.rmtree(run.run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", run.module, "--config", run.config, f"train.run_dir={run.run_dir}", *run.overrides]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    log_path = log_dir / (run.name.replace("/", "_") + ".log")
    with log_path.open("w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    run.minutes = (time.perf_counter() - start) / 60
    (run.run_dir / WALL_FILE).write_text(json.dumps({"minutes": run.minutes, "cmd": cmd}))
    print(f"  {run.name}: {run.minutes:.1f} min", flush=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{run.name} failed with status {proc.returncode}: see {log_path}")
    for child in run.then:
        execute(child, threads, log_dir, reuse)


def records(run: Run, key: str) -> list[dict]:
    """The metrics.jsonl records of a run that hold `key`."""
    lines = (run.run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if key in r]


def final_top1(run: Run) -> float:
    return records(run, "val_top1")[-1]["val_top1"]


def best_top1(run: Run) -> float:
    return max(r["val_top1"] for r in records(run, "val_top1"))


def summary(values: list[float]) -> str:
    """'mean +- sample std' (just the value for one seed)."""
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


def signed_summary(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:+.3f}"
    return f"{statistics.mean(values):+.3f} ± {statistics.stdev(values):.3f}"


def per_seed(values: list[float]) -> str:
    return ", ".join(f"{v:.3f}" for v in values)


@dataclass
class Plan:
    """Every run of the experiment, by role, and the chains to execute (a chain's `then` runs follow it)."""

    pretrain: dict[int, Run] = field(default_factory=dict)
    finetune: dict[int, Run] = field(default_factory=dict)
    scratch: dict[int, Run] = field(default_factory=dict)
    probe: dict[int, Run] = field(default_factory=dict)
    probe_avg: dict[int, Run] = field(default_factory=dict)
    all_labels: dict[int, tuple[Run, Run]] = field(default_factory=dict)  # seed -> (pretrained, scratch)
    long_scratch: dict[int, Run] = field(default_factory=dict)
    ablations: dict[str, dict[int, tuple[Run, Run]]] = field(default_factory=dict)  # name -> seed -> (pre, ft)
    chains: list[Run] = field(default_factory=list)


def plan_runs(args: argparse.Namespace, out: Path, labelled: dict[int, Path]) -> Plan:
    """The runs, as chains ordered longest first so that a few workers finish close together."""
    pre_over = [*([f"train.steps={args.pretrain_steps}"] if args.pretrain_steps else []), *args.pretrain_set]
    ft_over = [*([f"train.epochs={args.finetune_epochs}"] if args.finetune_epochs else []), *args.finetune_set]

    def pretrain(name: str, seed: int, extra: list[str]) -> Run:
        return Run(name, "pretrain", PRETRAIN_CONFIG, out / name, [
            f"data.shards={out / 'shards' / 'all'}", f"train.seed={seed}", *pre_over, *extra])

    def finetune(name: str, seed: int, init: Run | None, extra: list[str] = (), shards: Path | None = None) -> Run:
        checkpoint = str(init.run_dir / "export") if init else "''"  # '' (YAML) = from scratch
        return Run(name, "finetune", FINETUNE_CONFIG, out / name, [
            f"data.shards={shards or labelled[seed]}", f"train.seed={seed}", f"init.checkpoint={checkpoint}",
            *ft_over, *extra])

    plan = Plan()
    for seed in args.seeds:
        pre = plan.pretrain[seed] = pretrain(f"seed{seed}/pretrain", seed, [])
        pre.then.append(plan.finetune.setdefault(seed, finetune(f"seed{seed}/finetune", seed, pre)))
        if not args.no_probe:
            pre.then.append(plan.probe.setdefault(
                seed, finetune(f"seed{seed}/probe", seed, pre, ["train.mode=linear_probe"])))
            pre.then.append(plan.probe_avg.setdefault(seed, finetune(
                f"seed{seed}/probe_avg", seed, pre, ["train.mode=linear_probe", "model.global_pool=avg"])))
        if seed in args.extra_seeds and args.all_labels_epochs:
            # Every training label, about the same number of steps as the labelled-subset runs.
            extra, shards = [f"train.epochs={args.all_labels_epochs}"], out / "shards" / "all"
            plan.all_labels[seed] = (finetune(f"seed{seed}/all_labels_finetune", seed, pre, extra, shards),
                                     finetune(f"seed{seed}/all_labels_scratch", seed, None, extra, shards))
            pre.then += plan.all_labels[seed]
        plan.chains.append(pre)
    for seed in args.extra_seeds if args.long_scratch_epochs else ():
        plan.chains.append(plan.long_scratch.setdefault(seed, finetune(
            f"seed{seed}/long_scratch", seed, None, [f"train.epochs={args.long_scratch_epochs}"])))
    for label, extra in ABLATIONS.items() if args.ablations else ():
        slug = label.replace(", ", "_mask").replace("%", "")
        for seed in args.ablation_seeds:
            pre = pretrain(f"ablation/{slug}_s{seed}/pretrain", seed, [f"train.steps={args.ablation_steps}", *extra])
            pre.then.append(finetune(f"ablation/{slug}_s{seed}/finetune", seed, pre))
            plan.ablations.setdefault(label, {})[seed] = (pre, pre.then[0])
            plan.chains.append(pre)
    for seed in args.seeds:
        plan.chains.append(plan.scratch.setdefault(seed, finetune(f"seed{seed}/scratch", seed, None)))
    return plan


def report(plan: Plan, args: argparse.Namespace, baseline: list[float]) -> str:
    """The results as markdown tables: final top-1 (what the recipe commits to) and best-during-training."""
    s = args.seeds
    arms = {"from scratch": plan.scratch, "MPP pretrain -> fine-tune": plan.finetune,
            "MPP pretrain -> linear probe ([class] token)": plan.probe,
            "MPP pretrain -> linear probe (mean of patch tokens)": plan.probe_avg}
    arms = {name: runs for name, runs in arms.items() if runs}
    pre_minutes = statistics.mean(r.minutes for r in plan.pretrain.values())
    val_samples = records(plan.scratch[s[0]], "val_top1")[-1]["val_samples"]
    labels_used = f"{args.labels_per_class} per class" if args.labels_per_class else "all"
    lines = [f"Digits, seeds {s}; fine-tuning labels: {labels_used}; top-1 on {val_samples} validation images", "",
             "| arm | final val top-1 (mean ± std) | per seed | best during training | minutes per run |",
             "| --- | --- | --- | --- | --- |"]
    for name, runs in arms.items():
        fin, best = [final_top1(runs[k]) for k in s], [best_top1(runs[k]) for k in s]
        cost = f"{statistics.mean(r.minutes for r in runs.values()):.1f}"
        if runs is not plan.scratch:
            cost += f" + {pre_minutes:.1f} pretrain"
        lines.append(f"| {name} | {summary(fin)} | {per_seed(fin)} | {summary(best)} | {cost} |")
    diff = [final_top1(plan.finetune[k]) - final_top1(plan.scratch[k]) for k in s]
    best_diff = [best_top1(plan.finetune[k]) - best_top1(plan.scratch[k]) for k in s]
    lines.append(f"| difference, fine-tune - scratch (paired by seed) | {signed_summary(diff)} | "
                 f"{', '.join(f'{d:+.3f}' for d in diff)} | {signed_summary(best_diff)} | |")
    lines.append(f"| (reference: logistic regression on the raw 8x8 pixels, same labels) | {summary(baseline)} | "
                 f"{per_seed(baseline)} | | |")
    pre_last = [records(plan.pretrain[k], "val_loss")[-1] for k in s]
    lines += ["", f"MPP pretraining (all training images, labels unused): final validation "
              f"loss {summary([r['val_loss'] for r in pre_last])}, target accuracy on corrupted patches "
              f"{summary([r.get('val_acc', float('nan')) for r in pre_last])}"]
    if plan.long_scratch:
        k = sorted(plan.long_scratch)
        long_top = [final_top1(plan.long_scratch[j]) for j in k]
        lines += ["", f"From scratch with {args.long_scratch_epochs} epochs (about the images the pretrained arm "
                  f"processes in pretraining and fine-tuning together), seeds {k}: final top-1 {summary(long_top)} "
                  f"({per_seed(long_top)}), best {summary([best_top1(plan.long_scratch[j]) for j in k])}, "
                  f"{statistics.mean(plan.long_scratch[j].minutes for j in k):.1f} minutes per run"]
    if plan.all_labels:
        k = sorted(plan.all_labels)
        pre_all = [final_top1(plan.all_labels[j][0]) for j in k]
        scr_all = [final_top1(plan.all_labels[j][1]) for j in k]
        lines += ["", f"All training labels, {args.all_labels_epochs} epochs (about the same steps), seeds {k}", "",
                  "| arm | final val top-1 | per seed | minutes per run |", "| --- | --- | --- | --- |",
                  f"| from scratch | {summary(scr_all)} | {per_seed(scr_all)} | "
                  f"{statistics.mean(plan.all_labels[j][1].minutes for j in k):.1f} |",
                  f"| MPP pretrain -> fine-tune | {summary(pre_all)} | {per_seed(pre_all)} | "
                  f"{statistics.mean(plan.all_labels[j][0].minutes for j in k):.1f} + pretrain |",
                  f"| difference | {signed_summary([a - b for a, b in zip(pre_all, scr_all)])} | | |"]
    if plan.ablations:
        lines += ["", f"Ablations: MPP pretraining for {args.ablation_steps} steps, then the main fine-tuning recipe; "
                  f"seeds {args.ablation_seeds}", "",
                  "| target, corrupted | fine-tuned top-1 (final) | per seed | MPP val loss | MPP val acc | minutes |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for label, by_seed in plan.ablations.items():
            tops = [final_top1(ft) for _, ft in by_seed.values()]
            last = [records(pre, "val_loss")[-1] for pre, _ in by_seed.values()]
            acc = [r["val_acc"] for r in last if "val_acc" in r]
            minutes = statistics.mean(pre.minutes + ft.minutes for pre, ft in by_seed.values())
            lines.append(f"| {label} | {summary(tops)} | {per_seed(tops)} | {summary([r['val_loss'] for r in last])} "
                         f"| {summary(acc) if acc else 'n/a (regression)'} | {minutes:.1f} |")
        ref = [final_top1(plan.scratch[k]) for k in args.ablation_seeds if k in plan.scratch]
        if ref:
            lines.append(f"| none (the from-scratch runs above) | {summary(ref)} | {per_seed(ref)} | | | |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The experiment's command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "runs/experiments/digits", help="where data and runs go")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="one full comparison per seed")
    p.add_argument("--size", type=int, default=16, help="image side after nearest upsampling of the 8x8 digits")
    p.add_argument("--val-fraction", type=float, default=0.2, help="stratified held-out fraction (split seed 0)")
    p.add_argument("--labels-per-class", type=int, default=10,
                   help="labelled training images per digit for fine-tuning, drawn per seed (0: all); "
                        "pretraining always uses every training image, without labels")
    p.add_argument("--pretrain-steps", type=int, default=None, help="override train.steps of the pretrain config")
    p.add_argument("--finetune-epochs", type=int, default=None, help="override train.epochs of the finetune config")
    p.add_argument("--pretrain-set", nargs="*", default=[], metavar="KEY=VALUE", help="more pretrain overrides")
    p.add_argument("--finetune-set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="more finetune overrides (applied to both arms)")
    p.add_argument("--no-probe", action="store_true", help="skip the linear probes of the pretrained encoder")
    p.add_argument("--extra-seeds", type=int, nargs="*", default=[0],
                   help="seeds (of --seeds) that also run the two checks below (all labels; long from-scratch)")
    p.add_argument("--all-labels-epochs", type=int, default=43,
                   help="epochs of those runs (1437 images // batch 50 = 28 steps each: about the 1,200 steps of "
                        "the 10-per-class runs); 0 skips this check")
    p.add_argument("--long-scratch-epochs", type=int, default=3000,
                   help="epochs of a from-scratch run given about the pretrained arm's total images (pretraining "
                        "2000 x 128 + fine-tuning 1200 x 50 = 316k images = 3160 epochs of 100); 0 skips it")
    p.add_argument("--ablations", action="store_true", help="also run the target and mask-ratio ablations")
    p.add_argument("--ablation-steps", type=int, default=600, help="pretraining steps of each ablation run")
    p.add_argument("--ablation-seeds", type=int, nargs="+", default=[0], help="seeds of the ablation runs")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: print the tables from the run directories of an earlier run with these flags")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time")
    p.add_argument("--reuse", action="store_true",
                   help="keep finished runs found in --out instead of running them again (e.g. to add seeds)")
    p.add_argument("--threads", type=int, default=None, help="threads per run (default: cores / jobs)")
    p.add_argument("--data-only", action="store_true",
                   help="only write the digits and build their shards (all images, and the labelled subset of each "
                        "seed), where configs/*/digits.yaml read them, then stop: to run those configs by hand")
    return p


def main() -> None:
    args = build_parser().parse_args()
    args.extra_seeds = [k for k in args.extra_seeds if k in args.seeds]
    out = args.out.resolve()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = args.threads or max(1, cores // args.jobs)
    started = time.perf_counter()

    seeds = sorted(set(args.seeds) | (set(args.ablation_seeds) if args.ablations else set()))
    if args.report_only:
        items = write_digits(out / "images", args.size, args.val_fraction)  # the same files: the split is fixed
        labelled = {k: out / "shards" / f"labelled_k{args.labels_per_class}_s{k}" for k in seeds}
    else:
        print(f"== data: digits at {args.size}x{args.size}, shards under {out / 'shards'}", flush=True)
        items, labelled = make_data(out, args.size, args.val_fraction, args.labels_per_class, seeds)
        if args.data_only:
            print(f"shards of every training image: {out / 'shards' / 'all'}; labelled shards: "
                  f"{', '.join(str(labelled[k]) for k in sorted(labelled))}")
            return
    baseline = [pixel_baseline(items, args.labels_per_class, k) for k in args.seeds]
    data_minutes = (time.perf_counter() - started) / 60

    plan = plan_runs(args, out, labelled)
    if args.report_only:
        runs = [*plan.pretrain.values(), *plan.finetune.values(), *plan.scratch.values(), *plan.probe.values(),
                *plan.probe_avg.values(), *plan.long_scratch.values(),
                *(r for pair in plan.all_labels.values() for r in pair),
                *(r for by_seed in plan.ablations.values() for pair in by_seed.values() for r in pair)]
        for run in runs:
            run.minutes = json.loads((run.run_dir / WALL_FILE).read_text())["minutes"]
        text = report(plan, args, baseline)
    else:
        log_dir = out / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        print(f"== {len(plan.chains)} chains of runs, {args.jobs} at a time, {threads} thread(s) each; logs in "
              f"{log_dir}", flush=True)
        with ThreadPoolExecutor(args.jobs) as pool:
            for future in [pool.submit(execute, chain, threads, log_dir, args.reuse) for chain in plan.chains]:
                future.result()
        total_minutes = (time.perf_counter() - started) / 60
        text = report(plan, args, baseline) + (
            f"\n\ntotal wall time {total_minutes:.1f} min (data and shards {data_minutes:.1f} min), {args.jobs} run(s) "
            f"at a time, {threads} thread(s) each, on {cores} core(s)")
        (out / "results.md").write_text(f"python {' '.join(sys.argv)}\n\n{text}\n")
    print("\n" + text)


if __name__ == "__main__":
    main()

"""Does MPP pretraining help? `python -m experiments.compare` on real images: scikit-learn's digits.

    python experiments/pretrain_vs_scratch.py                   # every arm, 3 seeds (see docs/results.md)
    python experiments/pretrain_vs_scratch.py --ablations       # plus the target and mask-ratio ablations
    python experiments/pretrain_vs_scratch.py --seeds 0 --pretrain-steps 200 --finetune-epochs 10   # a quick look
    python experiments/pretrain_vs_scratch.py --data-only --seeds 0   # only the data the digits configs read

What it does:

1. Writes the 1,797 digits (8x8, 17 grey levels) as PNGs upsampled to --size with nearest neighbour, in a
   class-folder tree `images/{train,val}/<digit>/<index>.png` with a fixed stratified split (--val-fraction,
   split seed 0, the same for every run), then `build-shards --existing-splits` on it (`shards/all`), and per seed
   the labelled subset (--labels-per-class images of each digit, drawn with that seed; 0 = all) as its own shards
   (`shards/labelled_k<K>_s<seed>`).
2. Runs `python -m experiments.compare` on them (experiments/compare.py): the pool is every training image
   (labels unused by MPP; used by the supervised arm), the fine-tunings train on the seed's labelled subset and are
   scored on the 360 validation images, with configs/pretrain/digits.yaml and configs/finetune/digits.yaml. The arms:
   from scratch, MPP pretrain -> fine-tune, from scratch at the MPP arm's total compute, supervised pretraining on the
   labelled pool, and linear probes of the MPP encoder on the [class] token and on the mean of the patch tokens
   (probe-avg); --ablations adds one MPP arm per target and mask ratio, pretrained for --ablation-steps.
3. Prints compare's paired table and, as a reference, a logistic regression on the raw 64 pixels of the same labelled
   images; writes it to `results.md` beside compare's `compare.md`, `.csv` and `.json`.

Runs go to runs/experiments/digits/seed<S>/<arm>/<stage> (gitignored). compare resumes: a finished run is reused,
a half-finished one continues, so the same command after an interruption, or with more seeds or arms, runs only
what is missing. --jobs runs that many processes at once, each with cores / jobs threads.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from experiments import compare
from experiments.digits import labelled_subset, load_digits, make_data, write_digits
from vit_mpp.cli import ArgumentParser
from vit_mpp.processes.exits import run_main
from vit_mpp.tools.args import write_out_text

REPO = Path(__file__).resolve().parents[1]
PRETRAIN_CONFIG = "configs/pretrain/digits.yaml"
FINETUNE_CONFIG = "configs/finetune/digits.yaml"
ARMS = "scratch,mpp,scratch_equal,supervised,probe,probe-avg"
PROBE_AVG = "probe-avg.finetune:model.global_pool=avg"  # the probe on the mean of the patch tokens
ABLATIONS = {  # arm -> its pretraining overrides; each is pretrained at --ablation-steps and fine-tuned like mpp
    "mpp-mean_color": ["mpp.target=mean_color", "mpp.mask_ratio=0.5"],
    "mpp-pixels_4x4": ["mpp.target=pixels_4x4", "mpp.mask_ratio=0.5"],
    "mpp-l2": ["mpp.target=l2", "mpp.mask_ratio=0.5"],
    "mpp-mask15": ["mpp.target=mean_color", "mpp.mask_ratio=0.15"],
}


def pixel_baseline(items: dict[str, list[tuple[str, int]]], per_class: int, seed: int) -> float:
    """Validation top-1 of a logistic regression on the raw 64 pixels, trained on the same labelled subset: a
    reference for what the labels alone give on this easy dataset."""
    from sklearn.linear_model import LogisticRegression

    digits = load_digits()
    x, y = digits.data, digits.target
    train = [int(Path(p).stem) for p, _ in labelled_subset(items, per_class, seed)]  # file stem = sklearn index
    val = [int(Path(p).stem) for p, _ in items["val"]]
    clf = LogisticRegression(max_iter=5000).fit(x[train] / 16, y[train])
    return float((clf.predict(x[val] / 16) == y[val]).mean())


def compare_argv(args: argparse.Namespace, out: Path) -> list[str]:
    """`python -m experiments.compare`'s command line for these flags, on the data under `out`."""
    labelled = out / "shards" / (f"labelled_k{args.labels_per_class}_s{{seed}}" if args.labels_per_class else "all")
    arms = [args.arms, *(ABLATIONS if args.ablations else ())]
    sets = [*([f"pretrain:train.steps={args.pretrain_steps}"] if args.pretrain_steps else []),
            *([f"finetune:train.epochs={args.finetune_epochs}"] if args.finetune_epochs else []),
            *(f"pretrain:{o}" for o in args.pretrain_set), *(f"finetune:{o}" for o in args.finetune_set)]
    if "probe-avg" in args.arms.split(","):
        sets.append(PROBE_AVG)
    for arm, overrides in ABLATIONS.items() if args.ablations else ():
        sets += [f"{arm}.pretrain:{o}" for o in [f"train.steps={args.ablation_steps}", *overrides]]
    sets += args.set
    threads = ["--threads", str(args.threads)] if args.threads else []
    return ["--unlabelled", str(out / "shards" / "all"), "--labelled", str(labelled),
            "--test", f"{out / 'shards' / 'all'}:val", "--seeds", *map(str, args.seeds),
            "--pretrain-config", str(REPO / PRETRAIN_CONFIG), "--finetune-config", str(REPO / FINETUNE_CONFIG),
            "--out", str(out), "--arms", ",".join(arms), "--jobs", str(args.jobs), *threads,
            *(["--set", *sets] if sets else []), *(["--report-only"] if args.report_only else [])]


def build_parser() -> ArgumentParser:
    """The experiment's command line."""
    p = ArgumentParser(prog="python experiments/pretrain_vs_scratch.py", description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "runs/experiments/digits", help="where data and runs go")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="one full comparison per seed")
    p.add_argument("--size", type=int, default=16, help="image side after nearest upsampling of the 8x8 digits")
    p.add_argument("--val-fraction", type=float, default=0.2, help="stratified held-out fraction (split seed 0)")
    p.add_argument("--labels-per-class", type=int, default=10,
                   help="labelled training images per digit for fine-tuning, drawn per seed (0: all); "
                        "pretraining always uses every training image, without labels")
    p.add_argument("--arms", default=ARMS, help="compare's arms (probe-avg: the probe on the mean patch token)")
    p.add_argument("--pretrain-steps", type=int, default=None, help="override train.steps of the pretrain config")
    p.add_argument("--finetune-epochs", type=int, default=None, help="override train.epochs of the finetune config")
    p.add_argument("--pretrain-set", nargs="*", default=[], metavar="KEY=VALUE", help="more pretrain overrides")
    p.add_argument("--finetune-set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="more overrides of every run of the finetune config")
    p.add_argument("--set", nargs="*", default=[], metavar="TARGET:KEY=VALUE",
                   help="compare's own overrides, applied last: one arm's stage (mpp-l2n.pretrain:mpp.norm_pix=true "
                        "for a variant arm mpp-l2n) or every run of a config (pretrain:..., finetune:...)")
    p.add_argument("--ablations", action="store_true", help="also run the target and mask-ratio ablations")
    p.add_argument("--ablation-steps", type=int, default=600, help="pretraining steps of each ablation arm")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: print the tables from the run directories of an earlier run with these flags")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time")
    p.add_argument("--threads", type=int, default=None, help="threads per run (default: cores / jobs)")
    p.add_argument("--data-only", action="store_true",
                   help="only write the digits and build their shards (all images, and the labelled subset of each "
                        "seed), where configs/*/digits.yaml read them, then stop: to run those configs by hand")
    return p


def main(argv: list[str] | None = None) -> dict | None:
    """Data, then compare, then the pixel reference; returns compare's report (None with --data-only)."""
    args = build_parser().parse_args(argv)
    out = args.out.resolve()
    if args.report_only:
        items = write_digits(out / "images", args.size, args.val_fraction)  # the same files: the split is fixed
    else:
        print(f"== data: digits at {args.size}x{args.size}, shards under {out / 'shards'}", flush=True)
        items, labelled = make_data(out, args.size, args.val_fraction, args.labels_per_class, args.seeds)
        if args.data_only:
            print(f"shards of every training image: {out / 'shards' / 'all'}; labelled shards: "
                  f"{', '.join(str(labelled[k]) for k in sorted(labelled))}")
            return None
    report = compare.main(compare_argv(args, out))
    baseline = [pixel_baseline(items, args.labels_per_class, k) for k in args.seeds]
    mean = statistics.mean(baseline)
    spread = f" ± {statistics.stdev(baseline):.3f}" if len(baseline) > 1 else ""
    line = (f"Reference: logistic regression on the raw 8x8 pixels of the same labelled images: {mean:.3f}{spread} "
            f"({', '.join(f'{b:.3f}' for b in baseline)})")
    print(line)
    write_out_text(out / "results.md", f"python {' '.join(sys.argv)}\n\n{(out / 'compare.md').read_text()}\n{line}\n")
    return report


if __name__ == "__main__":
    run_main(main)

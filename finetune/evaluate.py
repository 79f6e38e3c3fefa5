"""Evaluation without training, like timm's validate.py: a fine-tuned classifier on a split of shards, through
fine-tuning's own `evaluate` (finetune/scoring.py), each image counted once whatever the number of processes.

    python -m finetune.evaluate --checkpoint runs/demo/finetune/export/best --shards runs/demo/shards [--split val]

See docs/finetune.md, "Evaluate an export".
"""

from __future__ import annotations

from vit_mpp.processes.rank_lifecycle import die_with_launcher

die_with_launcher()  # first of all, under `accelerate launch -m finetune.evaluate`: before the heavy imports

import argparse  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from finetune.scoring import evaluate, per_class_accuracy, write_confusion  # noqa: E402
from vit_mpp.cli import ArgumentParser  # noqa: E402
from vit_mpp.config.engine import ConfigError  # noqa: E402
from vit_mpp.config.sections import DataConfig  # noqa: E402
from vit_mpp.data.eval_stream import eval_split_loader  # noqa: E402
from vit_mpp.data.image_decoder import ImageDecoder  # noqa: E402
from vit_mpp.data.manifest import check_every_sample_labelled, load_split, manifest_classes  # noqa: E402
from vit_mpp.data.stream import loader_layout  # noqa: E402
from vit_mpp.durable import write_atomic  # noqa: E402
from vit_mpp.models.pretrained import Pretrained, load_classifier, results_folder  # noqa: E402
from vit_mpp.processes.exits import run_main  # noqa: E402
from vit_mpp.run.metering.eval_progress import with_progress  # noqa: E402
from vit_mpp.run.metering.step_meter import with_unread  # noqa: E402
from vit_mpp.run.start.accelerator import make_eval_accelerator  # noqa: E402
from vit_mpp.run.start.dry_run import probe  # noqa: E402
from vit_mpp.tools.args import check_out_folder, make_out_folder  # noqa: E402

MAX_ROWS = 20  # per-class rows printed; evaluation.json has them all


def default_out(checkpoint: str, split: str) -> Path:
    """`PATH-eval-SPLIT` beside the export folder PATH, outside any export that holds it (`run/export/best` ->
    `run/export-best-eval-val`), so that no export folder gains files; for a Hub or timm name, `NAME-eval-SPLIT` in
    the current directory (vit_mpp.models.pretrained.results_folder, as for the analysis figures)."""
    return results_folder(checkpoint, f"eval-{split}")


def check_classes(pre: Pretrained, info: dict[str, Any], shards: str, ignore_names: bool) -> str | None:
    """Raise a ConfigError when the shards' classes are not the classifier's; a warning (or None) otherwise.

    Labels are class indices, so shards whose class names differ (another set, or the same names in another order)
    would be scored against the wrong classes: an error, unless `ignore_names` (e.g. classes renamed since training).
    Shards that name no classes are checked label by label as they are read.
    """
    names = list(info.get("class_names") or [])
    count = manifest_classes(info)
    if count and count != pre.num_classes:
        raise ConfigError(f"the classifier has {pre.num_classes} classes but the shards at {shards} have {count}: "
                          "evaluate it on shards of the classes it was trained on")
    if not names or not pre.class_names or names == list(pre.class_names):
        return None
    if sorted(names) == sorted(pre.class_names):
        what = "the same names in another order"
    else:
        i = next(i for i, (a, b) in enumerate(zip(pre.class_names, names)) if a != b)
        what = f"class {i} is {pre.class_names[i]!r} in the classifier, {names[i]!r} in the shards"
    message = f"the shards' class names differ from the classifier's ({what}): labels would be scored as other classes"
    if not ignore_names:
        raise ConfigError(f"{message}; --ignore-class-names evaluates anyway")
    return f"warning: {message} (--ignore-class-names: evaluating anyway)"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = ArgumentParser(prog="python -m finetune.evaluate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True,
                        help="fine-tuning export folder (or its model.safetensors, local-dir:PATH, hf-hub:NAME)")
    parser.add_argument("--shards", required=True, help="build-shards output (folder or URL with _info.json)")
    parser.add_argument("--split", default="val", help="split to evaluate (default: val)")
    parser.add_argument("--out", help="folder for evaluation.json and the confusion matrix (default: PATH-eval-SPLIT "
                                      "beside the export folder PATH)")
    parser.add_argument("--batch-size", type=int, default=64, help="images per process and batch")
    parser.add_argument("--workers", type=int, default=2, help="data-loader workers per process")
    parser.add_argument("--mixed-precision", choices=("no", "bf16", "fp16"), default="no")
    parser.add_argument("--ignore-class-names", action="store_true",
                        help="evaluate even when the shards' class names differ from the classifier's")
    parser.add_argument("--dry-run", action="store_true",
                        help="check the checkpoint, the shards and their classes, say what would be evaluated, write "
                             "nothing")
    args = parser.parse_args(argv)
    if args.batch_size < 1 or args.workers < 0:
        raise ConfigError("--batch-size must be at least 1 and --workers at least 0")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Evaluate, print the summary on the main process, write `--out`; returns what evaluation.json holds."""
    args = parse_args(argv)
    out = check_out_folder(Path(args.out) if args.out else default_out(args.checkpoint, args.split))
    accelerator = make_eval_accelerator(args.mixed_precision)
    model, pre = load_classifier(args.checkpoint)
    split, info = load_split(args.shards, args.split)
    check_every_sample_labelled(args.shards, info, args.split)
    warning = check_classes(pre, info, args.shards, args.ignore_class_names)
    if warning:
        accelerator.print(warning)
    data = DataConfig(num_workers=args.workers, eval_crop_pct=pre.crop_pct or 0.875)
    if args.dry_run:
        probe(split, data, f"split '{args.split}' of {args.shards}")
        accelerator.print(f"dry run: nothing is written; would evaluate {args.checkpoint} ({pre.model.name} at "
                          f"{pre.model.img_size}, {pre.num_classes} classes) on split '{args.split}' of {args.shards} "
                          f"({split.num_samples} images in {len(split.urls)} shards) with "
                          f"{accelerator.num_processes} process(es), batch {args.batch_size} each, and write "
                          f"evaluation.json and confusion_matrix.png to {out}")
        return {}
    loader = eval_split_loader(split, data, ImageDecoder.for_evaluation(data, pre.model.img_size),
                               loader_layout(data, args.batch_size, accelerator.num_processes),
                               rank=accelerator.process_index, num_classes=pre.num_classes)
    model.to(accelerator.device)
    with with_progress(accelerator, loader, "evaluating", split.num_samples) as counted:
        result, confusion = evaluate(accelerator, model, counted, (pre.mean, pre.std), pre.num_classes)

    metrics, warning = with_unread(result, split.num_samples)  # the keys of fine-tuning's own evaluation records
    if warning:
        accelerator.print(warning)
    names = pre.class_names or info.get("class_names") or [str(i) for i in range(pre.num_classes)]
    report = {"checkpoint": args.checkpoint, "shards": args.shards, "split": args.split,
              "num_processes": accelerator.num_processes, "metrics": metrics, "class_names": list(names),
              "per_class_acc": per_class_accuracy(confusion).tolist(), "per_class_count": confusion.sum(1).tolist(),
              "confusion": confusion.tolist()}
    if accelerator.is_main_process:
        make_out_folder(out)
        write_atomic(out / "evaluation.json", json.dumps(report, indent=1) + "\n")
        write_confusion(confusion, names, out, title=f"{args.split}: top-1 {metrics['val_top1']:.4f} on "
                                                     f"{metrics['val_samples']} images")
        print_report(report, out)
    accelerator.end_training()
    return report


def print_report(report: dict[str, Any], out: Path) -> None:
    """The summary table, then per-class accuracy (the lowest MAX_ROWS when there are more classes)."""
    from rich.console import Console
    from rich.table import Table

    m = report["metrics"]
    summary = Table()
    summary.add_column("metric")
    summary.add_column("value", justify="right")
    for key in ("val_loss", "val_top1", "val_top5", "val_mean_class_acc"):
        if key in m:
            summary.add_row(key.removeprefix("val_"), f"{m[key]:.4f}")
    summary.add_row("images", f"{m['val_samples']}" + (f" ({m['val_unread']} unreadable)" if m.get("val_unread")
                                                        else ""))
    rows = sorted(range(len(report["class_names"])), key=lambda i: report["per_class_acc"][i])
    shown = rows if len(rows) <= MAX_ROWS else rows[:MAX_ROWS]
    per_class = Table(title="per-class accuracy" if shown is rows else
                      f"per-class accuracy: the {MAX_ROWS} lowest of {len(rows)} classes")
    for name, justify in (("class", "right"), ("name", "left"), ("images", "right"), ("accuracy", "right")):
        per_class.add_column(name, justify=justify)
    for i in sorted(shown) if shown is rows else shown:
        per_class.add_row(str(i), str(report["class_names"][i]), str(report["per_class_count"][i]),
                          f"{report['per_class_acc'][i]:.4f}")
    console = Console()
    console.print(f"{report['checkpoint']} on split '{report['split']}' of {report['shards']} "
                  f"({report['num_processes']} process(es))", highlight=False)
    console.print(summary)
    console.print(per_class)
    console.print(f"written: {out / 'evaluation.json'}, {out / 'confusion_matrix.png'}")


if __name__ == "__main__":
    run_main(main)

"""`python -m analysis plot RUN_DIR [RUN_DIR ...] [--out curves.png] [--labels A B ...]`: training curves of runs,
overlaid (e.g. a fine-tuning from scratch against one from a pretrained encoder), from their metrics.jsonl."""

from __future__ import annotations

from pathlib import Path

from vit_mpp.cli import ArgumentParser
from vit_mpp.config.engine import ConfigError
from vit_mpp.run.metering.curves import plot_curves
from vit_mpp.run.metering.metrics_log import read_metrics
from vit_mpp.tools.args import check_distinct_runs, check_out_file
from vit_mpp.tools.figures import check_figure_name


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m analysis plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", nargs="+", help="run directories (each with its metrics.jsonl)")
    parser.add_argument("--out", default="curves.png",
                        help="the figure to write; its suffix gives the format (.png, .pdf, .svg, ...; default: "
                        "%(default)s)")
    parser.add_argument("--labels", nargs="+", default=None, help="a legend label per run (default: their paths)")
    args = parser.parse_args(argv)
    if args.labels is not None and len(args.labels) != len(args.run_dirs):
        raise ConfigError(f"--labels gives {len(args.labels)} labels for {len(args.run_dirs)} runs")
    check_distinct_runs(args.run_dirs)
    labels = args.labels or args.run_dirs
    twice = next((label for label in labels if labels.count(label) > 1), None)
    if twice is not None:  # one curve would silently replace the other
        raise ConfigError(f"--labels names {twice!r} twice: a curve per run needs a label per run")
    check_out_file(args.out)
    check_figure_name(args.out)
    runs = {}
    for label, run_dir in zip(labels, args.run_dirs):
        records = read_metrics(run_dir)
        if not records:
            raise ConfigError(f"{run_dir} has no metrics.jsonl with records: not a run directory of this tool")
        runs[label] = records
    out = plot_curves(runs, args.out)
    if out is None:
        raise ConfigError("the runs' metrics.jsonl hold none of the metrics plotted (loss, accuracy, lr, ...)")
    print(f"wrote {Path(out)} ({len(runs)} run{'s' if len(runs) > 1 else ''})")

"""`python -m analysis summary RUN_DIR [RUN_DIR ...] [--csv FILE]`: a table of runs, one row each (like timm's
summary.csv), from what each run directory holds (config.yaml, its export's record, metrics.jsonl, summary.json), as
markdown on standard output and, with --csv, as CSV. See docs/analysis.md, "A table of runs".
"""

from __future__ import annotations

import csv
import dataclasses
import sys
from pathlib import Path
from typing import Any

import yaml

from vit_mpp.cli import ArgumentParser
from vit_mpp.config.engine import ConfigError
from vit_mpp.models.export import ExportError, read_export_config
from vit_mpp.models.export_folder import is_export
from vit_mpp.progress import format_duration
from vit_mpp.run.metering.metrics_log import read_metrics
from vit_mpp.run.metering.summary import BEST_OF, best_metrics, final_metrics, read_summary, wall_time_s
from vit_mpp.tools.args import check_distinct_runs, check_out_file, open_out_file

# Metrics shown, in this order: the final value of each, and the best of those that have one (vit_mpp/run_metrics).
METRICS = ("loss", "val_loss", "val_acc", "knn_top1_cls", "val_top1", "val_top5", "ema_val_top1")
SETTINGS = ("run", "name", "stage", "model", "data", "steps", "epochs", "batch", "optimizer", "lr", "target",
            "mask_ratio", "mode", "init")


def read_config(run_dir: Path) -> tuple[str, dict[str, Any]]:
    """(stage, config as written) of a run directory; a ConfigError when it is none."""
    path = run_dir / "config.yaml"
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir} is not a folder: give run directories (train.run_dir of a run)")
    try:
        cfg = yaml.safe_load(path.read_text()) if path.is_file() else None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not readable YAML: {' '.join(str(e).split())[:200]}") from None
    if not isinstance(cfg, dict) or not ({"mpp", "init"} & set(cfg)):
        raise ConfigError(f"{run_dir} is not a run directory of this tool (no config.yaml of a pretraining or "
                          "fine-tuning run)")
    return ("pretrain" if "mpp" in cfg else "finetune"), cfg


def trained_model(run_dir: Path, cfg: dict[str, Any]) -> str:
    """The model as trained: from the run's export when there is one (fine-tuning takes the architecture of the
    export it starts from), else the config; custom sizes and the input size shown."""
    model = dict(cfg.get("model") or {})
    for export in (run_dir / "export" / "best", run_dir / "export"):
        if is_export(export):
            try:
                model = dataclasses.asdict(read_export_config(export)[0])
                break
            except ExportError:  # one this version cannot read: the config says what was asked
                continue
    sizes = " ".join(f"{letter}{model[key]}" for key, letter in (("patch_size", "P"), ("embed_dim", "D"),
                                                                  ("depth", "L"), ("num_heads", "H")) if model.get(key))
    size = model.get("img_size")
    shown = "x".join(map(str, size)) if isinstance(size, list) else size
    return f"{model.get('name', '?')}{f' ({sizes})' if sizes else ''} @{shown}"


def peak_lr(cfg: dict[str, Any]) -> float | None:
    """`optim.lr`, else `optim.base_lr` scaled from `optim.base_batch_size` to the batch (vit_mpp.run.loop)."""
    optim, train = cfg.get("optim") or {}, cfg.get("train") or {}
    if optim.get("lr") is not None:
        return float(optim["lr"])
    try:
        return float(optim["base_lr"]) * train["batch_size"] / optim["base_batch_size"]
    except (KeyError, TypeError, ZeroDivisionError):
        return None


def run_row(run_dir: Path) -> dict[str, Any]:
    """One row of the table: the run's settings, final and best metrics, and wall time."""
    stage, cfg = read_config(run_dir)
    train, optim, data = cfg.get("train") or {}, cfg.get("optim") or {}, cfg.get("data") or {}
    records = read_metrics(run_dir)
    last_step = max((int(r.get("step", 0)) for r in records), default=None)
    row: dict[str, Any] = {
        "run": str(run_dir), "name": train.get("run_name") or run_dir.name, "stage": stage,
        "model": trained_model(run_dir, cfg), "data": data.get("shards"),
        "steps": train.get("steps") if stage == "pretrain" else last_step,
        "epochs": train.get("epochs") if stage == "finetune" else None, "batch": train.get("batch_size"),
        "optimizer": optim.get("name"), "lr": peak_lr(cfg)}
    if stage == "pretrain":
        mpp = cfg.get("mpp") or {}
        row.update(target=mpp.get("target"), mask_ratio=mpp.get("mask_ratio"))
    else:
        row.update(mode=train.get("mode"), init=(cfg.get("init") or {}).get("checkpoint") or "scratch")
    best = best_metrics(records)
    for key, value in final_metrics(records, METRICS).items():
        row[f"final {key}"] = value
    for key in METRICS:
        if key in best:
            row[f"best {key}"] = best[key]
    row["wall_s"] = wall_time_s(records, read_summary(run_dir))  # summary.json's total: start-up and export too
    return row


def columns(rows: list[dict[str, Any]]) -> list[str]:
    """Every setting, then the metric columns some run has (final, then best, metric by metric), then wall time."""
    metric_cols = [f"{kind} {key}" for key in METRICS for kind in ("final", "best")
                   if (kind == "final" or key in BEST_OF) and any(f"{kind} {key}" in r for r in rows)]
    return [c for c in SETTINGS if any(r.get(c) not in (None, "") for r in rows)] + metric_cols + ["wall_s"]


def shown(column: str, value: Any) -> str:
    """A value as the markdown table shows it."""
    if value is None or value == "":
        return ""
    if column == "wall_s":
        return format_duration(value)
    if column == "lr":
        return f"{value:.3g}"
    if isinstance(value, float):
        return f"{value:.4f}" if column.startswith(("final ", "best ")) else f"{value:g}"
    return str(value).replace("|", "\\|")


def markdown(rows: list[dict[str, Any]], cols: list[str]) -> str:
    """The rows as a markdown table (`wall_s` shown as a duration, headed `wall time`)."""
    heads = ["wall time" if c == "wall_s" else c for c in cols]
    lines = ["| " + " | ".join(heads) + " |", "|" + "|".join(" --- " for _ in cols) + "|"]
    lines += ["| " + " | ".join(shown(c, r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def terminal_table(rows: list[dict[str, Any]], cols: list[str], console: Any = None) -> None:
    """The table for a terminal, turned: a row per column, a column per run (rich; `console`: standard output's)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(show_header=False, show_lines=False, box=None, padding=(0, 2))
    table.add_column(style="bold", no_wrap=True)
    for _ in rows:
        table.add_column(overflow="fold")
    for c in cols:
        table.add_row("wall time" if c == "wall_s" else c, *(shown(c, r.get(c)) for r in rows))
    (console or Console()).print(table)


def write_csv(rows: list[dict[str, Any]], cols: list[str], path: Path) -> None:
    """The rows as CSV, values unrounded (wall time in seconds)."""
    with open_out_file(path, "--csv") as f:
        writer = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore", lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Print the table of the runs named (and write the CSV); returns the rows."""
    parser = ArgumentParser(prog="python -m analysis summary", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", nargs="+", help="run directories (train.run_dir of pretraining or fine-tuning)")
    parser.add_argument("--csv", default=None, metavar="FILE", help="also write the table as CSV to FILE")
    args = parser.parse_args(argv)
    check_distinct_runs(args.run_dirs)
    if args.csv:
        check_out_file(args.csv, "--csv")
    rows = [run_row(Path(d)) for d in args.run_dirs]  # every folder checked before anything is written
    cols = columns(rows)
    text = markdown(rows, cols)
    if args.csv:
        write_csv(rows, cols, Path(args.csv))
    if sys.stdout.isatty():  # a terminal is narrower than a row of many columns: one column per run instead
        terminal_table(rows, cols)
    else:
        sys.stdout.write(text)
    if args.csv:
        print(f"wrote {args.csv} ({len(rows)} run{'s' * (len(rows) != 1)})", file=sys.stderr)
    return rows

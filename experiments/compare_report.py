"""compare's report: each arm's final test top-1 and cost read from its run directories, the table paired by seed
(`table`, `differences`), and compare.md, compare.csv and compare.json (a label sweep's: the curve, then each point's
tables). See docs/experiments.md#python--m-experimentscompare.
"""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path
from typing import Any

import yaml

from experiments import label_sweep, monitor_ranks
from experiments.compare_arms import POOL_KINDS, Setup, Stage, kind
from experiments.run_scheduler import scored_top1
from vit_mpp.run.metering.metrics_log import read_metrics
from vit_mpp.run.metering.summary import covers_last_step, read_summary, wall_time_s
from vit_mpp.tools.args import make_out_folder, open_out_file, write_out_text


def final_top1(run_dir: Path) -> float | None:
    """The last `val_top1` a finished run logged (its evaluation after the last step), or None: a run still going, or
    stopped and not resumed, has logged evaluations too, and its last is not its result."""
    records = read_metrics(run_dir)
    if not covers_last_step(read_summary(run_dir), records):
        return None
    values = [r["val_top1"] for r in records if isinstance(r.get("val_top1"), (int, float))]
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
    """(a, b) pairs shown as a - b: the reference MPP arm against every other arm that is neither MPP nor MPP with the
    pool; every other MPP arm against the reference and every baseline (scratch, equal compute, supervised; not the
    probes, which read the reference's pretraining); and every arm with the pool (semi, semi2) against every MPP arm
    (its gain over plain fine-tuning), the pool's arms before it (a lever against the recipe it changes), and the
    baselines given the pool or more (semi_scratch, supervised, scratch_equal)."""
    mpp = [a for a in arms if kind(a) == "mpp"]
    ref = mpp[0]
    pools = [a for a in arms if kind(a) in POOL_KINDS]
    baselines = [b for b in arms if kind(b) not in ("mpp", "probe", *POOL_KINDS)]
    pairs = [(ref, b) for b in arms if kind(b) not in ("mpp", *POOL_KINDS)]
    for variant in mpp[1:]:
        pairs += [(variant, ref)] + [(variant, b) for b in baselines]
    for i, semi in enumerate(pools):
        pairs += [(semi, m) for m in mpp] + [(semi, p) for p in pools[:i]]
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
    validated = (f"; each run validated on {report['val']}:{report['val_split']}, its final export scored on the "
                 "test images" if "val" in report else "")
    lines = [f"Final test top-1 on {report['test_samples']:,} images ({report['test']}:{report['test_split']}), "
             f"seeds {', '.join(map(str, seeds))}; mean ± sample std over seeds{validated}", "",
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
    lines += ["", "Training images and minutes: per seed (the mean over the seeds with a result), of every run an "
              "arm's result depends on (probe, semi: the reference MPP pretraining and their fine-tuning); minutes of "
              "training as the runs logged them (elapsed_s), start-up not included."]
    if report["epochs"]:
        lines.append("Equal-compute epochs: " + ", ".join(f"{a} {e}" for a, e in report["epochs"].items()) + ".")
    lines += [f"Note: {n}" for n in report["notes"]]
    if "pool" in report:
        lines += pool_markdown(report["pool"], seeds, "val" if "val" in report else "test")
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
            last = stages[-1].run_dir
            top1[arm][seed] = scored_top1(last) if setup.val else final_top1(last)
            if top1[arm][seed] is None:
                notes.append(f"{stages[-1].name}: no test result in {stages[-1].run_dir} (not run, or not finished)")
                continue  # its cost is not an arm's: the mean is over the seeds with a result
            images.append(sum(images_seen(s.run_dir) for s in stages))
            minutes.append(sum((wall_time_s(read_metrics(s.run_dir)) or 0.0) / 60 for s in stages))
        cost[arm] = {"images": round(statistics.mean(images or [0])), "minutes": statistics.mean(minutes or [0.0])}
    runs = {s.name: str(s.run_dir) for (_, _, p), stages in of_arm.items() if p == point for s in stages}
    here = {k: v for k, v in epochs.items() if "@" not in k or k.endswith(f"@{point}")}
    mpp = [(arm, seed, of_arm[seed, arm, point][0].run_dir, top1[arm][seed]) for arm in setup.arms
           if kind(arm) == "mpp" for seed in setup.seeds if (seed, arm, point) in of_arm]
    monitors = monitor_ranks.monitor_table(mpp)
    pool = pool_table(setup, of_arm, point)
    return {"test": setup.test, "test_split": setup.test_split, "test_samples": setup.test_samples,
            **({"val": setup.val, "val_split": setup.val_split} if setup.val else {}),
            "seeds": setup.seeds, "table": table(top1, setup.arms, setup.seeds), "cost": cost, "epochs": here,
            "notes": notes, "runs": runs, **({"pool": pool} if pool else {}),
            **({"monitors": monitors} if monitors["spearman"] else {})}


LOGGED = ("pseudo_kept", "pseudo_acc")  # a pool run's per-step metrics; test_*: its evaluations' ema_val_* (val_*
                                         # with --val: the images the runs evaluate are then --val's)


def pool_keys(scored: str) -> tuple[str, ...]:
    return (*LOGGED, *(f"{scored}_{k}" for k in LOGGED))


def pool_at_end(run_dir: Path, scored: str = "test") -> dict[str, float] | None:
    """What the pool did in a run with one, at its last log: the share of pool images kept (`pseudo_kept`) and, for
    a pool with labels (a proxy experiment's), how many of those pseudo-labels were right (`pseudo_acc`); at its last
    evaluation, the same two of the teacher on the images the run evaluates (`test_pseudo_kept`, `test_pseudo_acc`,
    or `val_*` when `scored` says they are --val's: the run's `ema_val_pseudo_*`, which need no labels on the pool);
    None for a run without a pool."""
    records = read_metrics(run_dir)
    last = next((r for r in reversed(records) if "pseudo_kept" in r), None)
    if last is None:
        return None
    evaluated = next((r for r in reversed(records) if "ema_val_pseudo_kept" in r), {})
    found = {**{k: last.get(k) for k in LOGGED}, **{f"{scored}_{k}": evaluated.get(f"ema_val_{k}") for k in LOGGED}}
    return {k: float(v) for k, v in found.items() if isinstance(v, (int, float))}


def pool_table(setup: Setup, of_arm: dict[tuple[int, str, str], list[Stage]], point: str) -> dict[str, Any]:
    """Per arm with a pool: its last `pseudo_kept` and `pseudo_acc` per seed, and their means: why a pool paid or
    did not."""
    rows, scored = {}, "val" if setup.val else "test"
    for arm in setup.arms:
        seen = {seed: pool_at_end(of_arm[seed, arm, point][-1].run_dir, scored) for seed in setup.seeds
                if (seed, arm, point) in of_arm}
        seen = {seed: v for seed, v in seen.items() if v is not None}
        if seen:
            rows[arm] = {"per_seed": seen, **{k: mean_std([v[k] for v in seen.values() if k in v])[0]
                                              for k in pool_keys(scored)}}
    return rows


def pool_markdown(pool: dict[str, Any], seeds: list[int], scored: str = "test") -> list[str]:
    """The pool table's lines: per arm, kept and right at the last log, mean and per seed; in brackets the
    teacher's on the images the runs evaluated (`scored`: test, or val with --val)."""
    def cell(v: dict[str, float] | None) -> str:
        if v is None:
            return "–"
        text = f"{v['pseudo_kept']:.2f}" + (f" / {v['pseudo_acc']:.2f}" if "pseudo_acc" in v else "")
        if f"{scored}_pseudo_kept" in v and f"{scored}_pseudo_acc" in v:
            text += f" ({scored} {v[f'{scored}_pseudo_kept']:.2f} / {v[f'{scored}_pseudo_acc']:.2f})"
        return text

    lines = ["", "The pool at the last log: share of pool images kept / share of those pseudo-labels right (a "
             f"labelled pool only); in brackets, the teacher's pseudo-labels of the {scored} images by the same rule "
             "at the last evaluation", "", f"| arm | mean | {' | '.join(f'seed {s}' for s in seeds)} |",
             "|" + " --- |" * (len(seeds) + 2)]
    for arm, row in pool.items():
        mean = {k: row[k] for k in pool_keys(scored) if row.get(k) is not None}
        lines.append(f"| {arm} | {cell(mean)} | {' | '.join(cell(row['per_seed'].get(s)) for s in seeds)} |")
    return lines


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
    write_out_text(out / "compare.md", text)
    write_out_text(out / "compare.json", json.dumps(report, indent=1) + "\n")
    return text

"""The label-efficiency curve of `compare --labels-per-class 2 20 100 all`: each point's labelled subset (drawn per
seed by `build-shards subset`, data_tools/subset.py), a fine-tuning as long at every point, and the curve: one
table of every arm's top-1 per point, and one plot against labels per class on a log axis. See
docs/experiments.md#the-label-efficiency-curve.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any

from experiments.digits import run_build_shards
from vit_mpp.config.engine import ConfigError
from vit_mpp.data import lineage
from vit_mpp.data.lineage import same_place
from vit_mpp.data.manifest import MANIFEST_NAME, manifest_classes, manifest_digest, read_manifest
from vit_mpp.errors import UserError
from vit_mpp.tools.figures import pyplot, save_figure

SUBSETS = "labelled"  # in --out: the subsets, labelled/k<K>_s<seed>


def parse_points(values: list[str] | None, labelled: str) -> list[str]:
    """`--labels-per-class` values (counts, and `all`) -> the points, in the order given: k<K> or all; none: [""]."""
    if not values:
        return [""]
    points = []
    for value in (v for item in values for v in item.split(",") if v):
        if value == "all":
            points.append("all")
        elif value.isdigit() and int(value) > 0:
            points.append(f"k{int(value)}")
        else:
            raise ConfigError(f"--labels-per-class {value!r}: give counts of labelled images per class (2 20 100) "
                              "and 'all' for every label of --labelled")
    if len(set(points)) != len(points):
        raise ConfigError(f"--labels-per-class names a point twice: {' '.join(values)}")
    if "{seed}" in labelled:
        raise ConfigError("--labels-per-class draws each seed's subset from --labelled itself: give one labelled "
                          "set, without '{seed}'")
    return points


def per_class(point: str) -> int:
    return int(point[1:])


def subset_folder(out: Path, point: str, seed: int) -> Path:
    return out / SUBSETS / f"{point}_s{seed}"


def drawn_from(info: dict[str, Any], labelled: str) -> bool:
    """Whether the set of manifest `info` is a subset of --labelled's train split (build-shards subset's record)."""
    source = lineage.drawn_from(info)
    return source is not None and same_place(source[0], labelled) and source[1] == "train"


def make_subsets(labelled: str, points: list[str], seeds: list[int], root: Path, exclude: str = "") -> None:
    """Draw every (point, seed) subset not drawn yet under `root` (`subset_folder`), apart from the subset `exclude`
    (--val drawn from --labelled); an existing one is reused when it was drawn from the same set with the same count,
    seed and exclusion, else one line."""
    now = manifest_digest(read_manifest(exclude)) if exclude else None  # drawn apart from an older --val: differs
    for point in (p for p in points if p.startswith("k")):
        for seed in seeds:
            folder = subset_folder(root, point, seed)
            if (folder / MANIFEST_NAME).is_file():
                drawn = read_manifest(folder).get("subset") or {}
                excluded = [e for e in drawn.get("exclude") or [] if isinstance(e, dict)]
                apart = [e.get("of") for e in excluded]
                same = same_place(str(drawn.get("of")), labelled) and (drawn.get("per_class"), drawn.get("seed")) \
                    == (per_class(point), seed) and len(apart) == bool(exclude) and \
                    all(same_place(str(e.get("of")), exclude) and e.get("manifest_sha256") == now for e in excluded)
                if not same:
                    raise ConfigError(f"{folder} holds another subset ({drawn.get('per_class')} per class of "
                                      f"{drawn.get('of')}, seed {drawn.get('seed')}"
                                      f"{', apart from ' + ', '.join(map(str, apart)) if apart else ''}): give "
                                      "another --out")
            else:
                draw_subset(labelled, folder, per_class(point), seed, exclude)


def draw_subset(labelled: str, folder: Path, count: int, seed: int, exclude: str = "") -> None:
    """`build-shards subset` into `folder` (the product's command, in a child process); its error is this
    command's one line, in compare's words: the count is compare's --labels-per-class."""
    try:
        run_build_shards(["subset", labelled, str(folder), "--per-class", str(count), "--seed", str(seed),
                          "--overwrite", *(["--exclude", exclude] if exclude else [])],
                         f"build-shards subset {labelled}")
    except UserError as e:
        raise ConfigError(f"--labels-per-class {count}: " + str(e).replace("--per-class", "--labels-per-class")
                          .replace(f"--labels-per-class {count}: ", "")) from None


def draft_subsets(labelled: str, points: list[str], seed: int, out: Path, exclude: str = "",
                  ) -> tuple[dict[str, str], Any]:
    """A --dry-run's subsets of one seed, drawn into a temporary folder (nothing is written under --out): returns
    (the folder under --out -> the temporary one, the TemporaryDirectory to keep alive)."""
    tmp = tempfile.TemporaryDirectory(prefix="compare-dry-run-")
    moved = {str(subset_folder(out, p, seed)): str(subset_folder(Path(tmp.name), p, seed))
             for p in points if p.startswith("k")}
    make_subsets(labelled, points, [seed], Path(tmp.name), exclude)
    return moved, tmp


def same_steps(steps: int, here: Any) -> Any:
    """`here` (a fine-tuning's Lengths at a point) with the epochs that make about `steps` steps: at every point of
    the sweep a fine-tuning makes the same number of steps, whatever an epoch of its labelled subset is."""
    if not here.epochs:
        return here
    per_epoch = here.steps // here.epochs
    epochs = max(1, int(steps / per_epoch + 0.5))
    return dataclasses.replace(here, steps=epochs * per_epoch, epochs=epochs)


def labels_per_class(labelled: str, point: str) -> float:
    """The x of a point: its count, or for `all` the mean labelled images per class of --labelled's train split."""
    if point != "all":
        return float(per_class(point))
    info = read_manifest(labelled)
    return info["splits"]["train"]["num_samples"] / max(1, manifest_classes(info))


def labels_per_class_text(curve: dict[str, Any], point: str) -> str:
    """A point's heading: its labelled images per class."""
    x = next(p["per_class"] for p in curve["points"] if p["name"] == point)
    return f"{x:g} labelled images per class" + (" (every label of --labelled)" if point == "all" else "")


def curve_markdown(curve: dict[str, Any]) -> str:
    """The curve as one table: arms down, points across (mean ± std over seeds)."""
    points = curve["points"]
    head = " | ".join(f"{p['name']} ({p['per_class']:g}/class)" for p in points)
    lines = [f"Top-1 against labels per class (mean ± sample std over seeds {', '.join(map(str, curve['seeds']))})",
             "", f"| arm | {head} |", "|" + " --- |" * (len(points) + 1)]
    for arm, row in curve["arms"].items():
        cells = []
        for p in points:
            mean, std = row[p["name"]]
            cells.append("–" if mean is None else f"{mean:.3f}" + (f" ± {std:.3f}" if std is not None else ""))
        lines.append(f"| {arm} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def plot_curve(curve: dict[str, Any], path: Path, title: str) -> None:
    """Top-1 against labels per class, log x, one line per arm with its seeds' spread as error bars."""
    fig, ax = pyplot().subplots(figsize=(6.4, 4.2))
    xs = [p["per_class"] for p in curve["points"]]
    for arm, row in curve["arms"].items():
        pairs = [(x, row[p["name"]]) for x, p in zip(xs, curve["points"]) if row[p["name"]][0] is not None]
        if pairs:
            ax.errorbar([x for x, _ in pairs], [m for _, (m, _) in pairs], yerr=[s or 0 for _, (_, s) in pairs],
                        marker="o", capsize=3, label=arm)
    ax.set_xscale("log")
    ax.set_xticks(xs, [f"{x:g}" for x in xs])
    ax.set_xlabel("labelled images per class (log)")
    ax.set_ylabel("test top-1")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)

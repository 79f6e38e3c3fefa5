"""Planning a build of 10 million inputs: wall time and peak memory of listing and planning (no image is needed).

    python benchmarks/build_shards_plan_bench.py [--rows 10000000] [--formats csv jsonl parquet] [--folder 0]
    python benchmarks/build_shards_plan_bench.py --rows 100000000 --files 100 --plan-parts 10 [--parts 0 1 ...]

Writes a synthetic list of --rows image paths (ImageNet-like, 61 characters:
`datasets/imagenet21k/train/<wnid>/<wnid>_<n>.JPEG`, 1000 string labels) in each format, then, in a fresh child
process per format:

1. lists it (`open_source`: the catalog of ids, labels and splits),
2. plans it (`BuildPlan`: the splits from the seeded shuffle, the ranges, the fingerprint),
3. materialises the item list of every shard range (1000 inputs each), as the build's driver does just before it
   hands a range to a worker, and throws it away.

It prints the seconds of each phase and the child's peak resident memory (ru_maxrss), which the target bounds by
2 GiB (VmHWM, the process's own peak). With --folder N it also lists a tree of N empty .jpg files in 1000 class
folders (the walk keeps only the entries of the folders on its current path).

With --files F --plan-parts G it writes the --rows rows (short paths, `123/000012345.jpg`, integer labels) into F
Parquet files of a folder, as LAION and DataComp ship their lists, and plans them with --plan-parts G: each part
(--parts, default all) in a fresh process as `--num-parts G --part I` would (listing only its own files), then one
machine planning every plan part (`--plan-parts G` alone). Besides the phases above it times the shuffle alone
(every position of every split through its keyed bijection), so each cost can be given per row.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHUNK = 500_000

CHILD = """
import json, resource, sys, tempfile, time
from pathlib import Path
from data_tools.builder.build_plan import BuildPlan
from vit_mpp.data.image_prep import EncodeSettings
from data_tools.builder.shard_layout import ONE_MACHINE, ShardLayout
from data_tools.builder.sources.base import SourceSpec
from data_tools.builder.sources.registry import open_source

spec = SourceSpec(sys.argv[1], kind=sys.argv[2])
times = {}
with tempfile.TemporaryDirectory(dir=sys.argv[3]) as work:
    start = time.perf_counter()
    source = open_source(spec, Path(work))
    times["list"] = time.perf_counter() - start
    start = time.perf_counter()
    plan = BuildPlan(source, spec, ShardLayout(seed=0, val_fraction=0.01, shard_size=1000), EncodeSettings())
    times["plan"] = time.perf_counter() - start
    start = time.perf_counter()
    items = ranges = 0
    for r in plan.ranges(ONE_MACHINE):
        items += len(plan.task(r).items)
        ranges += 1
    times["materialise"] = time.perf_counter() - start
    spill = source.catalog.path.stat().st_size
    source.close()
try:  # VmHWM: this process's own peak (ru_maxrss keeps the parent's peak across exec on Linux)
    status = Path("/proc/self/status").read_text().splitlines()
    peak = next(int(x.split()[1]) for x in status if x.startswith("VmHWM:")) / 1024
except (OSError, StopIteration):
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({**times, "inputs": items, "ranges": ranges, "peak_rss_mib": peak, "spill_mib": spill / 2**20}))
"""


CHILD_PLANNED = """
import json, resource, sys, tempfile, time
from pathlib import Path
import numpy as np
from vit_mpp.data.image_prep import EncodeSettings
from data_tools.builder.shard_layout import ShardLayout, Parts
from data_tools.builder.plan_parts import PlannedBuild
from data_tools.builder.sources.base import SourceSpec

spec = SourceSpec(sys.argv[1], kind="list")
plan_parts, part, num_parts = int(sys.argv[4]), int(sys.argv[2]), int(sys.argv[3])
layout = ShardLayout(seed=0, val_fraction=0.01, shard_size=1000, plan_parts=plan_parts)
parts = Parts(part, num_parts)
times = {}
with tempfile.TemporaryDirectory(dir=sys.argv[5]) as work:
    start = time.perf_counter()
    plan = PlannedBuild(spec, layout, EncodeSettings(), parts, Path(work))  # lists and plans this part's share
    times["list_and_plan"] = time.perf_counter() - start
    start = time.perf_counter()
    for p in plan.owned.values():  # the shuffle alone: every position of every split, in chunks of a range
        for s in p.splits.values():
            for begin in range(0, s.size, 1_000_000):
                s.shuffle(np.arange(begin, min(s.size, begin + 1_000_000), dtype=np.int64))
    times["shuffle"] = time.perf_counter() - start
    start = time.perf_counter()
    items = ranges = 0
    for r in plan.ranges(parts):
        items += len(plan.task(r).items)
        ranges += 1
    times["materialise"] = time.perf_counter() - start
    spill = sum(p.source.catalog.path.stat().st_size for p in plan.owned.values())
    files = sum(len(plan.files[g]) for g in plan.owned)
    plan.close()
status = Path("/proc/self/status").read_text().splitlines()
peak = next(int(x.split()[1]) for x in status if x.startswith("VmHWM:")) / 1024
print(json.dumps({**times, "inputs": items, "ranges": ranges, "files": files, "peak_rss_mib": peak,
                  "spill_mib": spill / 2**20}))
"""


def write_parquet_folder(folder: Path, n: int, files: int) -> None:
    """`n` rows of short paths (`123/000012345.jpg`, 17 characters) and integer labels in `files` Parquet files."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True)
    per = -(-n // files)
    for f in range(files):
        start, end = f * per, min(n, (f + 1) * per)
        with pq.ParquetWriter(folder / f"part-{f:05d}.parquet",
                              pa.schema([("path", pa.string()), ("label", pa.int32())])) as writer:
            for lo in range(start, end, CHUNK):
                ids = range(lo, min(end, lo + CHUNK))
                writer.write_table(pa.table({"path": [f"{i % 1000:03d}/{i:09d}.jpg" for i in ids],
                                             "label": np.arange(lo, lo + len(ids), dtype=np.int32) % 1000}))


def measure_planned(folder: Path, part: int, num_parts: int, plan_parts: int, work: Path) -> dict:
    result = subprocess.run([sys.executable, "-c", CHILD_PLANNED, str(folder), str(part), str(num_parts),
                             str(plan_parts), str(work)], cwd=REPO, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    if result.returncode:
        sys.exit(f"planning part {part} of {num_parts} failed:\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def run_planned(args: argparse.Namespace, tmp: Path) -> None:
    """--files: a folder of Parquet lists planned with --plan-parts, part by part and on one machine."""
    folder = tmp / "lists"
    start = time.perf_counter()
    write_parquet_folder(folder, args.rows, args.files)
    size = sum(p.stat().st_size for p in folder.iterdir())
    print(f"wrote {args.rows:,} rows in {args.files} Parquet files ({size / 2**20:,.0f} MiB) in "
          f"{time.perf_counter() - start:.0f} s", flush=True)
    print(f"\n--plan-parts {args.plan_parts}; times in seconds; peak RSS of the planning process")
    print(f"{'who':16s} {'files':>5s} {'inputs':>12s} {'list+plan':>9s} {'shuffle':>8s} {'ranges':>7s} "
          f"{'total':>7s} {'peak RSS':>10s} {'spill':>9s}")
    runs = [(f"part {i} of {args.plan_parts}", i, args.plan_parts) for i in (args.parts or range(args.plan_parts))]
    if not args.skip_one_machine:
        runs.append(("one machine", 0, 1))
    for name, part, count in runs:
        r = measure_planned(folder, part, count, args.plan_parts, tmp)
        total = r["list_and_plan"] + r["materialise"]  # the shuffle is inside the item lists; timed apart too
        print(f"{name:16s} {r['files']:>5d} {r['inputs']:>12,} {r['list_and_plan']:9.1f} {r['shuffle']:8.1f} "
              f"{r['materialise']:7.1f} {total:7.1f} {r['peak_rss_mib']:>6,.0f} MiB {r['spill_mib']:>5,.0f} MiB",
              flush=True)


def rows(n: int):
    """Chunks of (path, label) of a synthetic ImageNet-like list."""
    for start in range(0, n, CHUNK):
        chunk = []
        for i in range(start, min(n, start + CHUNK)):
            wnid = f"n{(i * 7919) % 1000:08d}"
            path = f"datasets/imagenet21k/train/{wnid}/{wnid}_{i:09d}.JPEG"  # 61 characters
            chunk.append((path, f"class_{(i * 7919) % 1000:04d}"))
        yield chunk


def write_list(path: Path, n: int) -> None:
    fmt = path.suffix
    if fmt == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = pa.schema([("path", pa.string()), ("label", pa.string())])
        with pq.ParquetWriter(path, schema) as writer:
            for chunk in rows(n):
                paths, labels = zip(*chunk)
                writer.write_table(pa.table({"path": list(paths), "label": list(labels)}, schema=schema))
        return
    with open(path, "w") as f:
        if fmt == ".csv":
            f.write("path,label\n")
        for chunk in rows(n):
            if fmt == ".csv":
                f.write("".join(f"{p},{lb}\n" for p, lb in chunk))
            else:
                f.write("".join(f'{{"path": "{p}", "label": "{lb}"}}\n' for p, lb in chunk))


def write_folder(root: Path, n: int) -> None:
    for i in range(n):
        folder = root / f"class_{i % 1000:04d}"
        if i < 1000:
            folder.mkdir(parents=True)
        (folder / f"img_{i:09d}.jpg").touch()


def measure(location: Path, kind: str, work: Path) -> dict:
    result = subprocess.run([sys.executable, "-c", CHILD, str(location), kind, str(work)], cwd=REPO,
                            capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    if result.returncode:
        sys.exit(f"planning {location} failed:\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=10_000_000, help="rows of each synthetic list")
    p.add_argument("--formats", nargs="+", default=["csv", "jsonl", "parquet"], choices=["csv", "jsonl", "parquet"])
    p.add_argument("--folder", type=int, default=0, help="also list a folder tree of this many empty files")
    p.add_argument("--dir", default=None, help="where to write the lists (default: a temporary folder)")
    p.add_argument("--files", type=int, default=0, help="write the rows into this many Parquet files of a folder and "
                                                        "plan them with --plan-parts (instead of --formats)")
    p.add_argument("--plan-parts", type=int, default=10, help="with --files: plan parts")
    p.add_argument("--parts", type=int, nargs="*", default=None, help="with --files: which parts to plan (all)")
    p.add_argument("--skip-one-machine", action="store_true", help="with --files: plan the parts only")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        tmp = Path(tmp)
        if args.files:
            run_planned(args, tmp)
            return
        cases = []
        for fmt in args.formats:
            path = tmp / f"list.{fmt}"
            start = time.perf_counter()
            write_list(path, args.rows)
            print(f"wrote {args.rows:,} rows to {path.name} ({path.stat().st_size / 2**20:,.0f} MiB) in "
                  f"{time.perf_counter() - start:.0f} s", flush=True)
            cases.append((f"{fmt} list", path, "list"))
        if args.folder:
            start = time.perf_counter()
            write_folder(tmp / "tree", args.folder)
            print(f"wrote a tree of {args.folder:,} empty .jpg files in {time.perf_counter() - start:.0f} s",
                  flush=True)
            cases.append(("folder tree", tmp / "tree", "folder"))
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        print(f"\n{cores} core(s); times in seconds; peak RSS of the planning process")
        print(f"{'source':14s} {'inputs':>12s} {'list':>7s} {'plan':>7s} {'ranges':>7s} {'total':>7s} "
              f"{'peak RSS':>10s} {'spill':>9s}")
        for name, path, kind in cases:
            r = measure(path, kind, tmp)
            total = r["list"] + r["plan"] + r["materialise"]
            print(f"{name:14s} {r['inputs']:>12,} {r['list']:7.1f} {r['plan']:7.1f} {r['materialise']:7.1f} "
                  f"{total:7.1f} {r['peak_rss_mib']:>6,.0f} MiB {r['spill_mib']:>5,.0f} MiB", flush=True)


if __name__ == "__main__":
    main()

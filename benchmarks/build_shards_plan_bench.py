"""Planning a build of 10 million inputs: wall time and peak memory of listing and planning (no image is needed).

    python benchmarks/build_shards_plan_bench.py [--rows 10000000] [--formats csv jsonl parquet] [--folder 0]

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
from data_tools.build_plan import BuildPlan
from data_tools.images import EncodeSettings
from data_tools.layout import ONE_MACHINE, Layout
from data_tools.sources import SourceSpec, open_source

spec = SourceSpec(sys.argv[1], kind=sys.argv[2])
times = {}
with tempfile.TemporaryDirectory(dir=sys.argv[3]) as work:
    start = time.perf_counter()
    source = open_source(spec, Path(work))
    times["list"] = time.perf_counter() - start
    start = time.perf_counter()
    plan = BuildPlan(source, spec, Layout(seed=0, val_fraction=0.01, shard_size=1000), EncodeSettings())
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
    args = p.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        tmp = Path(tmp)
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

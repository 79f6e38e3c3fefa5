"""Whole `build-shards index` commands with the compiled tar walker against the Python reader, on one local set, with
the command's default workers and pool: what decides whether the walker earns its place (it must be at least 2x
faster on a large local set).

    python -m benchmarks.index_command_bench [--shards 96] [--samples 2000] [--image-kib 20] [--runs 3]
                                             [--modes cold warm] [--keep DIR]   (from the repository root)

Writes img2dataset-style shards with webdataset's TarWriter (benchmarks/index_bench.py `write_shards`: a pax header
before every member, as img2dataset writes them), then runs `build-shards index SET --out OUT --overwrite --reader R`
for R in compiled and python, `--runs` times, interleaved; `cold` drops the set from the page cache before each
command (a set larger than memory), `warm` does not. Prints each command's median seconds and MB/s, and python /
compiled.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.index_bench import drop_cache, write_shards
from data_tools.indexer.count_shard import compiled_available

BUILD_SHARDS = str(Path(sys.executable).with_name("build-shards"))


def run_index(shards: Path, out: Path, reader: str) -> float:
    """Seconds of one whole command (process start included)."""
    start = time.perf_counter()
    subprocess.run([BUILD_SHARDS, "index", str(shards), "--out", str(out), "--overwrite", "--reader", reader],
                   check=True, capture_output=True)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, default=96)
    parser.add_argument("--samples", type=int, default=2000, help="samples per shard")
    parser.add_argument("--image-kib", type=int, default=20)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--modes", nargs="+", choices=["cold", "warm"], default=["cold", "warm"])
    parser.add_argument("--keep", help="write the set here (reused when it holds --shards tars) instead of a temp dir")
    args = parser.parse_args(argv)
    if not compiled_available():
        sys.exit("error: the compiled walker needs numba: pip install -e '.[fast-index]'")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.keep or tmp) / "set"
        root.mkdir(parents=True, exist_ok=True)
        paths = sorted(root.glob("*.tar"))
        if len(paths) != args.shards:
            paths = write_shards(root, args.shards, args.samples, args.image_kib, writer="webdataset")
        total = sum(p.stat().st_size for p in paths)
        print(f"{len(paths)} shards, {total / 1e9:.2f} GB, {args.shards * args.samples} samples; default workers")
        run_index(root, Path(tmp) / "out", "compiled")  # numba's cache is compiled once, outside the timings
        for mode in args.modes:
            times: dict[str, list[float]] = {"compiled": [], "python": []}
            for _ in range(args.runs):
                for reader in times:
                    if mode == "cold":
                        drop_cache(paths)
                    times[reader].append(run_index(root, Path(tmp) / "out", reader))
            med = {r: statistics.median(t) for r, t in times.items()}
            for reader, t in med.items():
                print(f"{mode:5s} {reader:9s} {t:7.2f} s  {total / t / 1e6:7.0f} MB/s  (runs: "
                      f"{', '.join(f'{x:.2f}' for x in times[reader])})")
            print(f"{mode:5s} python / compiled: {med['python'] / med['compiled']:.2f}x the time")


if __name__ == "__main__":
    main()

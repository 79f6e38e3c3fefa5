"""How fast is build-shards next to a bare PIL loop doing the same work, and how much memory does it need?

    python benchmarks/build_shards_bench.py [--images 2000] [--size 320] [--max-side 256] [--shard-size 100]
    python benchmarks/build_shards_bench.py --rss 100000      # also: peak RSS for 100k tiny images
    python benchmarks/build_shards_bench.py --against /tmp/base --repeats 16   # this checkout vs another

Generates JPEGs (seeded; nothing downloaded), larger than --max-side so every image is decoded, resized and
re-encoded, then times in the same run:

* a bare PIL loop on one core: read, decode fully, convert to RGB, resize, encode JPEG (what build-shards does
  to such an image, minus tar, sha256, journal and processes);
* two bare loops at once, in two processes on half the images each: the speed-up this machine itself gives the
  same work on two busy cores (on a shared VM, two vCPUs are often far from two free cores), the like-for-like
  ceiling of two workers;
* build-shards with 1 and 2 workers.

It prints images/s per core and the ratios, for the best and the median of --repeats interleaved runs; targets:
build-shards with one worker >= 0.95 x the bare loop, two workers >= 1.9 x one worker on 2 free cores. The bare
loop also runs with PIL keeping 4 freed blocks of image memory, as build-shards' workers do (shard_ranges.py
PIL_BLOCKS), for a like-for-like ratio: without that cache each image's memory may go back to the kernel and be
faulted in again, which costs 0-25% depending on the allocator's state. With --rss N
it builds N tiny images (and N/10, for the slope) in a child process and prints the peak resident memory of the
largest process, which should grow with the number of inputs (paths) only.

With --against DIR (another checkout of the repository, e.g. `git worktree add /tmp/base <commit>`) it compares
the two versions on a noisy machine: one long-lived process per checkout (importing that checkout's data_tools)
runs the bare loop and the builds on the same images, the two alternating run by run (in turn first), and each
version's ratio is also taken run by run (its build over the bare loop it ran just before), whose median resists a
machine whose speed drifts by 10-20% within minutes better than best-of-runs does.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
if "--serve" not in sys.argv:  # --serve: the checkout to import is named by --repo (see serve())
    sys.path.insert(0, str(REPO))


def make_images(root: Path, count: int, size: int, seed: int = 0, fmt: str = "JPEG") -> list[Path]:
    """`count` smooth random images of size x (3/4 size) in two class folders."""
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(count):
        folder = root / f"class{i % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        h = max(1, size * 3 // 4)
        small = rng.integers(0, 256, (max(1, h // 8), max(1, size // 8), 3), dtype=np.uint8)
        img = Image.fromarray(small).resize((size, h), Image.BILINEAR)  # smooth: realistic JPEG sizes
        path = folder / f"img{i:07d}.{'jpg' if fmt == 'JPEG' else 'png'}"
        img.save(path, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
        paths.append(path)
    return paths


def bare_loop(paths: list[Path], max_side: int, quality: int, blocks: int = 0) -> float:
    """Images/s of the same work in a plain loop on one core; `blocks`: PIL's cache of freed image memory (0, PIL's
    default: none; build-shards' workers keep 4), restored afterwards."""
    before = Image.core.get_blocks_max()
    Image.core.set_blocks_max(blocks)
    try:
        return _bare_loop(paths, max_side, quality)
    finally:
        Image.core.set_blocks_max(before)


def _bare_loop(paths: list[Path], max_side: int, quality: int) -> float:
    start = time.perf_counter()
    for path in paths:
        img = Image.open(io.BytesIO(path.read_bytes()))
        img.load()
        img = img.convert("RGB")
        scale = max_side / max(img.size)
        img = img.resize((round(img.width * scale), round(img.height * scale)), Image.BICUBIC, reducing_gap=3.0)
        img.save(io.BytesIO(), format="JPEG", quality=quality)
    return len(paths) / (time.perf_counter() - start)


def _half_loop(args: tuple[list[Path], int, int]) -> float:
    return bare_loop(*args, blocks=4)


def two_bare_loops(paths: list[Path], max_side: int, quality: int) -> float:
    """Images/s of two bare loops (4 blocks each, as the workers keep) in two forked processes at once, each on half
    the images: what this machine's two cores give the same work when both are busy, the ceiling of two workers."""
    import multiprocessing as mp

    halves = [(paths[0::2], max_side, quality), (paths[1::2], max_side, quality)]
    with mp.get_context("fork").Pool(2) as pool:
        pool.map(_half_loop, [(h[0][:10], max_side, quality) for h in halves])  # both processes up and warm
        start = time.perf_counter()
        pool.map(_half_loop, halves, chunksize=1)
        return len(paths) / (time.perf_counter() - start)


def timed_build(src: Path, out: Path, workers: int, max_side: int, shard_size: int) -> float:
    from data_tools.cli import main as build_shards  # here: --serve imports the checkout --repo names

    count = sum(1 for _ in src.rglob("*.jpg"))
    shutil.rmtree(out, ignore_errors=True)  # a first build into an empty OUT, as a user's is: deleting the last
    # run's shards (--overwrite) is not work the bare loop does
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()) if "--serve" in sys.argv else contextlib.nullcontext():
        build_shards([str(src), str(out), "--workers", str(workers), "--max-side", str(max_side),
                      "--shard-size", str(shard_size), "--val-fraction", "0"])
    return count / (time.perf_counter() - start)


def serve(args: argparse.Namespace) -> None:
    """--serve: import data_tools from --repo, then answer `bare`, `1` or `2` (workers) lines with img/s."""
    sys.path.insert(0, str(Path(args.repo).resolve()))
    src = Path(args.serve)
    paths = sorted(src.rglob("*.jpg"))
    bare_loop(paths[:50], args.max_side, 90)
    for line in sys.stdin:
        what = line.strip()
        rate = (bare_loop(paths, args.max_side, 90) if what == "bare" else
                timed_build(src, Path(args.out), int(what), args.max_side, args.shard_size))
        print(json.dumps(rate), flush=True)


def compare(args: argparse.Namespace, src: Path, tmp: Path) -> None:
    """--against: this checkout and another, alternating run by run on the same images."""
    trees = {"this": REPO, "against": Path(args.against).resolve()}
    procs = {name: subprocess.Popen([sys.executable, __file__, "--serve", str(src), "--repo", str(tree), "--out",
                                     str(tmp / f"out_{name}"), "--max-side", str(args.max_side), "--shard-size",
                                     str(args.shard_size)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for name, tree in trees.items()}
    runs = {(name, what): [] for name in trees for what in ("bare", "1", "2")}
    for r in range(args.repeats):
        for what in ("bare", "1", "2"):
            for name in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
                procs[name].stdin.write(what + "\n")
                procs[name].stdin.flush()
                runs[(name, what)].append(json.loads(procs[name].stdout.readline()))
    for p in procs.values():
        p.stdin.close()
        p.wait()
    print(f"\n{args.images} images, {args.repeats} runs of each, the two checkouts alternating; img/s best / median")
    for name, tree in trees.items():
        bare, one, two = (runs[(name, w)] for w in ("bare", "1", "2"))
        paired = statistics.median(o / b for o, b in zip(one, bare))
        speedup = statistics.median(t / o for t, o in zip(two, one))
        print(f"{name} ({tree}): bare {max(bare):.1f} / {statistics.median(bare):.1f}; 1 worker {max(one):.1f} / "
              f"{statistics.median(one):.1f}; 2 workers {max(two):.1f} / {statistics.median(two):.1f}\n"
              f"    1 worker / bare: best/best {max(one) / max(bare):.3f}, median of run-by-run {paired:.3f}; "
              f"2 workers / 1 worker: best/best {max(two) / max(one):.2f}, median of run-by-run {speedup:.2f}")


def peak_rss_mib(src: Path, out: Path) -> tuple[float, float]:
    """Peak RSS (MiB) of a build-shards run in a fresh process: (main process, largest worker)."""
    code = ("import resource, sys; from data_tools.cli import main; main(sys.argv[1:]); "
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "
            "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    result = subprocess.run([sys.executable, "-c", code, str(src), str(out), "--workers", "2", "--val-fraction", "0",
                             "--shard-size", "10000", "--min-side", "1", "--overwrite"],
                            check=True, cwd=REPO, capture_output=True, text=True)
    main_kib, worker_kib = map(int, result.stdout.strip().splitlines()[-1].split())
    return main_kib / 1024, worker_kib / 1024  # Linux reports KiB


def report(runs: dict[str, list[float]]) -> None:
    """Best and median of each, and the ratios (targets: 1 worker >= 0.95 x the bare loop, 2 workers >= 1.9 x 1)."""
    # The fastest run is the least disturbed one (timeit's rule); the median shows how much the machine moved.
    for label, pick in (("best", max), ("median", statistics.median)):
        bare, cached, pair, one, two = (pick(v) for v in runs.values())
        print(f"{label}:\n  bare PIL loop          {bare:7.1f} img/s  (1 core; PIL's defaults)")
        print(f"  bare loop, 4 blocks    {cached:7.1f} img/s  (PIL keeping 4 freed blocks, as the workers do)")
        print(f"  two bare loops at once {pair:7.1f} img/s  (4 blocks, 2 processes: {pair / cached:.2f}x one loop, "
              "this machine's own two-core speed-up)")
        print(f"  build-shards 1 worker  {one:7.1f} img/s  ratio to bare loop {one / bare:.2f}  (target >= 0.95); "
              f"to the loop with 4 blocks {one / cached:.2f}")
        print(f"  build-shards 2 workers {two:7.1f} img/s  {two / 2:.1f} img/s per worker; "
              f"speed-up over 1 worker {two / one:.2f}x  (target >= 1.90 on 2 free cores); to two bare loops at "
              f"once {two / pair:.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=2000, help="images for the throughput comparison")
    p.add_argument("--size", type=int, default=320, help="width of the generated images")
    p.add_argument("--max-side", type=int, default=256, help="build-shards --max-side (below --size: re-encode)")
    p.add_argument("--shard-size", type=int, default=100,
                   help="build-shards --shard-size; workers share whole shards, so keep shards >> workers")
    p.add_argument("--repeats", type=int, default=5, help="interleaved runs of each")
    p.add_argument("--rss", type=int, default=0, help="also measure peak RSS for this many tiny images (0: skip)")
    p.add_argument("--against", default=None, help="another checkout to compare with, run by run")
    p.add_argument("--serve", default=None, help=argparse.SUPPRESS)  # images folder: a --against child
    p.add_argument("--repo", default=str(REPO), help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        serve(args)
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        paths = make_images(tmp / "src", args.images, args.size)
        if args.against:
            compare(args, tmp / "src", tmp)
            return
        bare_loop(paths[:50], args.max_side, 90)  # warm the page cache and PIL's codecs
        runs: dict[str, list[float]] = {"bare": [], "cached": [], "pair": [], "one": [], "two": []}
        for _ in range(args.repeats):  # interleaved, so a noisy neighbour hits all of them alike
            runs["bare"].append(bare_loop(paths, args.max_side, 90))
            runs["cached"].append(bare_loop(paths, args.max_side, 90, blocks=4))
            runs["pair"].append(two_bare_loops(paths, args.max_side, 90))
            runs["one"].append(timed_build(tmp / "src", tmp / "out", 1, args.max_side, args.shard_size))
            runs["two"].append(timed_build(tmp / "src", tmp / "out", 2, args.max_side, args.shard_size))
        print(f"\n{args.images} images {args.size}px -> max side {args.max_side}, shards of {args.shard_size}, "
              f"{cores} core(s) available; {args.repeats} interleaved runs of each")
        report(runs)
        if args.rss:
            small = max(1, args.rss // 10)
            make_images(tmp / "tiny", args.rss, 8, fmt="PNG")
            make_images(tmp / "tiny_small", small, 8, fmt="PNG")
            main_small, worker_small = peak_rss_mib(tmp / "tiny_small", tmp / "out_small")
            main_large, worker_large = peak_rss_mib(tmp / "tiny", tmp / "out_large")
            per_input = (main_large - main_small) * 2**20 / max(1, args.rss - small)
            print(f"peak RSS, main process: {main_small:.0f} MiB for {small} inputs, {main_large:.0f} MiB for "
                  f"{args.rss} inputs (~{per_input:.0f} bytes per input); largest worker: {worker_small:.0f} / "
                  f"{worker_large:.0f} MiB")


if __name__ == "__main__":
    main()

"""Throughput of `build-shards index` against a plain read of the same tars (open each one, read every byte), with
the same number of workers of the same kind, measured in the same run.

    python -m benchmarks.index_bench [--shards 16] [--samples 2000] [--image-kib 20] [--workers 1 2 4]
                                     [--pools process thread] [--modes cold warm http capped] [--capped-mbps 100]
                                     [--runs 3] [--writer ours|webdataset]
                                     (from the repository root)

Writes img2dataset-style shards (`KEY.jpg` of about `--image-kib` KiB, `KEY.txt`, `KEY.json`; no labels) with
build-shards' own writer (plain ustar headers) or `--writer webdataset`'s TarWriter (as img2dataset writes them: a pax
header before every member, for its float mtime), then for
each mode, pool kind and worker count runs the plain loop and the index's reading of every shard
(`data_tools.indexer.index_tars.read_shards`: read, group into samples as webdataset does, tally extensions and labels)
`--runs` times, interleaved. Prints MB/s and shards/s (median) of each and its ratio to the plain loop. Modes:

* `cold`: local files dropped from this machine's page cache before every pass (`posix_fadvise(DONTNEED)`), as
  when indexing a set larger than memory; the disk (here a virtual one) sets the pace;
* `warm`: local files already in the page cache, where reading is only a memory copy: what is left is the cost of
  parsing, the worst case for the ratio;
* `http`: the shards served from 127.0.0.1 by this script's server (http.server) in its own process, read through
  vit_mpp/data/urls.py (urllib, an idle deadline on every read), as any remote read; loopback has no network, so
  this is the cost of the reading code itself;
* `capped`: the same server, each connection capped at `--capped-mbps` MB/s, as an object store serves one stream
  (S3: on the order of 100 MB/s per connection): where indexing at scale usually reads.

Last, the parsing alone, in one process on 4 shards in the page cache: this reader against `tarfile` with
webdataset's grouping (how the training stream reads a shard).
"""

from __future__ import annotations

import argparse
import functools
import http.server
import io
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import webdataset as wds
from PIL import Image

from data_tools.builder.writer import ShardWriter
from data_tools.indexer.find_tars import ShardRef
from data_tools.indexer.index_tars import IndexOptions, read_shards
from vit_mpp.data import urls


def write_shards(root: Path, shards: int, samples: int, image_kib: int, writer: str = "ours") -> list[Path]:
    """img2dataset-style shards: 32 distinct noise JPEGs of about `image_kib` KiB, a caption and a json each, written
    by `writer`: build-shards' ShardWriter, or webdataset's TarWriter."""
    rng = np.random.default_rng(0)
    side = int((image_kib * 1024 / 0.9) ** 0.5 / 1.4)  # noise at quality 90: about 0.9 bytes per pixel per channel
    jpegs = []
    for _ in range(32):
        out = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(out, "JPEG", quality=90)
        jpegs.append(out.getvalue())
    paths = []
    for s in range(shards):
        path = root / f"{s:05d}.tar"
        sink = ShardWriter(path) if writer == "ours" else wds.TarWriter(str(path))
        for i in range(samples):
            key = f"{s:05d}{i:04d}"
            files = {"jpg": jpegs[i % 32], "txt": f"a caption for {key}".encode(),
                     "json": json.dumps({"key": key, "width": side, "height": side}).encode()}
            if writer == "ours":
                sink.write(key, files)
            else:
                sink.write({"__key__": key, **files})
        sink.close()
        paths.append(path)
    return paths


def drop_cache(paths: list[Path]) -> None:
    """Evict the files from the page cache (their pages are clean once synced)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_all(url: str) -> int:
    """The plain loop's work for one shard: open it and read every byte."""
    n = 0
    with urls.open_url(url) as f:
        while chunk := f.read(urls.BUFFER):
            n += len(chunk)
    return n


def _pool(kind: str, workers: int) -> Executor:
    if kind == "thread":
        return ThreadPoolExecutor(workers)
    return ProcessPoolExecutor(workers, mp_context=mp.get_context("fork"))


def plain(shard_urls: list[str], kind: str, workers: int) -> int:
    with _pool(kind, workers) as pool:
        return sum(pool.map(read_all, shard_urls))


def indexed(shard_urls: list[str], kind: str, workers: int) -> int:
    refs = [ShardRef("train", u, None) for u in shard_urls]
    results = read_shards(refs, IndexOptions(workers=workers, pool=kind), lambda *_: None)
    assert all(not r.problem for r in results), [r.reason for r in results]
    return sum(r.bytes for r in results)


class CappedHandler(http.server.SimpleHTTPRequestHandler):
    """Serves files at most `mbps` MB/s per connection (sleeping between 64 KiB pieces)."""

    mbps = 100.0

    def log_message(self, *args) -> None:
        pass

    def copyfile(self, source, outputfile) -> None:
        start, sent = time.perf_counter(), 0
        while piece := source.read(1 << 16):
            outputfile.write(piece)
            sent += len(piece)
            ahead = sent / (self.mbps * 1e6) - (time.perf_counter() - start)
            if ahead > 0:
                time.sleep(ahead)


def serve(root: str, port: int, mbps: float) -> None:
    """The benchmark's HTTP server (`--serve`): `root` on 127.0.0.1:`port`, uncapped when `mbps` is 0."""
    CappedHandler.mbps = mbps
    handler = CappedHandler if mbps else http.server.SimpleHTTPRequestHandler
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), functools.partial(handler, directory=root))
    server.serve_forever()


def start_server(root: Path, mbps: float) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.index_bench", "--serve", str(root), str(port),
                             str(mbps)], cwd=Path(__file__).resolve().parents[1])
    time.sleep(1.5)
    return proc, f"http://127.0.0.1:{port}"


def parser_rates(paths: list[Path], runs: int) -> str:
    """One process, files in the page cache: this reader (vit_mpp/data/tar_scan.py) against `tarfile` with
    webdataset's grouping, which is how the training stream reads a shard."""
    import webdataset as wds

    from vit_mpp.data.tar_scan import TarReader, samples

    def ours() -> int:
        total = 0
        for path in paths:
            with open(path, "rb", buffering=0) as f:
                total += sum(1 for _ in samples(TarReader(f), frozenset({"cls"})))
        return total

    def webdataset() -> int:
        total = 0
        for path in paths:
            with open(path, "rb", buffering=1 << 20) as f:
                files = wds.tariterators.tar_file_expander([{"url": str(path), "stream": f}])
                total += sum(1 for _ in wds.tariterators.group_by_keys(files))
        return total

    times: dict[str, list[float]] = {"ours": [], "webdataset": []}
    for _ in range(runs):
        for name, fn in (("ours", ours), ("webdataset", webdataset)):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    mb = sum(p.stat().st_size for p in paths) / 1e6
    a, b = (mb / statistics.median(times[k]) for k in ("ours", "webdataset"))
    return (f"parsing in one process, {len(paths)} shards in the page cache: vit_mpp/data/tar_scan.py {a:.0f} MB/s, "
            f"tarfile + webdataset's grouping {b:.0f} MB/s ({a / b:.1f}x)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(shard_urls: list[str], kind: str, workers: int, runs: int, before: Callable[[], None]) -> dict:
    """Median seconds of the plain loop and of the index over `runs` interleaved passes."""
    passes: dict[str, Callable[[], int]] = {"plain": lambda: plain(shard_urls, kind, workers),
                                            "index": functools.partial(indexed, shard_urls, kind, workers)}
    times: dict[str, list[float]] = {name: [] for name in passes}
    size = 0
    for _ in range(runs):
        for name, fn in passes.items():
            before()
            start = time.perf_counter()
            size = fn()
            times[name].append(time.perf_counter() - start)
    return {"bytes": size, **{k: statistics.median(v) for k, v in times.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--samples", type=int, default=2000, help="samples per shard")
    parser.add_argument("--image-kib", type=int, default=20)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--pools", nargs="+", choices=["process", "thread"], default=["process", "thread"])
    parser.add_argument("--modes", nargs="+", choices=["cold", "warm", "http", "capped"],
                        default=["cold", "warm", "http", "capped"])
    parser.add_argument("--capped-mbps", type=float, default=100.0, help="per connection, in the capped mode")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--writer", choices=["ours", "webdataset"], default="ours",
                        help="who writes the shards: build-shards (ustar) or webdataset's TarWriter (pax headers)")
    parser.add_argument("--serve", nargs=3, help=argparse.SUPPRESS)  # ROOT PORT MBPS: the server process
    args = parser.parse_args()
    if args.serve:
        serve(args.serve[0], int(args.serve[1]), float(args.serve[2]))
        return
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        root = Path(tmp)
        paths = write_shards(root, args.shards, args.samples, args.image_kib, args.writer)
        total = sum(p.stat().st_size for p in paths)
        print(f"{args.shards} shards x {args.samples} samples (jpg ~{args.image_kib} KiB, txt, json; written by "
              f"{'build-shards' if args.writer == 'ours' else 'webdataset'}): "
              f"{total / 1e6:,.0f} MB; {os.cpu_count()} cores; median of {args.runs} interleaved runs")
        print(f"{'mode':5s} {'pool':8s} {'workers':>7s} {'plain MB/s':>11s} {'index MB/s':>11s} "
              f"{'index shards/s':>15s} {'ratio':>6s}")
        servers = {mode: start_server(root, args.capped_mbps if mode == "capped" else 0)
                   for mode in args.modes if mode in ("http", "capped")}
        try:
            for mode in args.modes:
                shard_urls = ([f"{servers[mode][1]}/{p.name}" for p in paths] if mode in servers
                              else [str(p) for p in paths])
                before = (lambda: drop_cache(paths)) if mode == "cold" else (lambda: None)
                if mode == "warm":
                    plain(shard_urls, "thread", 1)  # into the page cache
                for kind in args.pools:
                    for workers in args.workers:
                        m = measure(shard_urls, kind, workers, args.runs, before)
                        mb = m["bytes"] / 1e6
                        print(f"{mode:5s} {kind:8s} {workers:7d} {mb / m['plain']:11.0f} {mb / m['index']:11.0f} "
                              f"{len(paths) / m['index']:15.1f} {m['plain'] / m['index']:5.2f}x", flush=True)
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait()
        print(parser_rates(paths[:4], args.runs))


if __name__ == "__main__":
    main()

"""What the deadline on reads costs: shard samples read over loopback HTTP through vit_mpp/data/urls.py (urllib, every
read under an idle deadline in a helper thread), against webdataset's `gopen` (a curl pipe without a deadline, what
the stream used before); and a local file read through vit_mpp/data/urls.py (the same deadline) against a plain `open`,
all on the same tar and measured in the same run.

    python -m benchmarks.remote_read_bench [--mib 256] [--sample-kib 100] [--runs 5]     (from the repository root)

Writes one tar of `--mib` MiB (samples of `--sample-kib` KiB of random bytes, so nothing compresses), serves it from
127.0.0.1, then reads every sample `--runs` times per reader, interleaved. Prints MiB/s (best and median) and the
ratio of each reader to webdataset's gopen, and of the deadlined local read to the plain one.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import webdataset as wds

from data_tools.builder.writer import ShardWriter
from tests.helpers.servers import serve_directory
from vit_mpp.data import urls

PLAIN, DEADLINED = "local file, plain open (no deadline)", "local file, urls.open_url (deadline)"


def count_samples(stream) -> int:
    files = wds.tariterators.tar_file_expander([{"url": "bench", "stream": stream}])
    return sum(1 for _ in wds.tariterators.group_by_keys(files))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--sample-kib", type=int, default=100)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        writer = ShardWriter(root / "shard.tar")
        n = args.mib * 1024 // args.sample_kib
        for i in range(n):
            writer.write(f"s{i:07d}", {"bin": rng.bytes(args.sample_kib * 1024), "cls": b"0"})
        size = writer.close()[1] / 2**20
        with serve_directory(root) as base:
            readers = {
                PLAIN: lambda: open(root / "shard.tar", "rb", buffering=urls.BUFFER),
                DEADLINED: lambda: urls.open_url(str(root / "shard.tar")),
                "webdataset gopen (curl, no deadline)": lambda: wds.gopen(f"{base}/shard.tar", "rb"),
                "urls.open_url (urllib, deadline)": lambda: urls.open_url(f"{base}/shard.tar"),
            }
            times: dict[str, list[float]] = {name: [] for name in readers}
            for _ in range(args.runs):
                for name, opener in readers.items():
                    start = time.perf_counter()
                    stream = opener()
                    assert count_samples(stream) == n
                    stream.close()
                    times[name].append(time.perf_counter() - start)
    base_name = "webdataset gopen (curl, no deadline)"
    base_best = size / min(times[base_name])
    print(f"{n} samples, {size:.0f} MiB, {args.runs} interleaved runs per reader")
    for name, ts in times.items():
        best, median = size / min(ts), size / statistics.median(ts)
        print(f"{name:40s} best {best:7.0f} MiB/s  median {median:7.0f} MiB/s  ratio (best) {best / base_best:.2f}x")
    plain, deadlined = times[PLAIN], times[DEADLINED]
    print(f"local file, deadline / plain open: best {min(plain) / min(deadlined):.2f}x, "
          f"median {statistics.median(plain) / statistics.median(deadlined):.2f}x")


if __name__ == "__main__":
    main()

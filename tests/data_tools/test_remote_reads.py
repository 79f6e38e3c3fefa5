"""Remote lists and parquet files are read with deadlines and bounded retries (vit_mpp/data/urls.py), never hang.

A server that stops sending in the middle of a list (CSV, or Parquet through the seekable opener) stops
build-shards with one `error:` line once the idle deadline passes; a parquet row group that stalls is retried a
bounded number of times and then reported. Parquet over http works, seeking by byte ranges. The servers run on
127.0.0.1; the deadline is shortened through `vit_mpp.data.urls.READ_TIMEOUT_S`, read when a file is opened.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import io
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from data_tools.builder.sources.hf_stream import ParquetStreamReader
from data_tools.cli import main as build_main
from data_tools.demo_images import generate
from tests.helpers.processes import REPO, ctrl_c_enabled, interrupt_paused, subprocess_env
from tests.helpers.servers import FaultyHandler, serve, serve_faulty
from vit_mpp.data import deadlines, urls

DEADLINE_S = 2.0
BOUND_S = 30.0  # well under the 60 s default deadline: only the shortened one can end a stalled read this soon


class RangeHandler(http.server.SimpleHTTPRequestHandler):
    """Serves files with byte ranges, as object stores and CDNs do (what a seekable remote read needs). A GET of a
    path in `stall` sends its headers and then nothing until `release` is set (a hung server); `gets` records the
    path of every GET."""

    stall: set[str] = set()
    gets: list[str] = []
    release = threading.Event()

    def log_message(self, *args) -> None:
        pass

    def _body(self) -> tuple[bytes, int, int] | None:
        path = self.translate_path(self.path)
        if not os.path.isfile(path):
            self.send_error(404)
            return None
        data = Path(path).read_bytes()
        start, end = 0, len(data)
        wanted = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        if wanted:
            start, end = int(wanted[1]), min(len(data), int(wanted[2]) + 1) if wanted[2] else len(data)
            if start >= len(data):
                self.send_error(416)
                return None
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(end - start))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        return data, start, end

    def do_HEAD(self) -> None:
        self._body()

    def do_GET(self) -> None:
        self.gets.append(self.path)
        body = self._body()
        if body is None:
            return
        if self.path in self.stall:
            self.release.wait(timeout=120)
            self.close_connection = True
            return
        data, start, end = body
        self.wfile.write(data[start:end])


def serve_ranges(directory: Path, stall: set[str] = frozenset()) -> contextlib.AbstractContextManager[str]:
    """Serve `directory` with RangeHandler on 127.0.0.1 while the block runs; yields the base URL."""
    RangeHandler.stall, RangeHandler.gets, RangeHandler.release = set(stall), [], threading.Event()
    return serve(RangeHandler, directory, RangeHandler.release)


def build_with_deadline(*args: str, limit_s: float = 90.0) -> tuple[subprocess.CompletedProcess, float]:
    """build-shards in a child process whose remote reads have the DEADLINE_S idle deadline; (result, seconds).
    A child that is still running after `limit_s` is killed (a hang fails the test, not the suite)."""
    code = ("import sys; from vit_mpp.data import urls; urls.READ_TIMEOUT_S = float(sys.argv[1]); "
            "from data_tools.cli import main; main(sys.argv[2:])")
    start = time.monotonic()
    try:
        result = subprocess.run([sys.executable, "-c", code, str(DEADLINE_S), *args], capture_output=True, text=True,
                                timeout=limit_s, env=subprocess_env(), cwd=REPO)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"build-shards still running after {limit_s:g} s: a stalled read hangs it") from None
    return result, time.monotonic() - start


def error_lines(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("error:")]


def write_list_source(root: Path) -> list[str]:
    """A class-folder tree under root/images and the relative paths of its images, sorted."""
    generate(root / "images", per_class=3, size=16)
    return sorted(p.relative_to(root).as_posix() for p in (root / "images").rglob("*.jpg"))


def test_a_stalled_csv_list_stops_the_build_with_one_error_line(tmp_path):
    paths = write_list_source(tmp_path)
    (tmp_path / "list.csv").write_text("path\n" + "".join(f"{p}\n" for p in paths * 50))
    with serve_faulty(tmp_path) as base:
        FaultyHandler.faults["/list.csv"] = ("stall", 1)
        result, seconds = build_with_deadline(f"{base}/list.csv", str(tmp_path / "out"))
    assert result.returncode == 2, result.stderr
    lines = error_lines(result)
    assert len(lines) == 1 and "list.csv" in lines[0] and "StreamStalled" in lines[0], result.stderr
    assert "Traceback" not in result.stderr
    assert seconds < BOUND_S, f"took {seconds:.1f} s"
    assert not (tmp_path / "out" / "_info.json").exists()


def test_a_stalled_parquet_list_stops_the_build_with_one_error_line(tmp_path):
    paths = write_list_source(tmp_path)
    pq.write_table(pa.table({"path": paths}), tmp_path / "list.parquet")
    with serve_ranges(tmp_path, stall={"/list.parquet"}) as base:
        result, seconds = build_with_deadline(f"{base}/list.parquet", str(tmp_path / "out"), "--source-kind", "list")
    assert result.returncode == 2, result.stderr
    lines = error_lines(result)
    assert len(lines) == 1 and "list.parquet" in lines[0] and "StreamStalled" in lines[0], result.stderr
    assert "Traceback" not in result.stderr
    assert seconds < BOUND_S, f"took {seconds:.1f} s"


def test_ctrl_c_while_a_worker_waits_on_a_stalled_image_is_one_line_at_once(tmp_path):
    # a list over HTTP whose images are read by the workers, one of them stalled: the workers are told to stop and
    # leave that read at once, instead of after its deadline (60 s) and retries
    paths = write_list_source(tmp_path)
    (tmp_path / "list.csv").write_text("path\n" + "".join(f"{p}\n" for p in paths))
    with serve_faulty(tmp_path) as base:
        FaultyHandler.faults[f"/{paths[3]}"] = ("stall", 100)
        proc = subprocess.Popen([sys.executable, "-m", "data_tools.cli", f"{base}/list.csv",
                                 str(tmp_path / "out"), "--workers", "2", "--shard-size", "2", "--val-fraction", "0"],
                                env=subprocess_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, preexec_fn=ctrl_c_enabled)
        deadline = time.monotonic() + 60
        while f"/{paths[3]}" not in FaultyHandler.requests and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.01)
        time.sleep(0.5)  # half the image has come: the worker now waits for the rest
        start = time.monotonic()
        interrupt_paused(proc)
        try:
            _, err = proc.communicate(timeout=90)
        finally:
            proc.kill()
        seconds = time.monotonic() - start
    lines = err.strip().splitlines()
    assert proc.returncode == 130 and len(lines) == 1 and lines[0].startswith("error: interrupted"), err
    assert seconds < 15, f"took {seconds:.1f} s"
    assert not (tmp_path / "out" / "_info.json").exists()
    assert not list((tmp_path / "out").glob("*.tmp"))  # the abandoned range's temporary tar is removed


def test_parquet_is_read_over_http_through_the_seekable_opener(tmp_path):
    table = pa.table({"n": list(range(5000)), "s": [f"row {i}" for i in range(5000)]})
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=1000)
    data = (tmp_path / "t.parquet").read_bytes()
    with serve_ranges(tmp_path) as base:
        with urls.open_seekable(f"{base}/t.parquet") as f:
            assert f.seekable()
            assert pq.ParquetFile(f).read_row_group(3).column("n").to_pylist() == list(range(3000, 4000))
            f.seek(-4, io.SEEK_END)
            assert f.read() == b"PAR1" and f.tell() == len(data)
            f.seek(10)
            assert f.read(100) == data[10:110]
        assert urls.read_seekable(f"{base}/t.parquet", pq.read_table).equals(table)
        assert any(get == "/t.parquet" for get in RangeHandler.gets)


def test_a_parquet_list_over_http_builds_the_same_shards_as_the_local_list(tmp_path):
    paths = write_list_source(tmp_path)
    labels = [p.split("/")[1] for p in paths]
    pq.write_table(pa.table({"path": paths, "label": labels}), tmp_path / "list.parquet")
    args = ["--workers", "1", "--shard-size", "5", "--min-side", "4"]
    build_main([str(tmp_path / "list.parquet"), str(tmp_path / "local"), *args])
    with serve_ranges(tmp_path) as base:
        build_main([f"{base}/list.parquet", str(tmp_path / "remote"), *args])  # auto: a parquet list, read remotely

    def digests(out: Path) -> dict[str, str]:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.iterdir())
                if p.suffix == ".tar" or p.name == "failures.jsonl"}

    assert digests(tmp_path / "remote") == digests(tmp_path / "local")
    assert len([n for n in digests(tmp_path / "local") if n.endswith(".tar")]) >= 2


def finish_within(seconds: float, fn: Callable[[], object]) -> object:
    """fn() in a daemon thread; fails the test if it has not returned after `seconds` (a hang)."""
    box: dict[str, object] = {}
    worker = threading.Thread(target=lambda: box.update(value=fn()), daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"still reading after {seconds:g} s: a stalled read hangs"
    return box["value"]


def png(seed: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(out, format="PNG")
    return out.getvalue()


def test_streamed_parquet_row_groups_are_read_over_http_and_a_stall_is_retried_then_reported(tmp_path, monkeypatch):
    images = [png(i) for i in range(6)]
    pq.write_table(pa.table({"image": [{"bytes": b, "path": None} for b in images]}), tmp_path / "d.parquet",
                   row_group_size=3)
    (tmp_path / "stalls.parquet").write_bytes((tmp_path / "d.parquet").read_bytes())
    monkeypatch.setattr(urls, "READ_TIMEOUT_S", 0.5)
    monkeypatch.setattr(urls, "WAIT_S", 0.01)
    with serve_ranges(tmp_path, stall={"/stalls.parquet"}) as base:
        reader = ParquetStreamReader([f"{base}/d.parquet", f"{base}/stalls.parquet"], [[3, 3], [3, 3]], "image")
        assert list(finish_within(60, lambda: list(reader.read_many([4, 0, 5])))) == [images[4], images[0], images[5]]
        start = time.monotonic()
        results = finish_within(60, lambda: list(reader.read_many([6, 7])))
        seconds = time.monotonic() - start
        attempts = RangeHandler.gets.count("/stalls.parquet")
    assert all(isinstance(r, OSError) for r in results)
    assert "stalls.parquet row group 0" in str(results[0]) and "StreamStalled" in str(results[0])
    assert results[1] is results[0]  # one failed read of the row group, reported for each of its rows
    assert attempts == urls.READ_RETRIES + 1, RangeHandler.gets
    assert seconds < BOUND_S


class Asked(Exception):
    """What a `while_waiting` check raises once the test asks the reader to stop."""


def test_a_waiting_read_runs_its_check_and_leaves_at_once_when_it_raises(tmp_path):
    (tmp_path / "f.bin").write_bytes(os.urandom(200_000))
    asked = threading.Event()

    def check() -> None:
        if asked.is_set():
            raise Asked

    def stopped_after(seconds: float, read: Callable[[], object]) -> float:
        asked.clear()
        threading.Timer(seconds, asked.set).start()
        start = time.monotonic()
        try:
            read()
        except Asked:
            return time.monotonic() - start
        raise AssertionError("the read ended without being stopped")

    with serve_faulty(tmp_path) as base:
        FaultyHandler.faults["/f.bin"] = ("stall", 100)  # half the body, then silence
        deadlines.while_waiting(check)
        try:
            # a read stalled in the middle of the body: left within a check's interval, not at its 30 s deadline
            assert stopped_after(0.3, lambda: urls.read_stream(f"{base}/f.bin", lambda s: s.read(), timeout=30,
                                                               retries=0)) < 5
            # the pause before a retry (a connection cut short is retried after 20 s here)
            FaultyHandler.faults["/f.bin"] = ("cut", 100)
            assert stopped_after(0.3, lambda: urls.read_stream(f"{base}/f.bin", lambda s: s.read(), timeout=30,
                                                               retries=3, wait_s=20)) < 5
        finally:
            deadlines.while_waiting(None)
    # without a check, a read waits for its data as before
    assert urls.read_stream(str(tmp_path / "f.bin"), lambda s: s.read()) == (tmp_path / "f.bin").read_bytes()


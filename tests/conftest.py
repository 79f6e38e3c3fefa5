"""Shared fixtures: tiny image folders and shard sets made on the fly (nothing is downloaded)."""

from __future__ import annotations

import contextlib
import functools
import http.server
import io
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from data_tools.cli import main as build_shards_main
from data_tools.demo_images import generate
from data_tools.writer import ShardWriter
from vit_mpp.config import ModelConfig
from vit_mpp.export import write_export
from vit_mpp.manifest import write_manifest

REPO = Path(__file__).resolve().parents[1]


def subprocess_env() -> dict[str, str]:
    """Environment for child processes: the repo importable, one thread each (the machine has 2 cores)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_module(module: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """`python -m module args...` in a child process."""
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout,
                          env=subprocess_env(), cwd=REPO)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # keep the test output clean
        pass


class FaultyHandler(http.server.SimpleHTTPRequestHandler):
    """Serves files, but for the first `faults[path] = (kind, n)` requests of a path sends half the body and then
    either cuts the connection (`cut`: the headers promised all of it) or goes silent with the connection open until
    the server stops (`stall`: a hung server or proxy). Every request path is recorded in `requests`."""

    faults: dict[str, tuple[str, int]] = {}
    requests: list[str] = []
    release = threading.Event()

    def log_message(self, *args) -> None:
        pass

    def copyfile(self, source, outputfile) -> None:
        self.requests.append(self.path)
        kind, left = self.faults.get(self.path, ("", 0))
        if left <= 0:
            super().copyfile(source, outputfile)
            return
        self.faults[self.path] = (kind, left - 1)
        data = source.read()
        outputfile.write(data[: len(data) // 2])
        outputfile.flush()
        if kind == "stall":
            self.release.wait(timeout=600)
        self.close_connection = True


@contextlib.contextmanager
def serve_faulty(directory: Path) -> Iterator[str]:
    """Serve `directory` with FaultyHandler on 127.0.0.1 while the block runs (faults reset); yields the base URL."""
    FaultyHandler.faults, FaultyHandler.requests, FaultyHandler.release = {}, [], threading.Event()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(FaultyHandler,
                                                                                 directory=str(directory)))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        FaultyHandler.release.set()
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def serve_directory(directory: Path) -> Iterator[str]:
    """Serve `directory` over http on 127.0.0.1 (a free port) while the block runs; yields the base URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler,
                                                                                 directory=str(directory)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def png_bytes(rng: np.random.Generator, size: int = 16) -> bytes:
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(out, format="PNG")
    return out.getvalue()


def write_shard_set(out_dir: Path, lengths: dict[str, list[int]], size: int = 16, seed: int = 0) -> Path:
    """Shards with the given per-shard sample counts per split; sample i of a split is labelled i % 3 and keyed
    `<split>_<i>`, so tests can check exactly which samples arrive."""
    rng = np.random.default_rng(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    splits = {}
    for split, counts in lengths.items():
        filenames, index = [], 0
        for s, n in enumerate(counts):
            name = f"{split}-{s:06d}.tar"
            w = ShardWriter(out_dir / name)
            for _ in range(n):
                w.write(f"{split}_{index:06d}", {"png": png_bytes(rng, size), "cls": str(index % 3).encode(),
                                                 "json": json.dumps({"i": index}).encode()})
                index += 1
            w.close()
            filenames.append(name)
        splits[split] = {"name": split, "num_samples": sum(counts), "filenames": filenames, "shard_lengths": counts}
    write_manifest(out_dir, {"name": "test", "splits": splits, "num_classes": 3, "class_names": ["a", "b", "c"]})
    return out_dir


def write_encoder_export(out_dir: Path, encoder, cfg: ModelConfig, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5)) -> Path:
    """A pretraining export of `encoder` (a timm ViT without head, built from `cfg`), as pretrain writes it."""
    return write_export(out_dir, encoder.state_dict(), cfg, kind="encoder", mean=mean, std=std)


@pytest.fixture(scope="session")
def demo_folder(tmp_path_factory) -> Path:
    """A class-folder tree of 6 x 16 small generated images."""
    return generate(tmp_path_factory.mktemp("images"), per_class=16, size=24, seed=0)


@pytest.fixture(scope="session")
def demo_shards(tmp_path_factory, demo_folder) -> Path:
    """build-shards output for `demo_folder` (train 80, val 16), in shards of 16."""
    out = tmp_path_factory.mktemp("shards")
    build_shards_main([str(demo_folder), str(out), "--shard-size", "16", "--val-fraction", "0.1667", "--min-side", "4"])
    return out

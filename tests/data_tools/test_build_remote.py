"""build-shards with object storage: OUT (and the list SOURCE) as fsspec URLs.

An upload that keeps failing stops the build with one line, leaves no partial object and no journal entry, and the
re-run finishes it with the bytes of a local build; a stalled upload is abandoned and redone. The in-process tests
use fsspec's memory filesystem (with a subclass that breaks or stalls uploads); the loopback test runs the real
s3fs client against moto's S3 server on 127.0.0.1 (package `moto[server]`), with the list on S3 too.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from data_tools.cli import main as build_main
from tests.helpers.build import make_tree, result_files
from tests.helpers.processes import REPO, ctrl_c_enabled, interrupt_paused, subprocess_env
from vit_mpp.data import uploads


class _BrokenUpload:
    """A file being uploaded whose connection breaks after 3000 bytes (or stalls once, for `stall`)."""

    def __init__(self, target, stall: bool) -> None:
        self.target, self.stall, self.sent = target, stall, 0

    def write(self, data: bytes) -> int:
        if self.stall:
            time.sleep(5)  # longer than the test's upload deadline
        if self.sent + len(data) > 3000:
            self.target.write(data[: 3000 - self.sent])
            raise ConnectionResetError(104, "Connection reset by peer")
        self.sent += len(data)
        return self.target.write(data)

    def close(self) -> None:
        self.target.close()


class FlakyFS(MemoryFileSystem):
    """fsspec's in-process memory store, with uploads of chosen names that break (every time) or stall (once)."""

    protocol = "flaky"
    breaking: set[str] = set()
    stalling: set[str] = set()

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(str(path).removeprefix("flaky://"))

    def _open(self, path, mode="rb", **kwargs):
        f = super()._open(path, mode, **kwargs)
        name = os.path.basename(path).split(".upload-")[0]  # an upload attempt's own name (uploads.upload_file)
        if "w" in mode and (name in FlakyFS.breaking or name in FlakyFS.stalling):
            stall = name in FlakyFS.stalling
            FlakyFS.stalling.discard(name)
            return _BrokenUpload(f, stall)
        return f


@pytest.fixture
def flaky(monkeypatch):
    fsspec.register_implementation("flaky", FlakyFS, clobber=True)
    # short deadline and waits, so the retries take a second instead of minutes
    monkeypatch.setattr(uploads, "upload_file", functools.partial(uploads.upload_file, timeout=1.0, wait_s=0.01))
    FlakyFS.breaking, FlakyFS.stalling = set(), set()
    yield FlakyFS()
    FlakyFS.store.clear()


def remote_files(fs, root: str) -> dict[str, bytes]:
    names = [os.path.basename(p) for p in fs.ls(root, detail=False)]
    return {n: fs.cat(f"{root}/{n}") for n in sorted(names) if n.endswith(".tar") or n in ("_info.json",
                                                                                             "failures.jsonl")}


def test_an_interrupted_upload_is_redone_on_resume_never_half_visible(tmp_path, flaky, capsys):
    make_tree(tmp_path / "src", {"a": 20, "b": 20}, size=40)
    (tmp_path / "src" / "a" / "broken.jpg").write_bytes(b"not an image")
    args = ["--shard-size", "5", "--max-side", "32", "--workers", "2"]
    build_main([str(tmp_path / "src"), str(tmp_path / "local"), *args])
    expected = result_files(tmp_path / "local")

    FlakyFS.breaking = {"train-000002.tar"}
    with pytest.raises(SystemExit) as exit_info:
        build_main([str(tmp_path / "src"), "flaky://bucket/out", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 1 and len(err) == 1, err
    assert err[0].startswith("error: uploading train-000002.tar to flaky://bucket/out failed after 4 attempts")
    assert "re-run the same command" in err[0]
    names = [os.path.basename(p) for p in flaky.ls("/bucket/out", detail=False)]
    assert "train-000002.tar" not in names and "_info.json" not in names  # nothing half-written is visible
    journal = flaky.cat("/bucket/out/_journal.jsonl").decode().splitlines()
    journaled = {(r["split"], r["range"]) for r in map(json.loads, journal[1:])}
    assert ("train", 2) not in journaled

    FlakyFS.breaking = set()  # the network is back: the same command finishes the build
    build_main([str(tmp_path / "src"), "flaky://bucket/out", *args])
    out = capsys.readouterr().out
    assert f"in {len(journaled)} finished ranges" in out and len(journaled) >= 1
    assert remote_files(flaky, "/bucket/out") == expected


def test_a_stalled_upload_is_abandoned_and_redone(tmp_path, flaky):
    make_tree(tmp_path / "src", {"a": 12}, size=24)
    args = ["--shard-size", "4", "--val-fraction", "0", "--workers", "1"]
    build_main([str(tmp_path / "src"), str(tmp_path / "local"), *args])
    FlakyFS.stalling = {"train-000001.tar"}
    start = time.perf_counter()
    build_main([str(tmp_path / "src"), "flaky://bucket/stall", *args])
    assert time.perf_counter() - start < 30
    assert not FlakyFS.stalling  # the stall happened, and the build finished anyway
    assert remote_files(flaky, "/bucket/stall") == result_files(tmp_path / "local")
    build_main(["inspect", "flaky://bucket/stall", "--samples", "0"])  # verifies every remote shard (exit 0)
    flaky.pipe("/bucket/stall/train-000001.tar", b"damaged")
    with pytest.raises(SystemExit) as exit_info:
        build_main(["inspect", "flaky://bucket/stall", "--samples", "0"])
    assert exit_info.value.code == 1


class LateFS(MemoryFileSystem):
    """A store that shows a file while it is written (as SFTP does), whose first open of a chosen object for writing
    answers late: after the upload's deadline, once the next attempt has finished."""

    protocol = "late"
    slow: set[str] = set()

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(str(path).removeprefix("late://"))

    def _open(self, path, mode="rb", **kwargs):
        name = os.path.basename(path).split(".upload-")[0]
        if "w" in mode and name in LateFS.slow:
            LateFS.slow.discard(name)
            time.sleep(1.5)
        return super()._open(path, mode, **kwargs)


def test_an_abandoned_upload_acting_late_never_touches_the_finished_object(tmp_path):
    # The abandoned attempt's open, answered after the retry finished, created an empty object under the final name:
    # a shard the build had journaled became 0 bytes (on resume, 1 of 8 finished ranges was found short)
    fsspec.register_implementation("late", LateFS, clobber=True)
    data = os.urandom(5000)
    (tmp_path / "shard.tar").write_bytes(data)
    LateFS.slow = {"shard.tar"}
    fs = LateFS()
    try:
        uploads.upload_file(str(tmp_path / "shard.tar"), "late://late-test/out/shard.tar", timeout=0.5, wait_s=0.01)
        assert not LateFS.slow  # the first attempt was abandoned
        time.sleep(2.0)  # its open has answered by now
        assert fs.cat("/late-test/out/shard.tar") == data
        others = [p for p in fs.ls("/late-test/out", detail=False) if not p.endswith("/shard.tar")]
        assert not others, others  # the abandoned attempt's own name too, created by its late open: removed after it
    finally:
        fs.rm("/late-test", recursive=True)


class BackendError(Exception):
    """A store client's own error type for network trouble (aiohttp's ClientPayloadError, botocore's), no OSError."""


class ForeignErrorFS(MemoryFileSystem):
    """A store whose writes of chosen objects fail with its own error type, `failures[name]` more times."""

    protocol = "foreign"
    failures: dict[str, int] = {}

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(str(path).removeprefix("foreign://"))

    def _open(self, path, mode="rb", **kwargs):
        name = os.path.basename(path).split(".upload-")[0]
        if "w" in mode and ForeignErrorFS.failures.get(name, 0) > 0:
            ForeignErrorFS.failures[name] -= 1
            raise BackendError("Response payload is not completed")
        return super()._open(path, mode, **kwargs)


def test_a_store_client_s_own_error_is_retried_then_one_os_error(tmp_path):
    fsspec.register_implementation("foreign", ForeignErrorFS, clobber=True)
    (tmp_path / "shard.tar").write_bytes(b"x" * 100)
    fs = ForeignErrorFS()
    try:
        ForeignErrorFS.failures = {"shard.tar": 2}  # retried like a reset connection, and the third attempt lands
        uploads.upload_file(str(tmp_path / "shard.tar"), "foreign://f/out/shard.tar", retries=3, wait_s=0.01)
        assert fs.cat("/f/out/shard.tar") == b"x" * 100 and ForeignErrorFS.failures["shard.tar"] == 0
        ForeignErrorFS.failures = {"other.tar": 10}
        with pytest.raises(OSError, match="foreign://f/out/other.tar: BackendError: Response payload is not"):
            uploads.upload_file(str(tmp_path / "shard.tar"), "foreign://f/out/other.tar", retries=2, wait_s=0.01)
        assert ForeignErrorFS.failures["other.tar"] == 7  # the first attempt and 2 retries, then one error
    finally:
        fs.rm("/f", recursive=True)


@pytest.fixture
def s3_server(monkeypatch):
    """moto's S3 server on a free port of 127.0.0.1, with s3fs pointed at it (through fsspec's env config)."""
    pytest.importorskip("s3fs")
    server_module = pytest.importorskip("moto.server")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "FSSPEC_S3_ENDPOINT_URL": f"http://{host}:{port}"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    import fsspec.config

    monkeypatch.setattr(fsspec.config, "conf", {})
    fsspec.config.set_conf_env(fsspec.config.conf)
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.mkdir("bucket")
    yield fs, env
    server.stop()


def test_s3_list_and_out_on_a_loopback_server_interrupted_then_resumed(tmp_path, s3_server):
    fs, env = s3_server
    files = make_tree(tmp_path / "data" / "imgs", {"cat": 40, "dog": 40}, size=24)
    rows = "path,label\n" + "".join(f"imgs/{p},{p.split('/')[0]}\n" for p in sorted(files))
    (tmp_path / "data" / "list.csv").write_text(rows)
    for rel, data in files.items():
        fs.pipe(f"bucket/data/imgs/{rel}", data)
    fs.pipe("bucket/data/list.csv", rows.encode())
    args = ["--shard-size", "2", "--workers", "2"]
    build_main([str(tmp_path / "data" / "list.csv"), str(tmp_path / "local"), *args])
    expected = {k: v for k, v in result_files(tmp_path / "local").items() if k != "_info.json"}

    command = [sys.executable, "-m", "data_tools.cli", "s3://bucket/data/list.csv", "s3://bucket/out", *args]
    child_env = {**subprocess_env(), **env}
    proc = subprocess.Popen(command, env=child_env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=ctrl_c_enabled)
    deadline = time.time() + 60
    while proc.poll() is None and time.time() < deadline:
        fs.invalidate_cache()
        try:
            if len([p for p in fs.ls("bucket/out", detail=False) if p.endswith(".tar")]) >= 6:
                break
        except FileNotFoundError:  # nothing uploaded yet
            pass
        time.sleep(0.02)
    interrupt_paused(proc)  # Ctrl-C while shards are being uploaded
    _, err = proc.communicate(timeout=60)
    fs.invalidate_cache()
    assert not fs.exists("bucket/out/_info.json"), "the build finished before it was interrupted"
    assert proc.returncode == 130 and len(err.strip().splitlines()) == 1, err
    assert "re-run the same command to resume" in err

    result = subprocess.run(command, env=child_env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "resuming" in result.stdout, result.stdout + result.stderr
    fs.invalidate_cache()
    info = json.loads(fs.cat("bucket/out/_info.json"))
    assert info["source"]["path"] == "s3://bucket/data/list.csv" and info["splits"]["train"]["num_samples"] == 72
    got = {os.path.basename(p): fs.cat(p) for p in fs.ls("bucket/out", detail=False)}
    assert {k: got[k] for k in expected} == expected
    listed = {f for s in info["splits"].values() for f in s["filenames"]}
    assert {n for n in got if n.endswith(".tar")} == listed  # no stray object from the interrupted run
    assert not [n for n in got if n.endswith(".tmp") or "probe" in n]


def test_an_unwritable_or_unknown_out_url_is_one_line(tmp_path, capsys):
    make_tree(tmp_path / "src", {"a": 3})
    with pytest.raises(SystemExit) as exit_info:
        build_main([str(tmp_path / "src"), "nosuchproto://bucket/out"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and err[0].startswith("error: cannot write to"), err
    assert Path(tmp_path / "src").exists()

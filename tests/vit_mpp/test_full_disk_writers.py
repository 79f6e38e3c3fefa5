"""A full disk under every real writer of a run: the run directory on a small tmpfs (tests/helpers/disks.py), filled
to its last byte just as one writer starts (safetensors' writer of Accelerate's model file, torch.save, Accelerate's
save_state, torch.distributed.checkpoint's of a run launched with FSDP, the checkpoint's marker, the export,
metrics.jsonl, the sample audit, the model card, the curves figure, summary.json), so that the writer itself meets
the kernel's ENOSPC: one `error:` line naming the path and the space, status 2, the previous checkpoint kept whole,
and the same command goes on once space is freed. No OSError is injected: only the moment is chosen. The same
through the real launcher, two processes: tests/end_to_end/."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

from pretrain.__main__ import main as pretrain_main
from tests.helpers.disks import small_disk
from tests.helpers.processes import in_process
from tests.helpers.runs import read_metrics

DISK_KIB = 8192


def fill(disk: Path) -> None:
    """Write `disk` full, to its last byte (ever smaller writes until not one byte fits)."""
    fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        for size in (1 << 20, 1 << 16, 1 << 12, 1 << 8, 1):
            chunk = b"\0" * size
            while True:
                try:
                    os.write(fd, chunk)
                except OSError as e:
                    assert e.errno == errno.ENOSPC
                    break
    finally:
        os.close(fd)
    assert os.statvfs(disk).f_bavail == 0


PAGE = 4096  # tmpfs allocates a file's space a page at a time


def needs_a_page(path: Path, more: int) -> bool:
    """Whether appending `more` bytes to `path` needs a page the file does not have yet (else a full disk lets the
    write through: it fits the file's last page, and nothing fails)."""
    size = path.stat().st_size if path.exists() else 0
    return size == 0 or (size % PAGE) + more > PAGE


def filled_before(monkeypatch, owner: object, name: str, disk: Path, when: Writer) -> list[int]:
    """Replace `owner.name` by itself preceded, at the first of its calls from the `when.call`-th on for which
    `when.fails(*args)` (a write that needs space), by `fill(disk)`; returns the call count."""
    real: Callable = getattr(owner, name)
    calls, filled = [0], [False]

    def writer(*args, **kwargs):
        calls[0] += 1
        if not filled[0] and calls[0] >= when.call and when.fails(*args):
            fill(disk)
            filled[0] = True
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, writer)
    return calls


def pretrain(shards: Path, run_dir: Path, steps: int) -> list[str]:
    return ["--config", "configs/pretrain/tiny.yaml", f"data.shards={shards}", f"train.run_dir={run_dir}",
            "data.num_workers=0", f"train.steps={steps}", "train.ckpt_every=2", "train.keep_last=1",
            "train.eval_every=4", "train.record_samples=true", "train.log_every=1", "knn.train_images=16"]


@dataclass(frozen=True)
class Writer:
    """A writer of a run: where it is looked up (`owner().name`), from which of its calls on the disk is filled
    (the first for which `fails(*its arguments)`: one that needs space), and what its error line names."""

    owner: Callable[[], object]
    name: str
    call: int
    names: str
    fails: Callable[..., bool] = lambda *args: True
    setup: Callable[[pytest.MonkeyPatch], None] = lambda monkeypatch: None
    steps: int = 8  # long enough for the writes that append to cross a page after the first checkpoints
    env: tuple[tuple[str, str], ...] = ()  # the run's environment (a launch with FSDP), in both of its attempts


def _writers() -> dict[str, Writer]:
    import json

    import accelerate.utils.other
    import torch

    from vit_mpp.models import export, hub
    from vit_mpp.run.durability import checkpoint, sharded_state
    from vit_mpp.run.metering import metrics_log, sample_audit, step_meter

    def record_needs_a_page(log, record) -> bool:
        return needs_a_page(log.path, len(json.dumps(record)) + 1)

    buffered = [0]  # bytes of the audit's lines since its last flush (asking its file would flush them)
    real_dumps = json.dumps

    def counted_dumps(obj, **kwargs):
        text = real_dumps(obj, **kwargs)
        buffered[0] += len(text) + 1
        return text

    def audit_needs_a_page(audit) -> bool:  # its buffered lines, which the flush writes
        full, buffered[0] = audit.file is not None and needs_a_page(audit.path, buffered[0]), 0
        return full

    def count_audit_lines(monkeypatch) -> None:
        monkeypatch.setattr(sample_audit, "json", SimpleNamespace(dumps=counted_dumps))

    return {  # the checkpoint of step 2 is whole before each (the checkpoint of step 4 for those in the steps)
        "safetensors (Accelerate's model file)": Writer(lambda: accelerate.utils.other, "safe_save_file", 2,
                                                        "step_000004"),
        "torch.save (optimizer, RNG, rank state)": Writer(lambda: torch, "save", 4, "step_000004"),
        "Accelerate's save_state": Writer(lambda: checkpoint.Accelerator, "save_state", 2, "step_000004"),
        "torch.distributed.checkpoint (a run launched with FSDP)": Writer(
            lambda: sharded_state, "save_sharded", 2, "step_000004",
            env=(("ACCELERATE_USE_FSDP", "true"), ("FSDP_VERSION", "2"))),
        "the checkpoint's marker": Writer(lambda: checkpoint, "write_atomic", 2, "step_000004"),
        "metrics.jsonl": Writer(lambda: metrics_log.MetricsLog, "write", 3, "metrics.jsonl", record_needs_a_page,
                                steps=24),
        "the sample audit": Writer(lambda: sample_audit.SampleAudit, "flush", 2, "rank_0.jsonl",
                                   audit_needs_a_page, count_audit_lines, steps=24),
        "the curves figure": Writer(lambda: step_meter, "write_run_curves", 1, "curves.png"),
        "the curves figure, replaced": Writer(lambda: step_meter, "write_run_curves", 2, "curves.png",
                                              setup=lambda mp: mp.setattr(step_meter, "CURVES_EVERY_S", 0.0)),
        "the export": Writer(lambda: export, "_write_files", 1, "export"),
        "the model card": Writer(lambda: hub, "write_card", 1, "export"),
        "summary.json": Writer(lambda: step_meter, "write_summary", 1, "summary.json"),
    }


WRITERS = list(_writers())


@pytest.mark.parametrize("writer", WRITERS)
def test_a_disk_full_as_a_writer_starts_is_one_line_and_the_run_goes_on_once_there_is_room(demo_shards, tmp_path,
                                                                                           monkeypatch, capsys,
                                                                                           writer):
    when = _writers()[writer]
    for name, value in when.env:
        monkeypatch.setenv(name, value)
    with small_disk(tmp_path / "disk", DISK_KIB) as disk:
        run_dir = disk / "run"
        when.setup(monkeypatch)
        calls = filled_before(monkeypatch, when.owner(), when.name, disk, when)
        code, out, err = in_process(pretrain_main, pretrain(demo_shards, run_dir, when.steps), capsys)
        assert calls[0] >= when.call, f"{writer}: called {calls[0]} times, not {when.call}"
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1, err
        line = lines[0]
        assert line.startswith("error: ") and "cannot be written: no space left on device" in line, line
        assert when.names in line and str(run_dir) in line and "MB free there" in line, line
        assert "run the same command to go on" in line, line
        assert not [p for p in run_dir.rglob("*") if p.name.endswith((".tmp", ".new"))]
        read_metrics(run_dir)  # every line whole: no record torn by the full disk
        saved = sorted((run_dir / "checkpoints").glob("step_*"))
        assert saved and all((p / "trainer_state.json").is_file() for p in saved), saved  # nothing half-written
        monkeypatch.undo()
        for name, value in when.env:
            monkeypatch.setenv(name, value)
        (disk / "filler").unlink()  # space freed
        code, out, err = in_process(pretrain_main, pretrain(demo_shards, run_dir, when.steps), capsys)
        assert code == 0, err[-3000:]
        assert f"exported encoder to {run_dir / 'export'}" in out
        assert [r["step"] for r in read_metrics(run_dir) if "loss" in r] == list(range(1, when.steps + 1))


def test_a_disk_full_as_fine_tuning_writes_its_confusion_matrix_is_one_line_and_it_goes_on(demo_shards,
                                                                                           encoder_export, tmp_path,
                                                                                           monkeypatch, capsys):
    # The chaos soak: fine-tuning's confusion_matrix.json, written with a plain write, was a traceback.
    from finetune import scoring
    from finetune.__main__ import main as finetune_main

    argv = ["--config", "configs/finetune/tiny.yaml", f"data.shards={demo_shards}",
            f"init.checkpoint={encoder_export}", "data.num_workers=0"]
    with small_disk(tmp_path / "disk", DISK_KIB) as disk:
        run_dir = disk / "run"
        calls = filled_before(monkeypatch, scoring, "write_atomic", disk,
                              Writer(lambda: scoring, "write_atomic", 1, "confusion_matrix.json"))
        code, out, err = in_process(finetune_main, [*argv, f"train.run_dir={run_dir}"], capsys)
        lines = [line for line in err.splitlines() if line.strip()]
        assert calls[0] == 1 and code == 2 and len(lines) == 1, err
        assert lines[0].startswith(f"error: {run_dir / 'confusion_matrix.json'} cannot be written: no space left "
                                   "on device"), lines
        monkeypatch.undo()
        (disk / "filler").unlink()
        code, out, err = in_process(finetune_main, [*argv, f"train.run_dir={run_dir}"], capsys)
        assert code == 0 and (run_dir / "confusion_matrix.json").is_file(), err[-3000:]

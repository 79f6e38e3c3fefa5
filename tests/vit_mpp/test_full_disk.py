"""A full disk at any write of a run is one line naming the path and what it needed, leaves nothing half-written
that could be taken for the newest (a checkpoint without its marker, an export's `.new` files), keeps the previous
checkpoint, and the same command goes on once there is room. Injected ENOSPC where a disk is hard to fill exactly;
a small tmpfs for a whole run (tests/helpers/disks.py). build-shards on a full disk:
tests/data_tools/test_build_shards_faults.py."""

from __future__ import annotations

import errno
import os

import torch

from pretrain.__main__ import main as pretrain_main
from tests.helpers.disks import resize, small_disk
from tests.helpers.processes import in_process
from tests.helpers.runs import read_metrics
from vit_mpp.models import export as export_module


def pretrain(shards, run_dir, *overrides: str) -> list[str]:
    return ["--config", "configs/pretrain/tiny.yaml", f"data.shards={shards}", f"train.run_dir={run_dir}",
            "data.num_workers=0", "train.steps=6", "train.ckpt_every=3", "train.keep_last=1", *overrides]


def full(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_a_checkpoint_that_meets_a_full_disk_is_removed_and_the_previous_one_resumes(demo_shards, tmp_path,
                                                                                         monkeypatch, capsys):
    # Tracebacks on both ranks (`inline_container.cc ... unexpected pos`), and an incomplete newest checkpoint.
    run_dir = tmp_path / "run"
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        if "step_000006" in str(f):
            full()
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    code, _, err = in_process(pretrain_main, pretrain(demo_shards, run_dir), capsys)
    line = one_error_line(err)
    assert code == 2 and f"{run_dir / 'checkpoints' / 'step_000006'} cannot be written: no space left" in line, line
    assert "MB needed" in line and "run the same command to go on" in line, line
    assert not (run_dir / "checkpoints" / "step_000006").exists()
    assert (run_dir / "checkpoints" / "step_000003" / "trainer_state.json").is_file()  # untouched
    monkeypatch.setattr(torch, "save", real_save)
    code, out, err = in_process(pretrain_main, pretrain(demo_shards, run_dir), capsys)
    assert code == 0 and "resuming from" in out and "(step 3)" in out, err
    assert [r["step"] for r in read_metrics(run_dir) if "loss" in r] == [2, 4, 6]


def test_an_export_that_meets_a_full_disk_leaves_no_new_files_and_the_run_exports_again(demo_shards, tmp_path,
                                                                                          monkeypatch, capsys):
    run_dir = tmp_path / "run"
    monkeypatch.setattr(export_module, "save", full)  # safetensors' serialiser, as the weights are written
    code, _, err = in_process(pretrain_main, pretrain(demo_shards, run_dir), capsys)
    line = one_error_line(err)
    assert code == 2 and f"{run_dir / 'export'} cannot be written: no space left on device" in line, line
    assert not list((run_dir / "export").glob("*.new"))
    monkeypatch.undo()
    code, out, err = in_process(pretrain_main, pretrain(demo_shards, run_dir), capsys)
    assert code == 0 and f"exported encoder to {run_dir / 'export'}" in out, err


def test_a_run_on_a_disk_that_fills_up_stops_in_one_line_and_goes_on_once_there_is_room(demo_shards, tmp_path,
                                                                                          capsys):
    with small_disk(tmp_path / "disk", 1024) as disk:  # the first checkpoint fits, the second does not
        run_dir = disk / "run"
        code, _, err = in_process(pretrain_main, pretrain(demo_shards, run_dir), capsys)
        line = one_error_line(err)
        assert code == 2 and "cannot be written: no space left on device" in line, line
        leftovers = [p for p in run_dir.rglob("*") if p.name.endswith((".tmp", ".new"))]
        assert not leftovers, leftovers
        newest = sorted((run_dir / "checkpoints").glob("step_*"))
        assert all((p / "trainer_state.json").is_file() for p in newest), newest  # nothing half-written
        resize(disk, 8192)
        code, out, err = in_process(pretrain_main, pretrain(demo_shards, run_dir), capsys)
        assert code == 0 and f"exported encoder to {run_dir / 'export'}" in out, err
        assert [r["step"] for r in read_metrics(run_dir) if "loss" in r] == [2, 4, 6]

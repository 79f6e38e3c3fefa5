"""No host synchronisation inside a pretraining step outside log steps: the step (pretrain/mpp.py,
pretrain/targets.py, vit_mpp/run/metering/step_meter.py, vit_mpp/data/stream.py `to_device`, the loop) never reads a
tensor back to the host, so a GPU runs ahead of Python; the stop agreement (vit_mpp/processes/stop_agreement.py
`StopGate.agree`) reads one, which lives on the CPU by design.

On the CPU, every Python-level read of a tensor's value (`.item()`, `.tolist()`, `.cpu()`, `.numpy()`, `bool()`,
`float()`, `int()`, `__index__`) is counted and attributed to the first frame of the repository's own code; on a
CUDA device, `torch.cuda.set_sync_debug_mode("error")` also catches what torch's own kernels would wait for.
"""

from __future__ import annotations

import collections
import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.helpers.runs import read_metrics, run_tiny_pretrain
from tests.helpers.shards import write_shard_set
from vit_mpp.processes.stop_agreement import StopGate
from vit_mpp.run.loop import Loop, itstime

REPO = Path(__file__).resolve().parents[2]
OWN = tuple(f"{REPO / folder}/" for folder in ("pretrain", "finetune", "vit_mpp"))
READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")
# The step's own code: a read from any of these outside a log step would stall a GPU every step.
STEP_CODE = ("pretrain/train.py", "pretrain/mpp.py", "pretrain/targets.py", "vit_mpp/run/metering/step_meter.py",
             "vit_mpp/data/stream.py:to_device", "vit_mpp/run/metering/sample_audit.py",
             "vit_mpp/run/durability/checkpoint.py", *(f"vit_mpp/run/loop.py:{f}" for f in (
                 "Loop.step", "Loop._when_due", "optimizer_step", "Schedule.lr", "set_lr", "itstime")))
STEPS = 4  # train.log_every is larger: only the last step logs
RUN = ("train.steps=4", "train.log_every=100", "train.eval_every=0", "data.val_split=", "train.ckpt_every=100")


@dataclass(frozen=True)
class Read:
    """One read of a tensor's value: the step it fell in, the phase of the step (`data`: taking the step's batches
    and the stop agreement; `step`: from there to the end of the step's log call), whether the step logs, the first
    frame of the repository's code (`path:function`), the file of the frame that made the call, the tensor's
    device."""

    step: int
    phase: str
    log_step: bool
    where: str
    caller: str
    device: str

    def of(self, code: str) -> bool:
        return self.where == code or self.where.split(":")[0] == code


class Steps:
    """Where the loop is: its step (counted at each `Loop.step`) and the phase of the step."""

    def __init__(self, total: int, log_every: int) -> None:
        self.total, self.log_every, self.step, self.phase = total, log_every, 0, "start"

    @property
    def log_step(self) -> bool:
        return itstime(self.step, self.log_every, self.total)

    def watch(self, monkeypatch: pytest.MonkeyPatch, on_step=None) -> None:
        """Follow the loop through the calls it makes anyway: `on_step(steps)` when a step's computation starts,
        `on_step(None)` when it ends."""
        step, agree = Loop.step, Loop._agree

        def watched_step(loop, *args, **kwargs):
            self.step, self.phase = self.step + 1, "data"
            try:
                return step(loop, *args, **kwargs)
            finally:
                if on_step is not None:
                    on_step(None)
                self.phase = "after"

        def watched_agree(loop, *args, **kwargs):
            agree(loop, *args, **kwargs)
            if self.phase == "data":  # the step's agreement (an evaluation's come after the step)
                self.phase = "step"
                if on_step is not None:
                    on_step(self)

        monkeypatch.setattr(Loop, "step", watched_step)
        monkeypatch.setattr(Loop, "_agree", watched_agree)


def _relative(filename: str) -> str:
    """A file of the repository relative to it, an installed one relative to its site-packages."""
    if "site-packages/" in filename:
        return filename.rpartition("site-packages/")[2]
    path = Path(filename)
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else filename


@contextlib.contextmanager
def counting_reads(steps: Steps) -> Iterator[list[Read]]:
    """Every read of a tensor's value made in this process while inside, in the order made."""
    reads: list[Read] = []

    def counted(name: str):
        original = getattr(torch.Tensor, name)

        def read(tensor, *args, **kwargs):
            frame = sys._getframe(1)
            caller = _relative(frame.f_code.co_filename)
            while frame is not None and not frame.f_code.co_filename.startswith(OWN):
                frame = frame.f_back
            name = getattr(frame.f_code, "co_qualname", frame.f_code.co_name) if frame is not None else ""
            where = "" if frame is None else f"{_relative(frame.f_code.co_filename)}:{name}"
            reads.append(Read(steps.step, steps.phase, steps.log_step, where, caller, tensor.device.type))
            return original(tensor, *args, **kwargs)

        return read

    own = {name: torch.Tensor.__dict__[name] for name in READS if name in torch.Tensor.__dict__}
    try:
        for name in READS:
            setattr(torch.Tensor, name, counted(name))
        yield reads
    finally:
        for name in READS:
            if name in own:
                setattr(torch.Tensor, name, own[name])
            else:
                delattr(torch.Tensor, name)


@contextlib.contextmanager
def one_process_group(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The stop agreement as a run of several processes makes it (one all-reduce over its own gloo group), in a
    one-process group: a single process otherwise agrees with itself without a tensor."""
    import torch.distributed as dist

    init = StopGate.__init__

    def with_group(gate, *args, **kwargs):
        init(gate, *args, **kwargs)
        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        gate.group = dist.new_group(backend="gloo")

    monkeypatch.setattr(StopGate, "__init__", with_group)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return write_shard_set(tmp_path_factory.mktemp("shards"), {"train": [16, 16]})


def test_no_step_reads_a_tensor_back_outside_log_steps(shards, tmp_path, monkeypatch):
    steps = Steps(STEPS, 100)
    steps.watch(monkeypatch)
    with one_process_group(monkeypatch), counting_reads(steps) as reads:
        run_tiny_pretrain(shards, tmp_path / "run", *RUN)
    assert [r["step"] for r in read_metrics(tmp_path / "run") if "loss" in r] == [STEPS]  # only the last step logged
    plain = [r for r in reads if 1 <= r.step and not r.log_step]
    assert {r.step for r in plain} == set(range(1, STEPS))
    # torch's own optimizer reads its step count, which it keeps on the host when it is not fused (the CPU's
    # foreach AdamW here; the fused AdamW that CUDA runs use by default keeps it on the device): not the step's code.
    plain = [r for r in plain if not (r.caller.startswith("torch/optim/") and r.device == "cpu")]

    # Nothing in the step's own code, in any phase of a step that does not log.
    assert [r for r in plain if any(r.of(code) for code in STEP_CODE)] == []
    # From the end of the stop agreement to the end of the step: no read at all.
    assert [r for r in plain if r.phase == "step"] == []
    # While the step's batches are taken: the loader's decoding (a worker process's work; here, with
    # data.num_workers=0, in this one) and the stop agreement, once a step, each on CPU tensors only.
    taking = [r for r in plain if r.phase == "data"]
    agreements = [r for r in taking if r.where == "vit_mpp/processes/stop_agreement.py:StopGate.agree"]
    assert {r.step for r in agreements} == set(range(1, STEPS)), "the agreement is made before every step"
    assert {r.device for r in agreements} == {"cpu"}
    assert all(r.where.startswith("vit_mpp/data/") and r.device == "cpu" for r in taking if r not in agreements)
    # The counting sees what it must: the log step reads its metrics back once (step_meter.py's one collective).
    logged = collections.Counter(r.where for r in reads if r.step == STEPS and r.phase == "step")
    assert logged["vit_mpp/run/metering/step_meter.py:StepMeter.log"] >= 1, logged


def _cuda_run(shards: Path, run_dir: Path, monkeypatch: pytest.MonkeyPatch, *overrides: str) -> list[int]:
    """A tiny pretraining on the CUDA device with torch's sync debug mode at "error" around the computation of every
    step but the first (lazy initialisation) and the log steps; the steps it watched."""
    watched: list[int] = []

    def on_step(steps: Steps | None) -> None:
        if steps is not None and steps.step > 1 and not steps.log_step:
            watched.append(steps.step)
            torch.cuda.set_sync_debug_mode("error")
        else:
            torch.cuda.set_sync_debug_mode(0)

    Steps(6, 100).watch(monkeypatch, on_step)
    try:
        run_tiny_pretrain(shards, run_dir, "train.steps=6", *RUN[1:], *overrides)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return watched


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_no_step_waits_for_the_device_outside_log_steps(shards, tmp_path, monkeypatch, precision):
    watched = _cuda_run(shards, tmp_path / "run", monkeypatch, f"train.mixed_precision={precision}")
    assert watched == [2, 3, 4, 5]
    assert [r["step"] for r in read_metrics(tmp_path / "run") if "loss" in r] == [6]

"""What the cluster features cost per optimizer step: the stop agreement (one all-reduce of two numbers on the host,
gloo) and the sample audit (one JSON line of the step's keys), against a training step of the tiny model, in the
same run.

    python benchmarks/step_overhead_bench.py [--steps 200]                       # one process
    accelerate launch --multi_gpu --num_processes 2 benchmarks/step_overhead_bench.py   # two (gloo on CPU)

It trains configs/pretrain/tiny.yaml's model (MPP, batch 8 in all) on random images held in memory (no loader, so
only the step is timed), and times, interleaved step by step: the step alone, `StopGate.agree()` and the audit's
`add` + `write` of that step's keys. Prints the mean of each and each cost as a share of a step (target: under 1%
each).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pretrain.config import PretrainConfig  # noqa: E402
from pretrain.mpp import MaskedPatchPrediction  # noqa: E402
from vit_mpp.config.engine import load_config  # noqa: E402
from vit_mpp.models.vit import create_vit, norm_stats  # noqa: E402
from vit_mpp.processes.stop_agreement import StopGate  # noqa: E402
from vit_mpp.processes.stop_signals import StopSignals  # noqa: E402
from vit_mpp.run.metering.sample_audit import SampleAudit  # noqa: E402
from vit_mpp.run.optimizer import build_optimizer  # noqa: E402
from vit_mpp.run.start.accelerator import make_accelerator, prepare_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    run_dir = Path(tempfile.mkdtemp(prefix="overhead-"))
    cfg = load_config(PretrainConfig, "configs/pretrain/tiny.yaml", [f"train.run_dir={run_dir}"])
    accelerator, gbatch = make_accelerator(cfg.train)
    encoder = create_vit(cfg.model)
    model = MaskedPatchPrediction(encoder, cfg.mpp, *norm_stats(encoder)).to(accelerator.device)
    # tiny.yaml: no compile, no fp8
    model, optimizer = prepare_model(accelerator, model, lambda m: build_optimizer(m, cfg.optim, 1e-3), cfg.train)
    images = torch.randint(0, 256, (gbatch.micro_batch, 3, 16, 16), dtype=torch.uint8, device=accelerator.device)
    batch = {"key": [f"train_{i:09d}" for i in range(gbatch.micro_batch)], "set": [0] * gbatch.micro_batch,
             "epoch": [0] * gbatch.micro_batch, "bad_keys": []}
    audit = SampleAudit(run_dir, accelerator.process_index, accelerator.is_main_process, ["train"], True)
    gen = torch.Generator(device=accelerator.device).manual_seed(0)

    def step() -> None:
        out = model(images, generator=gen)
        accelerator.backward(out["loss"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    with StopSignals(["SIGUSR2"]) as signals:
        gate = StopGate(accelerator, signals, every_minutes=60.0)
        times: dict[str, list[float]] = {"step": [], "check": [], "audit": []}
        for i in range(args.steps + 20):
            t0 = time.perf_counter()
            step()
            t1 = time.perf_counter()
            gate.agree()
            t2 = time.perf_counter()
            audit.write(i + 1, [batch])
            t3 = time.perf_counter()
            if i >= 20:  # after warm-up
                for name, took in (("step", t1 - t0), ("check", t2 - t1), ("audit", t3 - t2)):
                    times[name].append(took)
    audit.flush()
    if accelerator.is_main_process:
        mean = {k: statistics.fmean(v) for k, v in times.items()}
        world = accelerator.num_processes
        print(f"{world} process(es), tiny model, global batch {cfg.train.batch_size}, {args.steps} steps "
              f"(OMP threads {os.environ.get('OMP_NUM_THREADS', 'unset')}); the agreement at every step")
        print(f"step {mean['step'] * 1e3:.2f} ms | check {mean['check'] * 1e6:.1f} us "
              f"({mean['check'] / mean['step']:.2%} of a step) | audit {mean['audit'] * 1e6:.1f} us "
              f"({mean['audit'] / mean['step']:.2%} of a step)")
    accelerator.end_training()
    shutil.rmtree(run_dir, ignore_errors=True)  # the audit written to measure it: nothing to keep


if __name__ == "__main__":
    main()

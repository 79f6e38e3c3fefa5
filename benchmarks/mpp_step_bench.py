"""Time one MPP training step against one plain supervised step of the same timm ViT and batch; with
--against-baseline, time a lever (attention backend, compile mode, optimizer kernel, micro-batch, FP8 matmuls, the
MPP target) against the bf16 eager MPP step in the same run.

    python benchmarks/mpp_step_bench.py [--model vit_tiny_patch16_224] [--img-size 224] [--batch 32]
                                        [--steps 10] [--rounds 3] [--device cpu|cuda] [--bf16] [--compile]
                                        [--compile-mode default|max-autotune] [--sdpa default|flash|cudnn|efficient]
                                        [--optim-impl auto|fused|foreach] [--fp8 tensorwise|rowwise] [--mpp-only]
                                        [--target mean_color|pixels_4x4|l2|hog] [--against-baseline] [--json FILE]
    python benchmarks/mpp_step_bench.py ... --levers sdpa=flash sdpa=cudnn optim=foreach batch=128 compile=default \
                                                     compile=default+fp8=tensorwise target=hog

Both steps do forward, backward and an AdamW step on the same uint8 images; the supervised one is the same ViT with a
classifier head on the [class] token (1000 classes, timm's own), the MPP one (pretrain/mpp.py, with a torch.Generator as
a run passes one) corrupts 50% of the patch embeddings and predicts the 512-way mean colour of each (--target: another
of mpp.target's). The steps are timed interleaved (--rounds rounds of --steps steps after 3 warm-up steps, which also
compile), and the median is reported: time per step, images/s, the ratio MPP / supervised (the target is <= 1.05: the
objective should cost next to nothing on top of the encoder) and, on a GPU the FLOPs table of vit_mpp/models/flops.py
knows (or with --peak-tflops), the model FLOPs utilisation (MFU) as a run reports it.

The levers: --sdpa runs forward and backward inside `torch.nn.attention.sdpa_kernel` with one backend (flash,
cudnn, efficient, math; default: torch's choice); --compile-mode is torch.compile's mode (implies --compile);
--optim-impl is optim.impl (auto: fused on CUDA, foreach on CPU, as a run builds it); --batch is the micro-batch;
--fp8 swaps the linear layers for torchao's FP8 ones with that scaling, as train.fp8=true does (vit_mpp/models/fp8.py;
compiled, as a run should use it); --target is mpp.target (what the objective adds on top of the encoder). A lever
may move several knobs at once: `compile=default+fp8=tensorwise`.
With --against-baseline the MPP step of this setting and the baseline (bf16 autocast, eager, torch's attention
choice, optim.impl auto, --baseline-batch images) are timed in turn, and the ratio of their images/s is printed.
--levers times several levers in one process, each against the same baseline model (made once; each lever's model
is freed before the next is made). A backend the device does not have, or a setting that runs out of memory, is
reported as unavailable (exit status 0), so that a suite goes on. --json writes every figure to FILE.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pretrain.config import MPPConfig  # noqa: E402
from pretrain.mpp import MaskedPatchPrediction  # noqa: E402
from pretrain.targets import TARGETS  # noqa: E402
from vit_mpp.config.sections import ModelConfig, OptimConfig  # noqa: E402
from vit_mpp.models.flops import peak_flops, training_flops  # noqa: E402
from vit_mpp.models.fp8 import RECIPES, to_fp8  # noqa: E402
from vit_mpp.models.vit import create_vit, norm_stats  # noqa: E402
from vit_mpp.run.optimizer import build_optimizer  # noqa: E402

SDPA = ("default", "flash", "cudnn", "efficient", "math")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
OPTIM_IMPLS = ("auto", "fused", "foreach", "single")
UNAVAILABLE = ("No available kernel", "No viable backend")  # what torch says when the backend asked cannot run


@dataclass(frozen=True)
class Setting:
    """What one timed step is made with."""

    batch: int
    bf16: bool
    compile_mode: str | None  # None: eager
    sdpa: str
    optim_impl: str
    fp8: str | None = None  # None: bf16 matmuls; else torchao's float8 recipe
    target: str = "mean_color"  # mpp.target

    def describe(self) -> str:
        compiled = "eager" if self.compile_mode is None else f"compiled ({self.compile_mode})"
        return (f"batch {self.batch}, {'bf16' if self.bf16 else 'fp32'}, {compiled}, attention {self.sdpa}, "
                f"optim.impl {self.optim_impl}" + (f", fp8 {self.fp8}" if self.fp8 else "")
                + (f", target {self.target}" if self.target != "mean_color" else ""))


def attention(backend: str) -> contextlib.AbstractContextManager:
    """The scaled-dot-product attention backend to run under (`default`: torch's own choice)."""
    if backend == "default":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel({"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                        "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[backend])


def model_config(args: argparse.Namespace) -> ModelConfig:
    sizes = {k: getattr(args, k) for k in ("patch_size", "embed_dim", "depth", "num_heads")}
    return ModelConfig(name=args.model, img_size=args.img_size, **sizes)


def find_encoder(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "encoder", model)


@dataclass
class Made:
    """One training step ready to time, the setting it was made with and its model (for its FLOPs)."""

    step: Callable[[], None]
    setting: Setting
    model: torch.nn.Module


def make_step(args: argparse.Namespace, setting: Setting, objective: str) -> Made:
    """One training step of `objective` ("mpp" or "supervised") under `setting`, on its own model, optimizer and
    images."""
    dev = args.device
    images = torch.randint(0, 256, (setting.batch, 3, args.img_size, args.img_size), dtype=torch.uint8, device=dev)
    if objective == "mpp":
        encoder = create_vit(model_config(args))
        model = MaskedPatchPrediction(encoder, MPPConfig(target=setting.target), *norm_stats(encoder)).to(dev)
    else:
        model = create_vit(model_config(args), num_classes=1000).to(dev)
    mean, std = (torch.tensor(s, device=dev).view(1, 3, 1, 1) for s in norm_stats(find_encoder(model)))
    labels = torch.randint(0, 1000, (setting.batch,), device=dev)
    if setting.fp8:
        to_fp8(model, setting.fp8)
    optimizer = build_optimizer(model, OptimConfig(impl=setting.optim_impl), 1e-4)
    forward = model if setting.compile_mode is None else torch.compile(model, mode=setting.compile_mode)
    generator = torch.Generator(device=dev).manual_seed(0)  # a run draws its corruption from its own generator
    amp = torch.autocast(torch.device(dev).type, dtype=torch.bfloat16, enabled=setting.bf16)

    def step() -> None:
        with attention(setting.sdpa):
            with amp:
                if objective == "mpp":
                    loss = forward(images, generator=generator)["loss"]
                else:  # the same normalisation the MPP module does inside
                    loss = F.cross_entropy(forward((images.float() / 255 - mean) / std).float(), labels)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return Made(step, setting, model)


def timed_steps(step: Callable[[], None], steps: int, device: str, warmup: int = 3) -> list[float]:
    for _ in range(warmup):  # warm-up (and compilation)
        step()
    times = []
    for _ in range(steps):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return times


def measure(args: argparse.Namespace, steps: dict[str, Made]) -> dict[str, dict[str, float]]:
    """Median ms/step, img/s and MFU of each named step, timed interleaved so that drifts in the machine's speed hit
    all alike."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(args.rounds):
        for name, made in steps.items():
            times[name] += timed_steps(made.step, args.steps, args.device, warmup=3 if r == 0 else 1)
    results = {}
    for name, made in steps.items():
        peak = peak_flops(torch.device(args.device), "bf16" if made.setting.bf16 else "no", args.peak_tflops)
        seconds = statistics.median(times[name])
        flops = training_flops(made.model)
        mfu = flops * made.setting.batch / seconds / peak if flops and peak else None
        results[name] = {"ms": seconds * 1e3, "img_s": made.setting.batch / seconds, "mfu": mfu}
    return results


def lever_setting(baseline: Setting, lever: str) -> Setting:
    """The baseline with one lever moved, or several joined by '+': `sdpa=BACKEND`, `compile=MODE`, `optim=IMPL`,
    `batch=N`, `fp8=RECIPE`, `target=TARGET`."""
    setting = baseline
    for knob in lever.split("+"):
        key, _, value = knob.partition("=")
        if key == "sdpa" and value in SDPA:
            setting = replace(setting, sdpa=value)
        elif key == "compile" and value in COMPILE_MODES:
            setting = replace(setting, compile_mode=value)
        elif key == "optim" and value in OPTIM_IMPLS:
            setting = replace(setting, optim_impl=value)
        elif key == "batch" and value.isdigit() and int(value) > 0:
            setting = replace(setting, batch=int(value))
        elif key == "fp8" and value in RECIPES:
            setting = replace(setting, fp8=value)
        elif key == "target" and value in TARGETS:
            setting = replace(setting, target=value)
        else:
            print(f"error: --levers takes sdpa=BACKEND, compile=MODE, optim=IMPL, batch=N, fp8=RECIPE or "
                  f"target=TARGET (several joined by '+'), got {lever!r}", file=sys.stderr)
            raise SystemExit(2)
    return setting


def unavailable(error: RuntimeError, setting: Setting) -> str | None:
    """What made `setting` impossible on this device (an attention backend it lacks, too little memory), or None
    for any other error, which stops the benchmark."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if setting.sdpa != "default" and any(m in str(error) for m in UNAVAILABLE):
        return f"attention backend {setting.sdpa} is unavailable: {text}"
    if isinstance(error, torch.OutOfMemoryError):
        return f"out of memory: {text}"
    return None


def levers(args: argparse.Namespace, baseline: Setting) -> dict:
    """Each of --levers against the baseline, in turn, the baseline's model kept for all (each lever's is freed
    before the next is made). A lever that fails is recorded with its reason and the next one runs."""
    base = make_step(args, baseline, "mpp")
    record: dict = {"baseline": asdict(baseline), "levers": {}}
    for lever in args.levers:
        setting = lever_setting(baseline, lever)
        try:
            results = measure(args, {"lever": make_step(args, setting, "mpp"), "baseline": base})
        except Exception as e:  # one lever that breaks (a compiler error, a missing kernel) must not end the others
            reason = unavailable(e, setting) if isinstance(e, RuntimeError) else None
            if reason is None:
                traceback.print_exc()
                reason = f"failed: {type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
            print(f"{lever:22s} {reason}", flush=True)
            record["levers"][lever] = {"setting": asdict(setting), "unavailable": reason}
        else:
            ratio = results["lever"]["img_s"] / results["baseline"]["img_s"]
            print(f"{lever:22s} {results['lever']['img_s']:8.1f} img/s  baseline {results['baseline']['img_s']:8.1f} "
                  f"img/s  ratio {ratio:.3f}", flush=True)
            record["levers"][lever] = {"setting": asdict(setting), **results, "ratio_to_baseline": ratio}
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return record


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="vit_tiny_patch16_224", help="a timm ViT name")
    p.add_argument("--patch-size", type=int, help="custom sizes (default: the named model's)")
    p.add_argument("--embed-dim", type=int)
    p.add_argument("--depth", type=int)
    p.add_argument("--num-heads", type=int)
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--batch", type=int, default=32, help="micro-batch of the timed step")
    p.add_argument("--baseline-batch", type=int, help="the baseline's micro-batch (default: --batch)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--bf16", action="store_true", help="autocast to bfloat16")
    p.add_argument("--compile", action="store_true", help="torch.compile the models (mode: --compile-mode)")
    p.add_argument("--compile-mode", choices=COMPILE_MODES, help="torch.compile's mode")
    p.add_argument("--sdpa", choices=SDPA, default="default", help="attention backend (torch.nn.attention)")
    p.add_argument("--optim-impl", choices=OPTIM_IMPLS, default="auto",
                   help="AdamW kernel, as optim.impl (auto: fused on CUDA)")
    p.add_argument("--fp8", choices=RECIPES, help="FP8 matmuls (torchao) with this scaling, as train.fp8=true does")
    p.add_argument("--mpp-only", action="store_true", help="leave the supervised step out")
    p.add_argument("--target", choices=TARGETS, default="mean_color", help="the MPP step's mpp.target")
    p.add_argument("--against-baseline", action="store_true",
                   help="also time the bf16 eager MPP step of --baseline-batch and print the ratio")
    p.add_argument("--levers", nargs="+", metavar="LEVER",
                   help="time each of these against the baseline (bf16 eager MPP of --batch), in one process: "
                        "sdpa=BACKEND, compile=MODE, optim=IMPL, batch=N, fp8=RECIPE, target=TARGET; several "
                        "joined by '+'")
    p.add_argument("--peak-tflops", type=float, default=0.0,
                   help="dense peak of the device for MFU (0: vit_mpp/models/flops.py's table of GPUs)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--json", type=Path, help="write every figure to this file")
    return p.parse_args(argv)


def report(args: argparse.Namespace, setting: Setting, results: dict[str, dict[str, float]]) -> dict:
    """Print the figures and return them as one record."""
    dev = args.device
    where = torch.cuda.get_device_name() if dev == "cuda" else f"{torch.get_num_threads()} threads"
    print(f"model {args.model} @ {args.img_size}, device {dev} ({where}), {setting.describe()}")
    for name, label in (("supervised", "supervised step:"), ("mpp", "MPP step:"), ("baseline", "baseline MPP step:")):
        if name in results:
            r = results[name]
            mfu = f"  MFU {r['mfu']:.1%}" if r["mfu"] is not None else ""
            print(f"{label:20s} {r['ms']:8.1f} ms  {r['img_s']:8.1f} img/s{mfu}")
    record = {"model": args.model, "img_size": args.img_size, "device": dev, "device_name": where,
              "setting": asdict(setting), **results}
    if "supervised" in results:
        record["ratio_mpp_supervised"] = results["mpp"]["ms"] / results["supervised"]["ms"]
        print(f"ratio MPP / supervised: {record['ratio_mpp_supervised']:.3f}")
    if "baseline" in results:
        record["ratio_to_baseline"] = results["mpp"]["img_s"] / results["baseline"]["img_s"]
        print(f"ratio img/s this setting / baseline (bf16 eager, batch {args.baseline_batch or setting.batch}): "
              f"{record['ratio_to_baseline']:.3f}")
    return record


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    compile_mode = args.compile_mode or ("default" if args.compile else None)
    setting = Setting(args.batch, args.bf16, compile_mode, args.sdpa, args.optim_impl, args.fp8, args.target)
    baseline = Setting(args.baseline_batch or args.batch, True, None, "default", "auto")
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"{torch.get_num_threads()} threads"
    if args.levers:
        print(f"model {args.model} @ {args.img_size}, device {args.device} ({where}), each lever against the "
              f"baseline: {baseline.describe()}")
        record = {"model": args.model, "img_size": args.img_size, "device": args.device, "device_name": where,
                  **levers(args, baseline)}
    else:
        record = single(args, setting, baseline)
    if args.json:
        args.json.write_text(json.dumps(record, indent=1) + "\n")


def single(args: argparse.Namespace, setting: Setting, baseline: Setting) -> dict:
    """The MPP step (and the supervised one, and the baseline when asked) under `setting`: printed, and returned as
    one record."""
    runs = {"mpp": (setting, "mpp")}
    if not args.mpp_only:
        runs = {"supervised": (setting, "supervised"), **runs}
    if args.against_baseline:
        runs["baseline"] = (baseline, "mpp")
    try:
        results = measure(args, {name: make_step(args, s, objective) for name, (s, objective) in runs.items()})
    except (RuntimeError, torch.OutOfMemoryError) as e:
        reason = unavailable(e, setting)
        if reason is None:
            raise
        print(reason)
        return {"model": args.model, "device": args.device, "setting": asdict(setting), "unavailable": reason}
    return report(args, setting, results)


if __name__ == "__main__":
    main()

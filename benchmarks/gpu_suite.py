"""The GPU suite's driver (run it through benchmarks/gpu_suite.sh, which installs what the GPU image lacks first):
every row of docs/benchmarks.md#the-gpu-suite in one command, under a time budget, into one table.

    bash benchmarks/gpu_suite.sh [--out DIR] [--budget-s 450] [--only KEY ...] [--pack] [--append]
    bash benchmarks/gpu_suite.sh --smoke [--out DIR]      # every row on the CPU, tiny sizes (a few minutes)
    bash benchmarks/gpu_suite.sh --append-from DIR        # append DIR/table.md (a device's run) to the docs

Generates its own JPEGs (500x375, like ImageNet's; nothing is downloaded), builds shards of them with 16 workers
(their bytes kept), then runs each row as its own command: benchmarks/mpp_step_bench.py (the MPP step against the
supervised step, eager and compiled; the levers against the bf16 eager baseline), benchmarks/loader_bench.py (the
loader alone), `accelerate launch -m pretrain` (eager and train.compile=true) and `accelerate launch -m finetune` at
288, for ViT-B/16 and ViT-S/16. Rows run in order of importance; one that would start with less than its expected
time left in --budget-s is skipped and says so, and none runs past the budget. OUT gets table.md (markdown: the
machine, the date, the command and the table), suite.json (every figure) and raw/ (each row's command and output;
--pack makes it raw.tar.gz, for a machine that returns few files). --append appends table.md to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from vit_mpp.durable import replace, write_atomic  # noqa: E402

DOCS = REPO / "docs" / "benchmarks.md"
LAUNCH = ["-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1", "--dynamo_backend",
          "no"]


@dataclass(frozen=True)
class Scale:
    """The sizes of one suite: the real one on a GPU, or the smoke one on a CPU."""

    device: str
    images: int
    width: int
    height: int
    workers: int  # build-shards workers, loader workers (bench and runs)
    shard_size: int
    models: dict[str, list[str]]  # label -> mpp_step_bench model flags; runs get the same as config overrides
    img_size: int
    finetune_size: int
    batch: int  # micro-batch of the step benchmarks and of the runs (one optimizer step each)
    lever_batches: tuple[int, int]
    bench_steps: int
    bench_rounds: int
    run_steps: int  # pretraining steps; logged every run_steps // 4
    threads: int  # torch CPU threads of the step benchmarks (0: torch's default)
    budget_s: float


REAL = Scale(device="cuda", images=24000, width=500, height=375, workers=16, shard_size=250,
             models={"ViT-B/16": ["--model", "vit_base_patch16_224"], "ViT-S/16": ["--model", "vit_small_patch16_224"]},
             img_size=224, finetune_size=288, batch=256, lever_batches=(128, 512), bench_steps=10, bench_rounds=2,
             run_steps=80, threads=0, budget_s=450.0)
TINY = ["--model", "vit_tiny_patch16_224", "--patch-size", "4", "--embed-dim", "32", "--depth", "2", "--num-heads", "2"]
# Both models are the same tiny ViT, so that the second one's compilations come from Inductor's cache.
SMOKE = Scale(device="cpu", images=40, width=160, height=120, workers=2, shard_size=10,
              models={"ViT-B/16": TINY, "ViT-S/16": TINY}, img_size=32, finetune_size=48, batch=8,
              lever_batches=(4, 16), bench_steps=2, bench_rounds=1, run_steps=4, threads=1, budget_s=900.0)


@dataclass
class Row:
    """One command of the suite and what its output gives the table. `needs`: rows whose output it reads."""

    key: str
    model: str
    what: str
    expect_s: float  # its expected time on the real scale: it is skipped when less than this is left
    command: Callable[[Suite], list[str]]
    parse: Callable[[Suite, Row], list[dict]]
    needs: tuple[str, ...] = ()
    prepare: Callable[[Suite], None] | None = None  # before the command, inside its time
    vs_step: str | None = None  # a run end to end: the step row whose MPP img/s it is compared with
    cuda_only: bool = False  # FP8: not run by a smoke run on the CPU
    status: str = "not run"
    seconds: float = 0.0
    lines: list[dict] = field(default_factory=list)


@dataclass
class Suite:
    """Where a suite runs and what it has found so far."""

    scale: Scale
    out: Path
    work: Path
    python: str
    smoke: bool
    rows: dict[str, Row] = field(default_factory=dict)

    @property
    def shards(self) -> Path:
        return self.work / "shards"

    packed: bool = False  # --pack: raw/ lives in `work` and goes out as raw.tar.gz

    def raw(self, name: str) -> Path:
        return (self.work if self.packed else self.out) / "raw" / name

    def run_dir(self, key: str) -> Path:
        return self.work / "runs" / key


# --- commands ------------------------------------------------------------------------------------------------------


def bench(suite: Suite, label: str, key: str, *flags: str) -> list[str]:
    s = suite.scale
    return [suite.python, "benchmarks/mpp_step_bench.py", *s.models[label], "--img-size", str(s.img_size),
            "--batch", str(s.batch), "--steps", str(s.bench_steps), "--rounds", str(s.bench_rounds), "--device",
            s.device, "--bf16", "--threads", str(s.threads), "--json", str(suite.raw(f"{key}.json")), *flags]


def model_overrides(suite: Suite, label: str, size: int) -> list[str]:
    """The model of `label` as config overrides (the bench's flags, as keys)."""
    flags = suite.scale.models[label]
    pairs = dict(zip(flags[::2], flags[1::2]))
    keys = {"--model": "model.name", "--patch-size": "model.patch_size", "--embed-dim": "model.embed_dim",
            "--depth": "model.depth", "--num-heads": "model.num_heads"}
    return [f"{keys[k]}={v}" for k, v in pairs.items()] + [f"model.img_size={size}"]


def run_overrides(suite: Suite, key: str) -> list[str]:
    s = suite.scale
    return [f"data.shards={suite.shards}", f"train.run_dir={suite.run_dir(key)}", f"train.batch_size={s.batch}",
            f"train.micro_batch_size={s.batch}", f"train.log_every={max(1, s.run_steps // 4)}",
            "train.ckpt_every=1000000", f"data.num_workers={s.workers}", "optim.warmup_steps=10",
            "train.mixed_precision=bf16", "train.resume=never"]


def pretrain(suite: Suite, label: str, key: str, compiled: bool, *extra: str) -> list[str]:
    return [suite.python, *LAUNCH, "--mixed_precision", "bf16", "-m", "pretrain", "--config",
            "configs/pretrain/vit_b16_in1k.yaml", *model_overrides(suite, label, suite.scale.img_size),
            *run_overrides(suite, key), f"train.steps={suite.scale.run_steps}", "train.eval_every=0",
            "data.val_split=", f"train.compile={str(compiled).lower()}", *extra]


def finetune(suite: Suite, label: str, key: str, export: str) -> list[str]:
    return [suite.python, *LAUNCH, "--mixed_precision", "bf16", "-m", "finetune", "--config",
            "configs/finetune/vit_b16_384_in1k.yaml", *model_overrides(suite, label, suite.scale.finetune_size),
            f"init.checkpoint={suite.run_dir(export) / 'export'}", *run_overrides(suite, key), "train.epochs=1"]


# --- what the outputs give ------------------------------------------------------------------------------------------


def line(what: str, img_s: float | None = None, ms: float | None = None, mfu: float | None = None,
         ratio: str = "", notes: str = "") -> dict:
    return {"what": what, "img_s": img_s, "ms": ms, "mfu": mfu, "ratio": ratio, "notes": notes}


def read_json(suite: Suite, row: Row) -> dict:
    return json.loads(suite.raw(f"{row.key}.json").read_text())


def parse_steps(suite: Suite, row: Row) -> list[dict]:
    """The supervised and the MPP step of one bench run (compiled: and the compile lever, against the baseline)."""
    r = read_json(suite, row)
    how = "eager" if r["setting"]["compile_mode"] is None else "compiled"
    lines = [line(f"supervised step (timm), bf16 {how}", r["supervised"]["img_s"], r["supervised"]["ms"],
                  r["supervised"]["mfu"]),
             line(f"MPP step, bf16 {how}", r["mpp"]["img_s"], r["mpp"]["ms"], r["mpp"]["mfu"],
                  f"{r['ratio_mpp_supervised']:.3f} MPP / supervised (time)", "target <= 1.05")]
    if "baseline" in r:
        lines.append(line("lever: torch.compile (default mode)", r["mpp"]["img_s"], r["mpp"]["ms"], r["mpp"]["mfu"],
                          f"{r['ratio_to_baseline']:.3f} vs bf16 eager",
                          f"baseline {r['baseline']['img_s']:.0f} img/s in the same run"))
    return lines


LEVER_NAMES = {"sdpa": "attention backend", "optim": "AdamW kernel", "batch": "micro-batch", "compile": "torch.compile",
               "fp8": "FP8 matmuls (torchao)", "target": "MPP target"}


def parse_levers(suite: Suite, row: Row) -> list[dict]:
    r = read_json(suite, row)
    lines = []
    for lever, result in r["levers"].items():
        knobs = [knob.partition("=") for knob in lever.split("+")]
        what = "lever: " + " + ".join(f"{LEVER_NAMES[k]} {v}" for k, _, v in knobs)
        key = knobs[0][0]
        if key == "optim":
            what += " (the baseline's is fused on CUDA)"
        if "unavailable" in result:
            lines.append(line(what, notes=result["unavailable"]))
        else:
            lev, base = result["lever"], result["baseline"]
            lines.append(line(what, lev["img_s"], lev["ms"], lev["mfu"], f"{result['ratio_to_baseline']:.3f} vs bf16 "
                              "eager", f"baseline {base['img_s']:.0f} img/s in the same run"))
    return lines


def parse_shards(suite: Suite, row: Row) -> list[dict]:
    log = suite.raw(f"{row.key}.log").read_text()
    rate = re.findall(r"throughput: ([\d,]+) img/s with (\d+) worker", log)
    generated = json.loads(suite.raw("images.json").read_text())
    img_s = float(rate[-1][0].replace(",", "")) if rate else None
    return [line(f"build-shards, {suite.scale.workers} workers, bytes kept", img_s, notes=(
        f"{generated['images']} JPEGs {suite.scale.width}x{suite.scale.height}, mean {generated['mean_kib']:.0f} "
        f"KiB (generated in {generated['seconds']:.0f} s)"))]


def parse_loader(suite: Suite, row: Row) -> list[dict]:
    r = read_json(suite, row)
    return [line(f"loader alone (ours), {r['workers']} workers, crop {r['size']}", r["best"]["ours"],
                 notes=f"best of 1 epoch after a warm-up epoch, batch {r['batch']}, {r['cpu_cores']} CPU cores")]


def parse_run(suite: Suite, row: Row) -> list[dict]:
    """img/s, MFU, data wait and peak memory of a run from its metrics.jsonl, over its logs after the first (which
    holds the loader's start and compilation)."""
    path = suite.run_dir(row.key) / "metrics.jsonl"
    records = [r for r in map(json.loads, path.read_text().splitlines()) if "img_per_s" in r]
    steady = records[1:] or records

    def mean(key: str) -> float | None:
        values = [r[key] for r in steady if isinstance(r.get(key), (int, float))]
        return sum(values) / len(values) if values else None

    img_s = mean("img_per_s")
    notes = [f"steps {records[0]['step'] + 1}-{records[-1]['step']}" if len(records) > 1
             else "one log, warm-up included"]
    for key, text in (("data_wait", "data wait {:.0%}"), ("peak_mem_gib", "peak mem {:.1f} GiB")):
        if mean(key) is not None:
            notes.append(text.format(mean(key)))
    ms = suite.scale.batch / img_s * 1e3 if img_s else None
    return [line(row.what, img_s, ms, mean("mfu"), notes=", ".join(notes))]


# --- the rows ------------------------------------------------------------------------------------------------------


def gpu_tests(suite: Suite) -> list[str]:
    """pytest on each test file that holds tests marked `gpu` (skipped without CUDA), one file at a time, verbose and
    under its own time limit: a file that hangs or runs long must not hide the others' reports (the first GPU run's
    row was cut before pytest printed why its tests failed)."""
    files = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py")
                   if "mark.gpu" in p.read_text())
    pytest = f"{shlex.quote(suite.python)} -m pytest -v --tb=short -rfE -p no:cacheprovider -m gpu"
    return ["bash", "-c", "; ".join(f"timeout 90 {pytest} {shlex.quote(f)}" for f in files) + "; true"]


def parse_tests(suite: Suite, row: Row) -> list[dict]:
    """Each file's pytest summary line, joined."""
    log = suite.raw(f"{row.key}.log").read_text()
    summaries = re.findall(r"^=+ (.*(?:passed|failed|skipped|deselected|error).*) =+$", log, re.MULTILINE)
    return [line(row.what, notes="; ".join(summaries) or "no summary (see raw/gpu_tests.log)")]


def rows(scale: Scale) -> list[Row]:
    """Every row, in the order they run: what matters most first (ViT-B/16's step eager and compiled, the GPU tests,
    FP8; ViT-S/16 end to end against its step; the compiled runs end to end), the other levers and runs after, the
    other compilations and max-autotune last. (data.decode=gpu has no row while the runs refuse it on a GPU.)
    `expect_s`: the time a row took on an H100 (docs/benchmarks.md), or a guess where it has not run there, used
    only to skip a row that would not finish in the budget."""
    b, s = "ViT-B/16", "ViT-S/16"
    low, high = scale.lever_batches
    size, ft = scale.img_size, scale.finetune_size
    levers = ["sdpa=flash", "sdpa=cudnn", "sdpa=efficient", "optim=foreach", f"batch={low}", f"batch={high}",
              "target=hog"]

    def step(label: str, tag: str, compiled: bool, expect_s: float) -> Row:
        key = f"step_{'compiled' if compiled else 'eager'}_{tag}"
        flags = ["--compile", "--against-baseline"] if compiled else []
        return Row(key, label, f"step, {'compiled' if compiled else 'bf16 eager'}", expect_s,
                   lambda x: bench(x, label, key, *flags), parse_steps)

    def pretrain_row(label: str, tag: str, compiled: bool, expect_s: float, *extra: str, key: str = "",
                     what: str = "") -> Row:
        key = key or f"pretrain_{'compiled' if compiled else 'eager'}_{tag}"
        how = what or ("train.compile=true" if compiled else "bf16 eager")
        return Row(key, label, f"pretrain end to end @ {size}, {how}", expect_s,
                   lambda x: pretrain(x, label, key, compiled, *extra), parse_run, ("shards",),
                   vs_step=f"step_{'compiled' if compiled else 'eager'}_{tag}", cuda_only=bool(extra))

    def finetune_row(label: str, tag: str) -> Row:
        return Row(f"finetune_{tag}", label, f"finetune end to end @ {ft}, bf16 eager", 45,
                   lambda x: finetune(x, label, f"finetune_{tag}", f"pretrain_eager_{tag}"), parse_run,
                   ("shards", f"pretrain_eager_{tag}"))

    fp8 = ["compile=default+fp8=tensorwise", "compile=default+fp8=rowwise"]
    return [
        step(b, "b16", False, 25),
        step(b, "b16", True, 90),
        Row("gpu_tests", "-", "GPU tests (pytest -m gpu)", 120, gpu_tests, parse_tests),
        Row("fp8_b16", b, "levers", 180, lambda x: bench(x, b, "fp8_b16", "--levers", *fp8), parse_levers,
            cuda_only=True),
        Row("shards", "-", "build-shards", 45, lambda x: [
            x.python, "-m", "data_tools.cli", str(x.work / "images"), str(x.shards), "--workers",
            str(x.scale.workers), "--shard-size", str(x.scale.shard_size), "--val-fraction", "0.05"], parse_shards,
            prepare=make_images),
        step(s, "s16", False, 15),
        pretrain_row(s, "s16", False, 30),
        pretrain_row(b, "b16", True, 70),
        pretrain_row(b, "b16", True, 80, "train.fp8=true", key="pretrain_compiled_fp8_b16",
                     what="train.compile=true train.fp8=true"),
        Row("loader", "-", "loader alone", 30, lambda x: [
            x.python, "benchmarks/loader_bench.py", "--shards", str(x.shards), "--workers", str(x.scale.workers),
            "--batch", str(x.scale.batch), "--size", str(x.scale.img_size), "--json", str(x.raw("loader.json"))],
            parse_loader, ("shards",)),
        pretrain_row(b, "b16", False, 35),
        Row("levers_b16", b, "levers", 60, lambda x: bench(x, b, "levers_b16", "--levers", *levers), parse_levers),
        finetune_row(b, "b16"),
        finetune_row(s, "s16"),
        step(s, "s16", True, 90),
        pretrain_row(s, "s16", True, 60),
        Row("autotune_b16", b, "levers", 200, lambda x: bench(x, b, "autotune_b16", "--levers",
                                                               "compile=max-autotune"), parse_levers),
    ]


# --- running them -------------------------------------------------------------------------------------------------


def _draw(job: tuple[Path, int, int, int, int, int]) -> int:
    """One worker's share of the images: JPEGs `start`..`stop` (seeded by their index) into 4 class folders."""
    from benchmarks.loader_bench import photo_like  # imported by make_images before the workers fork

    root, start, stop, width, height, seed = job
    size = 0
    for i in range(start, stop):
        data = photo_like(np.random.default_rng([seed, i]), width, height, 90)
        (root / f"class{i % 4}" / f"img{i:06d}.jpg").write_bytes(data)
        size += len(data)
    return size


def make_images(suite: Suite) -> None:
    """The suite's JPEGs, drawn in one process per core; what was made goes to raw/images.json."""
    from benchmarks.loader_bench import photo_like  # noqa: F401  (once, here: the forked workers inherit it)

    s, root, started = suite.scale, suite.work / "images", time.perf_counter()
    for c in range(4):
        (root / f"class{c}").mkdir(parents=True, exist_ok=True)
    procs = os.cpu_count() or 1
    cuts = [s.images * k // (procs * 4) for k in range(procs * 4 + 1)]
    jobs = [(root, a, b, s.width, s.height, 0) for a, b in zip(cuts, cuts[1:]) if b > a]
    with multiprocessing.get_context("fork").Pool(procs) as pool:
        total = sum(pool.map(_draw, jobs))
    suite.raw("images.json").write_text(json.dumps({"images": s.images, "mean_kib": total / s.images / 1024,
                                                    "seconds": time.perf_counter() - started}) + "\n")


def run_row(suite: Suite, row: Row, deadline: float) -> None:
    """Run `row`'s command (its output to raw/KEY.log) and read its figures, within the time left."""
    left = deadline - time.monotonic()
    failed = [k for k in row.needs if suite.rows[k].status != "ok"]
    if failed:
        row.status = f"not run: needs {', '.join(failed)}"
        return
    if row.cuda_only and suite.smoke:
        row.status = "not run: needs a CUDA device"
        return
    if left < (row.expect_s if not suite.smoke else 1):
        row.status = f"skipped: {left:.0f} s of the budget left, it takes about {row.expect_s:.0f} s"
        return
    started = time.monotonic()
    log = suite.raw(f"{row.key}.log")
    try:
        if row.prepare is not None:
            row.prepare(suite)
        command = row.command(suite)
        log.write_text("$ " + " ".join(command) + "\n")
        code = run_command(command, log, deadline - time.monotonic())
        row.status = "ok" if code == 0 else (f"timed out after {time.monotonic() - started:.0f} s" if code is None
                                             else f"failed: exit status {code}")
        if code == 0:
            row.lines = row.parse(suite, row)
    except Exception as e:  # a row that breaks must not take the table with it; raw/ has the details
        row.status = f"failed: {type(e).__name__}: {e}"
    row.seconds = time.monotonic() - started
    print(f"[{row.key}] {row.status} in {row.seconds:.0f} s", flush=True)


def run_command(command: list[str], log: Path, timeout: float) -> int | None:
    """Run `command` in its own process group (a launcher, its ranks and their loader workers), appending its output
    to `log`; its exit status, or None when it ran out of time (the whole group is then killed)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1"}
    with log.open("a") as out:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            return proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None


# --- the table -----------------------------------------------------------------------------------------------------

SMOKE_MARK = "smoke run on the CPU"
INFO = ("import json, os, torch, timm; cuda = torch.cuda.is_available(); print(json.dumps({'cuda': cuda, "
        "'device': torch.cuda.get_device_name() if cuda else 'CPU', 'torch': torch.__version__, 'timm': "
        "timm.__version__, 'cuda_version': torch.version.cuda, 'cores': os.cpu_count()}))")


def fail(message: str) -> None:
    """A mistake in how the suite was asked for: one line, exit status 2."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def machine(python: str) -> dict:
    """The device and the software the rows run with, asked of the Python that runs them."""
    done = subprocess.run([python, "-c", INFO], capture_output=True, text=True, cwd=REPO, timeout=300)
    if done.returncode:
        fail(f"{python} cannot import torch and timm: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def commit() -> str:
    """The checkout's commit, and whether it has uncommitted changes ('unknown' outside a git checkout)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=REPO).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git checkout)"
    return head + (" with uncommitted changes" if dirty else "")


def number(value: float | None, fmt: str) -> str:
    return "" if value is None else format(value, fmt)


def table(suite: Suite, info: dict, command: str, used_s: float) -> str:
    """The markdown the suite writes (and --append adds to docs/benchmarks.md): machine, date, command, table."""
    title = f"{info['device']} ({SMOKE_MARK}: tiny sizes, the figures mean nothing)" if suite.smoke else info["device"]
    text = [f"### GPU suite: {title}, {datetime.date.today().isoformat()}", "",
            f"`{command}` at commit {commit()}; torch {info['torch']} (CUDA {info['cuda_version']}), timm "
            f"{info['timm']}, Python {platform.python_version()}, {info['cores']} CPU cores; budget "
            f"{suite.scale.budget_s:.0f} s, {used_s:.0f} s used.", "",
            "| model | row | img/s | ms/step | MFU | ratio | notes |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in suite.rows.values():
        lines = row.lines or [line(row.what, notes=row.status)]
        step = suite.rows.get(row.vs_step or "")
        mpp = [ln for ln in (step.lines if step else []) if ln["what"].startswith("MPP step")]
        if row.lines and mpp and mpp[0]["img_s"] and lines[0]["img_s"]:
            lines[0]["ratio"] = f"{lines[0]['img_s'] / mpp[0]['img_s']:.2f} of the MPP step ({step.key})"
        for ln in lines:
            text.append(f"| {row.model} | {ln['what']} | {number(ln['img_s'], ',.0f')} | {number(ln['ms'], '.1f')} | "
                        f"{number(ln['mfu'], '.1%')} | {ln['ratio']} | {ln['notes']} |")
    return "\n".join(text) + "\n"


def write_results(suite: Suite, info: dict, command: str, used_s: float) -> None:
    """table.md, suite.json and (packed) raw.tar.gz as they stand, each replaced whole."""
    out = suite.out
    write_atomic(out / "table.md", table(suite, info, command, used_s))
    write_atomic(out / "suite.json", json.dumps({"machine": info, "command": command, "rows": {
        k: {"model": r.model, "status": r.status, "seconds": round(r.seconds, 1), "lines": r.lines}
        for k, r in suite.rows.items()}}, indent=1) + "\n")
    if suite.packed:
        part = out / "raw.tar.gz.part"
        with tarfile.open(part, "w:gz") as tar:
            tar.add(suite.raw(""), arcname="raw")
        replace(part, out / "raw.tar.gz")


def append(table_md: Path) -> None:
    """Append a suite's table to docs/benchmarks.md: never a smoke run's."""
    text = table_md.read_text()
    if SMOKE_MARK in text:
        fail(f"{table_md} is a smoke run's table (tiny sizes on a CPU): not for the docs")
    with DOCS.open("a") as docs:
        docs.write("\n" + text)
    print(f"appended {table_md} to {DOCS.relative_to(REPO)}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks/gpu_suite.sh", description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="every row on the CPU with tiny sizes")
    p.add_argument("--out", type=Path, help="where table.md, suite.json and raw/ go (default: runs/gpu_suite/DATE)")
    p.add_argument("--work", type=Path, help="where the images, shards and runs go (default: a temporary folder, "
                                             "removed at the end)")
    p.add_argument("--budget-s", type=float, help="the suite's time, in seconds (default: 450; smoke: 900)")
    p.add_argument("--only", nargs="+", metavar="KEY", help="run only these rows (and the rows they need)")
    p.add_argument("--pack", action="store_true", help="raw/ as one raw.tar.gz")
    p.add_argument("--append", action="store_true", help="append the table to docs/benchmarks.md")
    p.add_argument("--append-from", type=Path, metavar="DIR", help="only append DIR/table.md to docs/benchmarks.md")
    p.add_argument("--python", default=sys.executable, help="the Python that runs the rows")
    args = p.parse_args(argv)
    if args.append and args.smoke:
        fail("--append takes a GPU run's table, not a smoke run's")
    return args


def chosen(all_rows: list[Row], only: list[str] | None) -> list[Row]:
    """The rows to run, in order: all, or those of --only and what they need."""
    if not only:
        return all_rows
    by_key = {r.key: r for r in all_rows}
    unknown = sorted(set(only) - set(by_key))
    if unknown:
        fail(f"--only names no row {unknown}; the rows: {', '.join(by_key)}")
    wanted, todo = set(), list(only)
    while todo:
        key = todo.pop()
        if key not in wanted:
            wanted.add(key)
            todo += list(by_key[key].needs)
    return [r for r in all_rows if r.key in wanted]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.append_from:
        return append(args.append_from / "table.md")
    scale = SMOKE if args.smoke else REAL
    if args.budget_s:
        scale = Scale(**{**scale.__dict__, "budget_s": args.budget_s})
    todo = chosen(rows(scale), args.only)
    info = machine(args.python)
    if not args.smoke and not info["cuda"]:
        fail("the suite needs a CUDA device (torch sees none); --smoke runs every row on the CPU")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.out or REPO / "runs" / "gpu_suite" / stamp
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-suite-", dir=args.work))
    suite = Suite(scale, out, work, args.python, args.smoke, packed=args.pack)
    suite.raw("").mkdir(parents=True, exist_ok=True)
    suite.rows = {r.key: r for r in todo}
    given = list(argv if argv is not None else sys.argv[1:])
    if "--python" in given:  # gpu_suite.sh passes its own
        del given[given.index("--python"):given.index("--python") + 2]
    command = " ".join(["bash benchmarks/gpu_suite.sh", *given])
    started = time.monotonic()
    try:
        for row in suite.rows.values():
            run_row(suite, row, started + scale.budget_s)
            # After every row: a suite stopped from outside (a machine's time limit) keeps what it measured.
            write_results(suite, info, command, time.monotonic() - started)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print((out / "table.md").read_text())
    print(f"written: {out}")
    if args.append:
        append(out / "table.md")


if __name__ == "__main__":
    main()

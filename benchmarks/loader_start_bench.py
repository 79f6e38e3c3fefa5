"""Loader workers started three ways: fork (what the product does), forkserver and spawn, for the training loader and
an evaluation's loader, on the demo's data and on a 10,000-image set; and what each way does to a worker's life.

    python benchmarks/loader_start_bench.py [--rounds 5] [--cases demo_pretrain demo_finetune demo_finetune_ra big]
        [--methods fork forkserver spawn] [--big-images 10000] [--demo-wall pretrain=S finetune=S] [--json FILE]
    python benchmarks/loader_start_bench.py --lifecycle [--methods ...]

Each trial is one process standing in for a rank: it imports what a rank has imported (torch, the stream; timm's
augmentations for RandAugment), then starts the loaders a run starts, through vit_mpp/data/stream.py
(`train_split_loader`; eval_stream.py's `eval_split_loader`: `make_loader` over a `TrainStream` or an `EvalStream`
with the run's `ImageDecoder`, the product's `Loader`), their workers started with the given method:

* the training loader (persistent workers, as a run keeps them): the time from nothing to its first batch (with
  forkserver this includes starting the fork server, which imports torch and the stream first:
  `set_forkserver_preload`), then its steady-state images/s after a warm-up;
* with those workers alive, `--evals` evaluations (each of the demo's stages starts evaluation workers three times:
  pretraining's validation and its k-NN monitor's two loaders, fine-tuning's three validations), each starting an
  evaluation loader's workers again: the time to each one's first batch, and the images/s of the rest of the pass
  (the whole split for the demo; `--eval-batches` batches for the 10,000-image set);
* the memory of the rank and every process under it (workers; the fork server and multiprocessing's resource
  tracker where there are), at the first evaluation's first batch: the sum of their PSS (shared pages counted once,
  shared out), from /proc.

The methods run in turn in each round (the order rotated from round to round) and each is compared with fork's trial
of the same round: the tables give medians over the rounds of the figures and of those per-round ratios. A trial's
"start-ups" are its training loader's start plus its evaluations' starts, what one stage of the demo spends starting
loader workers, in wall and CPU seconds (of the rank and every process under it); with `--demo-wall` (the stages'
wall time, summary.json's `total_s`) also as a share of the stage's wall time. The fork server is started as the
product would have to start it (`start_method`), and the workers run the product's `init_worker`, naming the fork
server as their parent where it is one (what `die_with_parent` checks).

Cases: `demo_pretrain` (the demo's shards, configs/pretrain/demo.yaml's loader: 32 px, crop scale 0.5-1, 1 worker,
batch 64), `demo_finetune` (configs/finetune/demo.yaml's: 48 px, crop scale 0.8-1), `demo_finetune_ra` (the same with
RandAugment `rand-m9-mstd0.5-inc1` in the workers, as `augment.auto_augment` sets it), `big` (10,000 JPEGs of 500x375
made as benchmarks/loader_bench.py makes them, shards of 500, crop 224, 2 workers, batch 64; its evaluations read the
same split, `--eval-batches` batches each). The demo's shards are made as scripts/demo.sh makes them.

`--lifecycle`: for each method, a rank with the demo's training loader ended three ways (`lifecycle_rank`): at once
as a rank's `exit_now` does (its clean-ups, then os._exit), by kill -9, and by its worker killed with -9 while it
waits for batches; then which of its processes are alive 10 s after it ended, how long it took to hear of the killed
worker, and what its output holds besides its one line.
"""

from __future__ import annotations

# Nothing heavy at the top: a forkserver or spawn worker imports this module again (as __mp_main__) before it
# unpickles its loader, which a rank's `python -m` does not make its workers do.
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
METHODS = ("fork", "forkserver", "spawn")
PRELOAD = ["torch", "vit_mpp.data.stream"]  # what the fork server imports once, before it forks any worker
CASES = {
    "demo_pretrain": {"data": "demo", "size": 32, "crop_scale": [0.5, 1.0], "workers": 1, "augment": ""},
    "demo_finetune": {"data": "demo", "size": 48, "crop_scale": [0.8, 1.0], "workers": 1, "augment": ""},
    "demo_finetune_ra": {"data": "demo", "size": 48, "crop_scale": [0.8, 1.0], "workers": 1,
                         "augment": "rand-m9-mstd0.5-inc1"},
    "big": {"data": "big", "size": 224, "crop_scale": [0.35, 1.0], "workers": 2, "augment": ""},
}


def make_demo(root: Path) -> Path:
    """The demo's shards, as scripts/demo.sh makes them (4 texture classes x 500 at 48 px, shards of 250, 10% val)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-m", "data_tools.demo_images", str(root / "images"), "--per-class", "500",
                    "--size", "48"], check=True, env=env, stdout=subprocess.DEVNULL)
    subprocess.run([sys.executable, "-c", "import sys; from data_tools.cli import main; sys.exit(main())",
                    str(root / "images"), str(root / "shards"), "--shard-size", "250", "--val-fraction", "0.1"],
                   check=True, env=env, stdout=subprocess.DEVNULL)
    return root / "shards"


def make_big(root: Path, count: int) -> Path:
    sys.path.insert(0, str(REPO))
    from benchmarks.loader_bench import make_images

    make_images(root, count, 500, 375, 90, 500, seed=0, folder=False)
    return root / "shards"


# --- one trial: a process standing in for a rank ---------------------------------------------------------------------

def start_method(method: str, preload: list[str]) -> tuple[object, int]:
    """The context `method` names and the pid its workers' parent has (the fork server's; else this process). The
    fork server is started as the product would start it: multiprocessing's resource tracker first (it changes the
    signal mask as it starts), then the server with the stop signals blocked, which it and every worker it forks
    inherit (vit_mpp/processes/loader_workers.py WORKER_SIGNALS)."""
    import multiprocessing
    import signal
    from multiprocessing import forkserver, resource_tracker

    from vit_mpp.processes.loader_workers import WORKER_SIGNALS

    if method == "fork":
        return None, os.getpid()
    context = multiprocessing.get_context(method)
    if method != "forkserver":
        return context, os.getpid()
    context.set_forkserver_preload(preload)
    resource_tracker.ensure_running()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, WORKER_SIGNALS)
    try:
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    return context, forkserver._forkserver._forkserver_pid


def started_with(loader, context, parent: int):
    """`loader` (the product's, from make_loader) with its workers started by `context` (None: fork, unchanged)."""
    import functools

    from vit_mpp.processes.loader_workers import init_worker

    if context is not None:
        loader.multiprocessing_context = context
        loader.worker_init_fn = functools.partial(init_worker, parent=parent)
    return loader


def tree_memory() -> dict[str, float]:
    """This process and every process under it: their count, the sum of their RSS and of their PSS (MiB)."""
    import psutil

    procs = [psutil.Process(), *psutil.Process().children(recursive=True)]
    rss = pss = 0
    for proc in procs:
        try:
            fields = dict(line.split(":", 1) for line in Path(f"/proc/{proc.pid}/smaps_rollup").read_text()
                          .splitlines()[1:])
        except OSError:
            continue
        rss += int(fields["Rss"].split()[0])
        pss += int(fields["Pss"].split()[0])
    return {"processes": len(procs), "rss_mib": rss / 1024, "pss_mib": pss / 1024}


def tree_cpu_s() -> float:
    """The CPU time (user + system) this process and every process under it have used so far."""
    import psutil

    total = 0.0
    for proc in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.Error:  # ended meanwhile
            continue
        total += times.user + times.system
    return total


def trial(spec: dict) -> dict:
    import torch

    from vit_mpp.config.sections import DataConfig
    from vit_mpp.data.eval_stream import eval_split_loader
    from vit_mpp.data.image_decoder import ImageDecoder
    from vit_mpp.data.manifest import load_split
    from vit_mpp.data.stream import Batches, loader_layout, train_split_loader
    from vit_mpp.processes.loader_workers import end_workers

    augment, preload = None, list(PRELOAD)
    if spec["augment"]:
        from finetune.augment import RandAugmentU8

        augment = RandAugmentU8(spec["augment"], spec["size"], (0.5, 0.5, 0.5))
        preload.append(type(augment).__module__)
    data = DataConfig(num_workers=spec["workers"], crop_scale=spec["crop_scale"], persistent_workers=True)
    layout = loader_layout(data, spec["batch"])
    train, _ = load_split(spec["shards"], "train")
    val, _ = load_split(spec["shards"], spec["val_split"])
    out: dict = {"torch_threads": torch.get_num_threads()}

    start, cpu = time.perf_counter(), tree_cpu_s()
    context, parent = start_method(spec["method"], preload)
    out["boot_s"] = time.perf_counter() - start
    stream, loader = train_split_loader(train, data, ImageDecoder.for_training(data, spec["size"], augment), layout)
    batches = Batches(stream, started_with(loader, context, parent))
    next(batches)
    out["train_first_s"], out["train_first_cpu_s"] = time.perf_counter() - start, tree_cpu_s() - cpu
    for _ in range(spec["warm"]):
        next(batches)
    start = time.perf_counter()
    images = sum(len(next(batches)["image"]) for _ in range(spec["timed"]))
    out["train_img_s"] = images / (time.perf_counter() - start)

    out["eval_first_s"], out["eval_first_cpu_s"], out["eval_img_s"] = [], [], []
    for i in range(spec["evals"]):
        loader = eval_split_loader(val, data, ImageDecoder.for_evaluation(data, spec["size"]), layout)
        start, cpu = time.perf_counter(), tree_cpu_s()
        passing = iter(started_with(loader, context, parent))
        next(passing)
        first = time.perf_counter()
        out["eval_first_s"].append(first - start)
        out["eval_first_cpu_s"].append(tree_cpu_s() - cpu)
        if i == 0:
            out["memory"] = tree_memory()
        images = 0
        for n, batch in enumerate(passing, 1):
            images += int(batch["valid"].sum())
            if spec["eval_batches"] and n >= spec["eval_batches"]:
                break
        out["eval_img_s"].append(images / (time.perf_counter() - first))
        end_workers(passing)
    batches.close()
    out["run_starts_s"] = out["train_first_s"] + sum(out["eval_first_s"])
    out["run_starts_cpu_s"] = out["train_first_cpu_s"] + sum(out["eval_first_cpu_s"])
    return out


# --- what each method does to a worker's life: a rank standing in for a run's, ended three ways ----------------------

ENDINGS = ("exit_now", "kill -9", "worker killed -9")


def lifecycle_rank(spec: dict) -> None:
    """A rank with the demo's training loader (its workers started by spec's method), ended as `spec["how"]` says:
    `exit_now` (what a rank does when it must end at once: its clean-ups, then os._exit), `kill -9` (the OOM killer,
    a scheduler's last word), or `worker killed -9` (its worker killed from outside while it waits for batches: the
    time until it hears of it, its one line as a run prints it). Prints the pids of its workers, fork server and
    resource tracker first."""
    import signal
    from multiprocessing import resource_tracker

    from vit_mpp.config.sections import DataConfig
    from vit_mpp.data.image_decoder import ImageDecoder
    from vit_mpp.data.manifest import load_split
    from vit_mpp.data.stream import Batches, loader_layout, train_split_loader
    from vit_mpp.processes import rank_lifecycle
    from vit_mpp.processes.exits import one_line_errors

    # reads of 1 s and no retries: the loader's wait for a batch is its shortest, 60 s (loader_timeout_s)
    data = DataConfig(num_workers=1, read_timeout_s=1.0, read_retries=0)
    context, parent = start_method(spec["method"], PRELOAD)
    stream, loader = train_split_loader(load_split(spec["shards"], "train")[0], data,
                                        ImageDecoder.for_training(data, 32), loader_layout(data, 64))
    batches = Batches(stream, started_with(loader, context, parent))
    next(batches)
    workers = [w.pid for w in batches._batches._workers]
    print(json.dumps({"workers": workers, "server": parent if spec["method"] == "forkserver" else None,
                      "tracker": resource_tracker._resource_tracker._pid}), flush=True)
    if spec["how"] == "exit_now":
        rank_lifecycle.exit_now(75)
    if spec["how"] == "kill -9":
        os.kill(os.getpid(), signal.SIGKILL)
    killed = time.monotonic()
    os.kill(workers[0], signal.SIGKILL)
    with one_line_errors():
        try:
            while True:
                next(batches)
        finally:
            print(json.dumps({"heard_s": time.monotonic() - killed}), flush=True)


def lifecycle(shards: Path, methods: list[str]) -> list[str]:
    """For each method and ending: the rank's status, which of its processes are alive 10 s after it ended, how long
    it took to hear of a killed worker, and the lines its output got besides the pids and its one line."""
    rows = ["\n| method | how the rank ends | its status | alive 10 s after it ended (of its workers, fork server, "
            "resource tracker) | heard of the killed worker after | lines besides its one line |",
            "| --- " * 6 + "|"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    for method in methods:
        for how in ENDINGS:
            with tempfile.TemporaryFile("w+") as out:  # a file, not a pipe: what outlives the rank would hold a pipe
                proc = subprocess.run([sys.executable, __file__, "--lifecycle-rank",
                                       json.dumps({"method": method, "how": how, "shards": str(shards)})],
                                      env=env, stdout=out, stderr=subprocess.STDOUT, timeout=600)
                time.sleep(10)
                out.seek(0)
                lines = out.read().splitlines()
            records = [json.loads(line) for line in lines if line.startswith("{")]
            pids = {"worker": records[0]["workers"], "fork server": [records[0]["server"]],
                    "resource tracker": [records[0]["tracker"]]}
            alive = [f"{name} {pid}" for name, group in pids.items() for pid in group if pid and _alive(pid)]
            for name_pid in alive:  # this benchmark's own leftovers
                os.kill(int(name_pid.rsplit(" ", 1)[1]), 9)
            heard = f"{records[1]['heard_s']:.1f} s" if len(records) > 1 else "-"
            other = [line for line in lines if not line.startswith(("{", "error: "))]
            rows.append(f"| {method} | {how} | {proc.returncode} | {', '.join(alive) or 'none'} | {heard} | "
                        f"{len(other)}{': ' + other[0][:90] if other else ''} |")
            print(rows[-1], flush=True)
    return rows


def _alive(pid: int) -> bool:
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


# --- the driver: rounds of trials, medians and ratios ----------------------------------------------------------------

def run_trial(spec: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    proc = subprocess.run([sys.executable, __file__, "--trial", json.dumps(spec)], env=env, capture_output=True,
                          text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"trial {spec['case']}/{spec['method']} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    if proc.stderr.strip():
        print(f"  ({spec['case']}/{spec['method']} stderr: {' | '.join(proc.stderr.strip().splitlines()[-3:])})")
    return json.loads(lines[-1])


def figures(result: dict) -> dict[str, float]:
    """One trial's figures, as the table shows them."""
    evals = result["eval_first_s"]
    return {"train first batch s": result["train_first_s"], "first eval first batch s": evals[0],
            "later evals first batch s": statistics.median(evals[1:]) if len(evals) > 1 else evals[0],
            "run's start-ups s": result["run_starts_s"], "run's start-ups CPU s": result["run_starts_cpu_s"],
            "train img/s": result["train_img_s"],
            "eval img/s": statistics.median(result["eval_img_s"]), "tree PSS MiB": result["memory"]["pss_mib"],
            "processes": result["memory"]["processes"]}


def table(results: dict, methods: list[str]) -> list[str]:
    """Markdown rows: per case and method, the median of each figure and of its per-round ratio to fork."""
    rows = []
    for case, by_method in results.items():
        keys = list(figures(by_method[methods[0]][0]))
        rows.append(f"\n{case}\n\n| method | " + " | ".join(keys) + " |")
        rows.append("| --- " * (len(keys) + 1) + "|")
        for method in methods:
            per_round = [figures(r) for r in by_method[method]]
            cells = []
            for key in keys:
                value = statistics.median(f[key] for f in per_round)
                cell = f"{value:.0f}" if key == "processes" else f"{value:.3g}" if value < 100 else f"{value:.0f}"
                if method != "fork" and "fork" in by_method and key != "processes":
                    fork = [figures(r)[key] for r in by_method["fork"]]
                    cell += f" ({statistics.median(f[key] / b for f, b in zip(per_round, fork)):.2f}x)"
                cells.append(cell)
            rows.append(f"| {method} | " + " | ".join(cells) + " |")
    return rows


def run_shares(results: dict, methods: list[str], walls: dict[str, float]) -> list[str]:
    """What each method adds to a demo stage's start-ups (the median of the per-round differences to fork), in wall
    and CPU seconds, and the wall seconds as a share of the stage's wall time (`--demo-wall`)."""
    rows = ["\n| stage (case) | method | start-ups s | added to fork's: wall s | added: CPU s | "
            "share of the stage's wall time |", "| --- " * 6 + "|"]
    for stage, case in (("pretrain", "demo_pretrain"), ("finetune", "demo_finetune")):
        if case not in results or "fork" not in results[case]:
            continue
        fork = results[case]["fork"]
        for method in methods:
            mine = results[case][method]
            wall = statistics.median(m["run_starts_s"] - f["run_starts_s"] for m, f in zip(mine, fork))
            cpu = statistics.median(m["run_starts_cpu_s"] - f["run_starts_cpu_s"] for m, f in zip(mine, fork))
            share = f"{100 * wall / walls[stage]:.2f}% of {walls[stage]:.0f} s" if stage in walls else "n/a"
            rows.append(f"| {stage} ({case}) | {method} | {statistics.median(r['run_starts_s'] for r in mine):.2f} | "
                        f"{wall:+.2f} | {cpu:+.2f} | {share} |")
    return rows


def stage_seconds(pairs: list[str]) -> dict[str, float]:
    """STAGE=SECONDS pairs (pretrain=..., finetune=...)."""
    return {stage: float(seconds) for stage, seconds in (pair.split("=", 1) for pair in pairs)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--big-images", type=int, default=10000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--evals", type=int, default=3, help="evaluations per trial (each starts its workers)")
    parser.add_argument("--eval-batches", type=int, default=8, help="batches of each evaluation of `big` after its "
                                                                  "first (the demo's: the whole split)")
    parser.add_argument("--warm", type=int, default=10, help="training batches before the timed ones")
    parser.add_argument("--timed", type=int, default=40, help="training batches timed")
    parser.add_argument("--dir", help="where to make the data (default: a temporary directory)")
    parser.add_argument("--demo-wall", nargs="*", default=[], metavar="STAGE=SECONDS",
                        help="wall time of the demo's stages (pretrain=S finetune=S: summary.json's total_s)")
    parser.add_argument("--json", type=Path, help="write every trial's figures to this file")
    parser.add_argument("--lifecycle", action="store_true",
                        help="instead of the timings: what each method does to a worker's life (demo data)")
    parser.add_argument("--trial", help=argparse.SUPPRESS)
    parser.add_argument("--lifecycle-rank", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.trial:
        print(json.dumps(trial(json.loads(args.trial))), flush=True)
        return
    if args.lifecycle_rank:
        lifecycle_rank(json.loads(args.lifecycle_rank))
        return
    walls = stage_seconds(args.demo_wall)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        shards = {}
        if args.lifecycle or any(CASES[c]["data"] == "demo" for c in args.cases):
            shards["demo"] = make_demo(Path(tmp) / "demo")
        if not args.lifecycle and any(CASES[c]["data"] == "big" for c in args.cases):
            shards["big"] = make_big(Path(tmp) / "big", args.big_images)
        print(f"{os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f}, Python {sys.version.split()[0]}"
              + ("" if args.lifecycle else f", {args.rounds} rounds"), flush=True)
        if args.lifecycle:
            lifecycle(shards["demo"], args.methods)
            return
        results: dict = {case: {m: [] for m in args.methods} for case in args.cases}
        for rnd in range(args.rounds):
            order = args.methods[rnd % len(args.methods):] + args.methods[:rnd % len(args.methods)]
            for case in args.cases:
                for method in order:
                    c = CASES[case]
                    spec = {**c, "case": case, "method": method, "shards": str(shards[c["data"]]),
                            "val_split": "val" if c["data"] == "demo" else "train", "batch": args.batch,
                            "evals": args.evals, "eval_batches": 0 if c["data"] == "demo" else args.eval_batches,
                            "warm": args.warm, "timed": args.timed}
                    result = run_trial(spec)
                    results[case][method].append(result)
                    f = figures(result)
                    print(f"round {rnd + 1} {case:16s} {method:10s} train first {f['train first batch s']:.2f} s, "
                          f"evals first {', '.join(f'{s:.2f}' for s in result['eval_first_s'])} s, train "
                          f"{f['train img/s']:.0f} img/s, eval {f['eval img/s']:.0f} img/s, tree PSS "
                          f"{f['tree PSS MiB']:.0f} MiB ({f['processes']} processes), load "
                          f"{os.getloadavg()[0]:.1f}", flush=True)
    print("\n".join(table(results, args.methods)))
    print("\n".join(run_shares(results, args.methods, walls)))
    if args.json:
        args.json.write_text(json.dumps({"walls": walls, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""Fine-tuning a ViT encoder into a classifier (the paper's rule: zero head, resized position embeddings).

    accelerate launch finetune --config configs/finetune/demo.yaml [key=value ...]
    accelerate launch -m finetune --config ...        (same, from any directory once installed)
    python -m finetune --config ...                   (one process)

Reads top to bottom: config -> accelerator -> data -> model -> optimizer -> resume -> step loop -> export.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate.utils import set_seed

from common.checkpoint import export_encoder, latest_checkpoint, load_checkpoint, save_checkpoint
from common.config import ConfigError, parse_args, to_dict
from common.data_stream import build_loader, normalize, to_device
from common.manifest import load_split
from common.models import count_params
from common.run_dir import MetricsLog, Throughput, prepare_run_dir, progress_line
from common.runtime import build_optimizer, make_accelerator, mean_across_processes, optimizer_step, set_lr
from common.schedule import lr_at, scaled_lr, warmup_steps
from finetune.config import FinetuneConfig
from finetune.init_model import build_classifier


@torch.no_grad()
def evaluate(accelerator, model, loader, mean, std, num_classes: int) -> dict[str, float]:
    """Top-1 (and top-5 when there are more than 5 classes) and loss; every sample counted once across processes."""
    model.eval()
    k = min(5, num_classes)
    totals = torch.zeros(4, device=accelerator.device)  # loss sum, top-1 hits, top-k hits, samples
    for batch in loader:
        batch = to_device(batch, accelerator.device)
        with accelerator.autocast():
            logits = model(normalize(batch["image"], mean, std)).float()
        valid = batch["valid"].float()
        loss = F.cross_entropy(logits, batch["label"], reduction="none")
        topk = logits.topk(k, dim=1).indices  # (B, k)
        hits = topk == batch["label"].unsqueeze(1)
        totals += torch.stack([(loss * valid).sum(), (hits[:, 0].float() * valid).sum(),
                               (hits.any(1).float() * valid).sum(), valid.sum()])
    totals = accelerator.reduce(totals, reduction="sum")
    model.train()
    n = totals[3].clamp(min=1)
    result = {"val_loss": (totals[0] / n).item(), "val_top1": (totals[1] / n).item(), "val_samples": int(totals[3])}
    if num_classes > 5:
        result["val_top5"] = (totals[2] / n).item()
    return result


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(FinetuneConfig, argv, prog="finetune", description=__doc__.split("\n\n")[0])
    tc = cfg.train
    accelerator, plan = make_accelerator(tc)
    set_seed(tc.seed, device_specific=True)
    with accelerator.main_process_first():
        changed = prepare_run_dir(tc.run_dir, cfg, accelerator.is_main_process)
    log = MetricsLog(tc.run_dir, accelerator.is_main_process)

    # Data: the manifest gives sizes (so every process runs the same number of steps) and class names.
    train_split, info = load_split(cfg.data.shards, cfg.data.train_split)
    val_split = load_split(cfg.data.shards, cfg.data.val_split)[0] if cfg.data.val_split else None
    num_classes = cfg.num_classes or info.get("num_classes") or len(info.get("class_names", []))
    if not num_classes:
        raise ConfigError("num_classes is not set and the manifest names no classes")

    # Model: encoder (pretrained or not) with position embeddings resized to model.img_size and a zero head.
    model, mean, std, model_cfg = build_classifier(cfg.init, cfg.model, num_classes)
    model.to(accelerator.device)
    peak_lr = scaled_lr(cfg.optim, tc.batch_size)
    optimizer = build_optimizer(model, cfg.optim, peak_lr)
    model, optimizer = accelerator.prepare(model, optimizer)
    if tc.compile:
        model = torch.compile(model)

    start_step = 0
    ckpt = latest_checkpoint(tc.run_dir)
    if ckpt is not None:
        start_step = load_checkpoint(accelerator, ckpt)["step"]
        accelerator.print(f"resuming from {ckpt} (step {start_step})")
        if changed:
            accelerator.print(f"note: config differs from the previous run in: {', '.join(changed)}")

    # The loader splits itself across processes and workers, so it is NOT passed to accelerator.prepare
    # (which would re-split it, or make rank 0 decode for everyone); batches are moved to the device by hand.
    rank, world = accelerator.process_index, accelerator.num_processes
    stream, loader = build_loader(train_split, cfg.data, cfg.model.img_size, plan.micro_batch, rank=rank,
                                  world_size=world, train=True, seed=tc.seed, start_batch=start_step * plan.accum_steps)
    val_loader = None
    if val_split is not None:
        val_loader = build_loader(val_split, cfg.data, cfg.model.img_size, plan.micro_batch, rank=rank,
                                  world_size=world, train=False)[1]
    steps_per_epoch = max(1, stream.batches_per_epoch // plan.accum_steps)
    total_steps = tc.epochs * steps_per_epoch
    warmup = warmup_steps(cfg.optim, total_steps)
    accelerator.print(
        f"model {model_cfg.name} at {cfg.model.img_size} ({count_params(model) / 1e6:.2f}M params), "
        f"{num_classes} classes, init: {cfg.init.checkpoint or 'random (from scratch)'}\n"
        f"data {train_split.num_samples} train images, {steps_per_epoch} steps/epoch x {tc.epochs} epochs "
        f"= {total_steps} steps | {plan.describe()}\n"
        f"optim {cfg.optim.name} lr {peak_lr:.3g} (base {cfg.optim.base_lr:g} @ {cfg.optim.base_batch_size}), warmup "
        f"{warmup}, cosine | mixed precision {tc.mixed_precision} | run dir {tc.run_dir}"
    )
    accelerator.init_trackers("finetune", config={k: str(v) for k, v in to_dict(cfg).items()})

    def forward(m, batch):
        logits = m(normalize(batch["image"], mean, std))
        loss = F.cross_entropy(logits.float(), batch["label"], label_smoothing=tc.label_smoothing)
        acc = (logits.argmax(1) == batch["label"]).float().mean()
        return {"loss": loss, "metrics": {"acc": acc.detach()}}

    batches = iter(loader)
    speed = Throughput(start_step, total_steps)
    sums: dict[str, float] = {}
    result: dict[str, float] = {}
    model.train()
    for step in range(start_step, total_steps):
        lr = lr_at(step, peak_lr, warmup, total_steps, cfg.optim.min_lr_ratio)
        set_lr(optimizer, lr)
        for out in optimizer_step(accelerator, model, optimizer, batches, forward, plan.accum_steps,
                                  cfg.optim.clip_grad_norm):
            for k, v in {"loss": out["loss"].detach(), **out["metrics"]}.items():
                sums[k] = sums.get(k, 0.0) + v / plan.accum_steps
        speed.add(tc.batch_size)
        done = step + 1
        if done % tc.log_every == 0 or done == total_steps:
            n = (done - 1) % tc.log_every + 1
            metrics = mean_across_processes(accelerator, {k: v / n for k, v in sums.items()})
            sums = {}
            rate, eta = speed.report(done)
            accelerator.print(progress_line(done, total_steps, {**metrics, "lr": lr}, rate, eta))
            record = {"step": done, "epoch": done / steps_per_epoch, "lr": lr, "img_per_s": rate, **metrics}
            log.write(record)
            accelerator.log(record, step=done)
        epoch_end = done % steps_per_epoch == 0
        if val_loader is not None and (done == total_steps or
                                       (epoch_end and (done // steps_per_epoch) % tc.eval_every_epochs == 0)):
            result = evaluate(accelerator, model, val_loader, mean, std, num_classes)
            accelerator.print(f"eval epoch {done / steps_per_epoch:.3g} | "
                              + " | ".join(f"{k} {v:.4g}" for k, v in result.items()))
            log.write({"step": done, **result})
            accelerator.log(result, step=done)
        if done % tc.ckpt_every == 0 or done == total_steps:
            save_checkpoint(accelerator, tc.run_dir, done, {"config": to_dict(cfg)}, tc.keep_last)

    if accelerator.is_main_process:
        export_encoder(accelerator.unwrap_model(model), to_dict(model_cfg), Path(tc.run_dir) / "export", extra={
            "mean": list(mean), "std": list(std), "num_classes": num_classes,
            "class_names": info.get("class_names"), "init": cfg.init.checkpoint,
        }, name="model", keep_head=True)
        if result:
            accelerator.print(f"final validation top-1: {result['val_top1']:.4f} on {result['val_samples']} images "
                              f"({num_classes} classes, chance {1 / num_classes:.4f})")
    accelerator.end_training()

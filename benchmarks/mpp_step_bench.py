"""Time one MPP training step against one plain timm supervised step of the same ViT and batch.

    python benchmarks/mpp_step_bench.py [--model vit_tiny_patch16_224] [--img-size 224] [--batch 32]
                                        [--steps 10] [--device cpu|cuda] [--bf16] [--compile]

Both steps do forward, backward and an AdamW step on the same images; the supervised one uses timm's own
classifier head on the [class] token (1000 classes), the MPP one corrupts 50% of the patch embeddings and predicts
the 512-way mean colour of each. Prints the median time of each, images/s, and the ratio MPP / supervised
(the target is <= 1.05: the objective should cost next to nothing on top of the encoder). On CUDA it also prints
model-FLOPs utilisation, counting 6 x parameters x tokens + attention FLOPs per image, against --peak-tflops.
"""

from __future__ import annotations

import argparse
import statistics
import time

import timm
import torch
import torch.nn.functional as F

from pretrain.config import MPPConfig
from pretrain.mpp import MaskedPatchPrediction
from vit_mpp.config.sections import ModelConfig
from vit_mpp.models.vit import create_vit


def timed_steps(step, steps: int, device: str) -> list[float]:
    for _ in range(3):  # warm-up (and compilation)
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="vit_tiny_patch16_224")
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--bf16", action="store_true", help="autocast to bfloat16")
    p.add_argument("--compile", action="store_true", help="torch.compile both models")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the GPU (H100 SXM: 989)")
    args = p.parse_args()
    torch.manual_seed(0)
    dev = args.device
    images = torch.randint(0, 256, (args.batch, 3, args.img_size, args.img_size), dtype=torch.uint8, device=dev)
    labels = torch.randint(0, 1000, (args.batch,), device=dev)
    amp = torch.autocast(dev, dtype=torch.bfloat16, enabled=args.bf16)
    fused = {"fused": True} if dev == "cuda" else {"foreach": True}

    sup = timm.create_model(args.model, pretrained=False, num_classes=1000, img_size=args.img_size).to(dev)
    sup_opt = torch.optim.AdamW(sup.parameters(), lr=1e-4, **fused)
    mpp = MaskedPatchPrediction(create_vit(ModelConfig(name=args.model, img_size=args.img_size)), MPPConfig(),
                                (0.5,) * 3, (0.5,) * 3).to(dev)
    mpp_opt = torch.optim.AdamW(mpp.parameters(), lr=1e-4, **fused)
    sup_fwd = torch.compile(sup) if args.compile else sup
    mpp_fwd = torch.compile(mpp) if args.compile else mpp
    mean = torch.tensor([0.5, 0.5, 0.5], device=dev).view(1, 3, 1, 1)

    def supervised_step() -> None:
        with amp:
            x = (images.float() / 255 - mean) / mean  # the same normalisation the MPP module does inside
            loss = F.cross_entropy(sup_fwd(x).float(), labels)
        loss.backward()
        sup_opt.step()
        sup_opt.zero_grad(set_to_none=True)

    def mpp_step() -> None:
        with amp:
            loss = mpp_fwd(images)["loss"]
        loss.backward()
        mpp_opt.step()
        mpp_opt.zero_grad(set_to_none=True)

    # Interleave the two measurements so drifts in machine load hit both alike.
    t_sup, t_mpp = [], []
    for _ in range(3):
        t_sup += timed_steps(supervised_step, args.steps, dev)
        t_mpp += timed_steps(mpp_step, args.steps, dev)
    s, m = statistics.median(t_sup), statistics.median(t_mpp)
    print(f"model {args.model} @ {args.img_size}, batch {args.batch}, device {dev}"
          f"{' (' + torch.cuda.get_device_name() + ')' if dev == 'cuda' else f' ({torch.get_num_threads()} threads)'}"
          f", bf16 {args.bf16}, compile {args.compile}")
    print(f"supervised step: {s * 1e3:8.1f} ms  {args.batch / s:8.1f} img/s")
    print(f"MPP step:        {m * 1e3:8.1f} ms  {args.batch / m:8.1f} img/s")
    print(f"ratio MPP / supervised: {m / s:.3f}")
    if dev == "cuda":
        enc = mpp.encoder
        tokens = enc.patch_embed.num_patches + 1
        params = sum(p.numel() for p in enc.parameters())
        attn = 12 * len(enc.blocks) * tokens * tokens * enc.embed_dim  # QK^T and AV, fwd + bwd
        flops = 6 * params * tokens + attn
        print(f"MFU (MPP): {flops * args.batch / m / (args.peak_tflops * 1e12):.1%} of {args.peak_tflops:g} TFLOP/s")


if __name__ == "__main__":
    main()

"""Memory per rank of MPP pretraining at 224 px, for the table in docs/cluster.md: parameters, gradients and AdamW
state under data parallel and under FSDP over N ranks (from the model's parameter count: fp32 master weights 4
bytes, fp32 gradients 4, AdamW's two moments 8), the activations one image leaves for the backward pass (measured
here, on CPU under bf16 autocast, as the bytes of every tensor saved for the backward, with and without activation
checkpointing), and from these the largest micro-batch that fits a GPU of `--gpu-gib`.

    python benchmarks/fsdp_memory.py                        # the table (ViT-B/16, ViT-L/16, ViT-H/14)
    accelerate launch --config_file configs/accelerate/fsdp_vit_large.yaml --num_processes 2 \\
        --mixed_precision no benchmarks/fsdp_memory.py --check    # the formula against what each rank holds

`--check` shards ViT-B/16 (with the MPP head) over the launched CPU processes with the run's own `shard`, takes one
AdamW step on 2 images, and compares the bytes of the parameter, gradient and optimizer-state shards rank 0 holds
with the formula (it prints the ratio: 1.00 is exact). The GPU column of the table, the peak a run logs, needs a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pretrain.config import MPPConfig  # noqa: E402
from pretrain.mpp import MaskedPatchPrediction  # noqa: E402
from vit_mpp.config.sections import ModelConfig  # noqa: E402
from vit_mpp.models.vit import create_vit, norm_stats  # noqa: E402

MODELS = {"ViT-B/16": "vit_base_patch16_224", "ViT-L/16": "vit_large_patch16_224", "ViT-H/14": "vit_huge_patch14_224"}
BYTES_PER_PARAM = {"parameters": 4, "gradients": 4, "AdamW state": 8}
GIB = 2 ** 30


def mpp_model(name: str, checkpointing: bool = False, meta: bool = False) -> MaskedPatchPrediction:
    """The pretraining model of configs/pretrain/vit_b16_in1k.yaml (mean-colour target) with encoder `name`."""
    with torch.device("meta") if meta else contextlib.nullcontext():
        encoder = create_vit(ModelConfig(name=name, img_size=224, grad_checkpointing=checkpointing))
        return MaskedPatchPrediction(encoder, MPPConfig(), *norm_stats(encoder))


def state_bytes(params: int, ranks: int) -> dict[str, float]:
    """Bytes per rank of each kind of state, for `params` parameters sharded over `ranks` (1: data parallel)."""
    return {kind: params * size / ranks for kind, size in BYTES_PER_PARAM.items()}


@contextlib.contextmanager
def saved_bytes() -> Iterator[list[int]]:
    """The bytes of the tensors autograd keeps for the backward pass, counted once per storage."""
    seen: dict[int, int] = {}
    total = [0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen and not isinstance(tensor, torch.nn.Parameter):
            seen[storage.data_ptr()] = storage.nbytes()
            total[0] += storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield total


def activations_per_image(name: str, checkpointing: bool, batch: int = 2) -> float:
    """Bytes saved for the backward per image (bf16 autocast, the run's mixed precision on GPUs)."""
    model = mpp_model(name, checkpointing)
    images = torch.randint(0, 256, (batch, 3, 224, 224), dtype=torch.uint8)
    with saved_bytes() as total, torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(images, generator=torch.Generator().manual_seed(0))
    del out
    return total[0] / batch


def fits(gpu_gib: float, state: float, per_image: float) -> int:
    """Images of a micro-batch that fit beside `state` bytes, a tenth of the GPU kept for the allocator, the units
    FSDP gathers and the kernels' workspace."""
    return max(0, int((gpu_gib * 1e9 * 0.9 - state) // per_image))


def table(ranks: list[int], gpu_gib: float) -> None:
    heads = ["model", "params", "DP: params + grads + AdamW"] + [f"FSDP {n}: per rank" for n in ranks] + [
        "activations / image", "with checkpointing", f"largest micro-batch on {gpu_gib:g} GB: DP / FSDP "
        f"{ranks[0]} / FSDP {ranks[0]} + checkpointing"]
    print("| " + " | ".join(heads) + " |")
    print("|" + "---|" * len(heads))
    for label, name in MODELS.items():
        params = sum(p.numel() for p in mpp_model(name, meta=True).parameters())
        dp = sum(state_bytes(params, 1).values())
        shards = [sum(state_bytes(params, n).values()) for n in ranks]
        plain, checkpointed = activations_per_image(name, False), activations_per_image(name, True)
        row = [label, f"{params / 1e6:.0f}M", f"{dp / GIB:.1f} GiB"] + [f"{s / GIB:.2f} GiB" for s in shards] + [
            f"{plain / 2 ** 20:.0f} MiB", f"{checkpointed / 2 ** 20:.1f} MiB",
            f"{fits(gpu_gib, dp, plain)} / {fits(gpu_gib, shards[0], plain)} / "
            f"{fits(gpu_gib, shards[0], checkpointed)}"]
        print("| " + " | ".join(row) + " |", flush=True)


def check() -> None:
    """Shard ViT-B/16 over the launched processes, one AdamW step, and compare rank 0's shards with the formula."""
    from vit_mpp.config.fsdp_settings import FsdpSettings
    from vit_mpp.run.start.accelerator import make_eval_accelerator
    from vit_mpp.run.start.sharding import shard

    settings = FsdpSettings.read()
    assert settings is not None, "launch with the FSDP config: see the module's docstring"
    accelerator = make_eval_accelerator("no")  # the run's own process group, with FSDP left to `shard`
    model = shard(accelerator, mpp_model("vit_base_patch16_224"), settings)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    images = torch.randint(0, 256, (2, 3, 224, 224), dtype=torch.uint8)
    model(images, generator=torch.Generator().manual_seed(0))["loss"].backward()
    optimizer.step()

    def local(t: torch.Tensor) -> int:
        return (t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size()

    params = sum(p.numel() for p in model.parameters())
    held = {"parameters": sum(local(p) for p in model.parameters()),
            "gradients": sum(local(p.grad) for p in model.parameters() if p.grad is not None),
            "AdamW state": sum(local(v) for s in optimizer.state.values() for k, v in s.items() if k != "step")}
    if accelerator.is_main_process:
        expected = state_bytes(params, accelerator.num_processes)
        print(f"ViT-B/16 + MPP head ({params / 1e6:.1f}M parameters) over {accelerator.num_processes} processes: "
              "rank 0 holds")
        for kind, size in held.items():
            print(f"  {kind}: {size / 2 ** 20:.1f} MiB, formula {expected[kind] / 2 ** 20:.1f} MiB "
                  f"(ratio {size / expected[kind]:.2f})")
    accelerator.end_training()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare the formula with the shards each rank holds")
    parser.add_argument("--ranks", default="8,64", help="FSDP world sizes of the table")
    parser.add_argument("--gpu-gib", type=float, default=80.0, help="GPU memory (GB) for the largest micro-batch")
    args = parser.parse_args()
    if args.check:
        check()
    else:
        table([int(n) for n in args.ranks.split(",")], args.gpu_gib)


if __name__ == "__main__":
    main()

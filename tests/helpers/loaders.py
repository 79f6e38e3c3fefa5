"""Loaders over one split for tests: the product's single-split loaders with a decoder made from `data`."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.data import DataLoader

from vit_mpp.config.sections import DataConfig
from vit_mpp.data.eval_stream import eval_split_loader
from vit_mpp.data.image_decoder import ImageDecoder
from vit_mpp.data.manifest import Split
from vit_mpp.data.stream import TrainStream, loader_layout, train_split_loader


def split_loader(split: Split, data: DataConfig, size: int, batch: int, *, rank: int = 0, world_size: int = 1,
                 seed: int = 0, augment: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 ) -> tuple[TrainStream, DataLoader]:
    return train_split_loader(split, data, ImageDecoder.for_training(data, size, augment),
                              loader_layout(data, batch, world_size), rank=rank, seed=seed)


def eval_loader(split: Split, data: DataConfig, size: int, batch: int, *, rank: int = 0,
                world_size: int = 1) -> DataLoader:
    return eval_split_loader(split, data, ImageDecoder.for_evaluation(data, size),
                             loader_layout(data, batch, world_size), rank=rank)

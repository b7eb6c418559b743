"""The learning-rate schedule of a run: linear warmup over `warmup` of the steps, then constant, linear or cosine
decay to `min_lr_ratio` of the peak (the LambdaLR the optimizer steps with, saved in every checkpoint)."""

from __future__ import annotations

import math

import torch

from ..config import TrainConfig


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of cfg.lr at `step` (0-based): linear warmup, then linear/cosine decay to min_lr_ratio."""
    warmup = round(cfg.warmup * cfg.steps)
    if step < warmup:
        return (step + 1) / warmup
    if cfg.schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(1, cfg.steps - warmup)
    shape = 1.0 - progress if cfg.schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg))

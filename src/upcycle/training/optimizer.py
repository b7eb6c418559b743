"""The optimizer of a run: AdamW with fresh state (CLIP-UP re-initializes optimizer state after upcycling), matrices
decayed and the 1-D rest not (nanoGPT's rule)."""

from __future__ import annotations

import torch
from torch import nn

from ..config import TrainConfig


def make_optimizer(model: nn.Module, cfg: TrainConfig, *, fused: bool = False,
                   foreach: bool | None = None) -> torch.optim.AdamW:
    """The run's AdamW over the trainable parameters; `fused`: one kernel for every parameter's update, on a GPU
    (on the CPU the default implementation runs, whose numbers the CPU runs and earlier checkpoints have);
    `foreach`: torch's choice of implementation made explicit (the memory plan takes a GPU's default on a CPU)."""
    return torch.optim.AdamW(_param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=tuple(cfg.betas),
                             **({"fused": True} if fused else {}), **({"foreach": foreach} if foreach else {}))


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Matrices decay; biases, norms and the 1-D rest do not."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]

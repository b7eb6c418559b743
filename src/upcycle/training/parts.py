"""The parts of a training run, made by one function (`assemble`) for the run itself (`parallel.accelerator.prepare`,
on the loaded model) and for its memory plan (`memory.plan`, on the same model built of fake tensors), so that the
rehearsal and the run cannot drift apart: the same trainable set (the `train` set and the freeze rules that last the
whole run), the same activation checkpointing, the same AdamW over the same parameters, the same objective.

In the run's order:
    freezer      which parameters train (`freezing.Freezer`: `train`, and the `freeze` rules by step)
    (traced)     the memory plan's forward trace, while no block is checkpointed yet (`before_checkpointing`)
    checkpointing  `activation_checkpointing` applied (`parallel.recompute`)
    (sharded)    FSDP2 on CPU processes shards the model here (`shard`), before the optimizer takes its parameters
    optimizer    AdamW over the trainable parameters, and its schedule
    objective    the task loss's router regularizers and the EMA teacher (`loss.objective`); when the model is
                 sharded after assembly (FSDP2), built on the sharded model by `RunParts.bind` instead
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..config import RegularizerConfig, TrainConfig
from .freezing import Freezer
from .loss.objective import Objective
from .optimizer import make_optimizer
from .parallel.recompute import apply_activation_checkpointing
from .schedule import make_scheduler


@dataclass
class RunParts:
    """What `assemble` made; `objective` is None until `bind` when the model is sharded after assembly."""

    freezer: Freezer
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    objective: Objective | None
    regularizers: RegularizerConfig

    def bind(self, model: nn.Module) -> RunParts:
        """The parts on `model`'s parameters once FSDP2 has sharded them: the freezer takes the new parameter
        objects, and the objective (its EMA teacher a copy of each process's shard) is built on them."""
        self.freezer.rebind(model)
        self.objective = Objective(model, self.regularizers)
        return self


def assemble(model: nn.Module, cfg: TrainConfig, *, optimizer_kind: dict | None = None,
             regularizers: RegularizerConfig | None = None, sharded: bool = False,
             shard: Callable[[nn.Module], None] | None = None,
             before_checkpointing: Callable[[nn.Module], None] | None = None) -> RunParts:
    """The run's parts on `model` (module docstring). `optimizer_kind`: AdamW's implementation on the run's device
    (`fused`, `foreach`); `regularizers`: the objective's (default the config's); `sharded`: the model is sharded
    after assembly (the objective waits for `bind`); `shard`: shards it before the optimizer is made;
    `before_checkpointing`: called with the model once the trainable set is chosen, before checkpointing."""
    freezer = Freezer(model, cfg.train, cfg.freeze, cfg.steps)
    if before_checkpointing is not None:
        before_checkpointing(model)
    apply_activation_checkpointing(model, cfg.activation_checkpointing)
    if shard is not None:
        shard(model)
    optimizer = make_optimizer(model, cfg, **(optimizer_kind or {}))
    scheduler = make_scheduler(optimizer, cfg)
    regularizers = regularizers if regularizers is not None else cfg.regularizers
    objective = None if sharded or shard is not None else Objective(model, regularizers)
    return RunParts(freezer, optimizer, scheduler, objective, regularizers)

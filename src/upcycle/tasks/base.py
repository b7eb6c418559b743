"""What a task provides to the training loop, the memory plan and the comparison: the one contract every task keeps
(torchtitan keeps its loss and model contracts as protocols; here the base class also gives the defaults).

  train           the training batches in their seeded, resumable order: `train.batch(step)` -> a dict of tensors
  eval_rows       held-out model inputs for routing diagnostics (ids, mask), or None
  loss            the task's loss of one micro-batch
  tokens          the real tokens of a batch (throughput counts these)
  evaluate        held-out metrics, or None when the run has no held-out data
  layout          a micro-batch laid out on the host for its device (default: as it is)
  check_forward   refuse, at start-up, a forward of too few examples for the loss (default: any size trains)

A task is made by `make.make_task` from the name the model's architecture row (or its class) gives it
(`kind.model_task`), through `make.TASKS`; the loop asks nothing else of it.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn


class Task:
    """The base every task derives from (the contract above); a subclass sets `name` and implements `loss`,
    `tokens` and `evaluate`, and makes `train` (and `eval_rows`) in its constructor."""

    name: ClassVar[str]
    train = None            # the batches: `.batch(step)`
    eval_rows: tuple[torch.Tensor, torch.Tensor] | None = None

    def loss(self, model: nn.Module, batch: dict) -> torch.Tensor:
        raise NotImplementedError

    def tokens(self, batch: dict) -> int:
        raise NotImplementedError

    def evaluate(self, model: nn.Module) -> dict | None:
        raise NotImplementedError

    def layout(self, batch: dict, device: torch.device, processes: int = 1) -> dict:
        """A micro-batch as the device's forward takes it (a task that lays its batches out overrides this)."""
        return batch

    def check_forward(self, examples: int) -> None:
        """Refuse, before any weight is written, a forward of `examples` (batch_size / (processes x grad_accum))
        that the loss cannot train on; every size trains unless a task says otherwise."""

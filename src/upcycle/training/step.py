"""One training step: the step `upcycle train`'s loop runs and the one the public API exposes (docs/design.md
principle 9).

    for each micro-batch:  loss = task loss + sum_r lambda_r L_r + lambda_EESD L_EESD   (objective.Objective)
                           backward(loss / micro-batches)      # DDP syncs the gradients on the last one only
    freeze rules -> gradient norm, clipped to clip_grad -> a NaN/inf loss or norm on any process: no update
    AdamW -> restore frozen rows -> LR schedule -> EMA teacher, aux-free bias (moved by the global load)

`upcycle train` passes its Accelerate `Accelerator` (autocast, DDP, gradient scaling), scheduler and freezing
rules; without them the same code runs on plain torch in one process (`PlainTorch`), so a script's
`train_step(model, batch, optimizer, reg)` computes what `upcycle train` computes for that batch.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..core.devices import to_device
from ..tasks.causal_lm import causal_lm_loss
from .freezing import Freezer
from .loss.objective import Objective


@dataclass
class StepResult:
    """What one step did. After an update, `loss` and `tokens` cover every process (`loss`: the mean of each
    term over micro-batches and processes); a skipped step reports this process's terms."""

    loss: dict[str, float]          # each term's value by name (task, each regularizer, eesd, total), sorted
    tokens: int                     # tokens the step trained on
    grad_norm: float | None         # global gradient norm before clipping (None: no parameter got a gradient)
    lr: float                       # the learning rate the update used
    skipped: str | None = None      # why the weights were not updated (a non-finite loss or gradient), or None


class PlainTorch:
    """The parts of an Accelerate `Accelerator` the step uses, for one process on plain torch."""

    num_processes = 1

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def autocast(self):
        return contextlib.nullcontext()

    def no_sync(self, model: nn.Module):
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def clip_grad_norm_(self, parameters: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)

    def reduce(self, tensor: torch.Tensor, reduction: str) -> torch.Tensor:
        return tensor


def micro_batches(batch: dict[str, torch.Tensor], rank: int, micro: int, grad_accum: int) -> list[dict]:
    """This process's `grad_accum` micro-batches of `micro` rows each, cut from the step's global batch (its
    rows rank * micro * grad_accum onwards), so every process count sees the same global batch."""
    share = micro * grad_accum
    mine = {k: v[rank * share:(rank + 1) * share] for k, v in batch.items()}
    return [{k: v[m * micro:(m + 1) * micro] for k, v in mine.items()} for m in range(grad_accum)]


def any_process(accelerator, flag: bool) -> bool:
    """Whether `flag` holds on any process (all processes must take the same branch)."""
    value = torch.tensor([float(flag)], device=accelerator.device)
    if accelerator.num_processes > 1:
        value = accelerator.reduce(value, reduction="max")
    return value.item() > 0


def count_tokens(batch: dict) -> int:
    """Real tokens of a text batch: attention-mask ones, or every id when there is no mask (counted on the batch
    as it came from the data, on the CPU)."""
    mask = batch.get("attention_mask")
    return int(mask.sum()) if mask is not None else batch["input_ids"].numel()


@dataclass(frozen=True)
class StepSetup:
    """What every step of a run uses, decided once: the task's loss and real-token count, the accelerator
    (None: plain torch on the model's device), the LR scheduler, the freezing rules and the gradient clip."""

    task_loss: Callable[[nn.Module, dict], torch.Tensor] = causal_lm_loss
    tokens: Callable[[dict], int] = count_tokens
    accelerator: object = None
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    freezer: Freezer | None = None
    clip_grad: float | None = None


def train_step(model: nn.Module, batches: dict | Sequence[dict], optimizer: torch.optim.Optimizer,
               reg: Objective, setup: StepSetup = StepSetup(), *, step: int = 0, router: bool = True,
               groups: torch.Tensor | None = None) -> StepResult:
    """One optimizer step on `batches` (one batch, or the micro-batches of gradient accumulation), as the module
    docstring says. `step` is the 0-based step the freezing rules read; `router=False` leaves the router losses
    out (after `router_until`); `groups`: token groups for the router losses of every micro-batch. A step with
    a non-finite loss or gradient norm on any process leaves the weights, the teacher and the bias unchanged
    and says why in `skipped` (the scheduler still moves on); what the run does then is the caller's choice."""
    task_loss, tokens, scheduler, freezer = setup.task_loss, setup.tokens, setup.scheduler, setup.freezer
    acc = setup.accelerator if setup.accelerator is not None else PlainTorch(next(model.parameters()).device)
    micro = [batches] if isinstance(batches, dict) else list(batches)
    model.train()
    optimizer.zero_grad(set_to_none=True)      # a no-op in `upcycle train`, which zeroes after every step
    sums, n_tokens = _accumulate(model, micro, acc, reg, task_loss, tokens, router, groups)
    if freezer is not None:
        freezer.before_step(step)
    trainable = [p for p in model.parameters() if p.grad is not None]
    # max_norm inf measures the norm without clipping, so a NaN gradient is seen with clipping off too
    grad_norm = acc.clip_grad_norm_(trainable, setup.clip_grad or math.inf) if trainable else None
    sums = _to_host(sums)          # after the backward: the device has the step's work queued already
    lr = scheduler.get_last_lr()[0] if scheduler is not None else optimizer.param_groups[0]["lr"]
    why = _nonfinite(acc, sums, grad_norm)
    if why is not None:
        optimizer.zero_grad(set_to_none=True)
        if freezer is not None:
            freezer.after_step()
        if reg.balancer is not None:          # the skipped forwards' loads must not move the bias
            for counts in reg.balancer.counts.values():
                counts.zero_()
        if scheduler is not None:
            scheduler.step()
        return StepResult({k: sums[k] for k in sorted(sums)}, n_tokens, None if grad_norm is None else float(grad_norm),
                          lr, skipped=why)
    optimizer.step()
    if freezer is not None:
        freezer.after_step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    if reg.balancer is not None and acc.num_processes > 1:   # every process moves the biases by the global load
        for counts in reg.balancer.counts.values():
            counts.copy_(acc.reduce(counts, reduction="sum"))
    reg.after_optimizer_step()
    loss, n_tokens = _across_processes(acc, sums, n_tokens)
    return StepResult(loss, n_tokens, None if grad_norm is None else float(grad_norm), lr)


def _accumulate(model: nn.Module, micro: list[dict], acc, reg: Objective, task_loss, tokens, router: bool,
                groups: torch.Tensor | None) -> tuple[dict[str, torch.Tensor], int]:
    """Forward and backward of each micro-batch (loss / micro-batches); the terms' means (on the device) and the
    tokens (counted on the CPU batches)."""
    sums: dict[str, torch.Tensor] = {}
    n_tokens = 0
    for m, cpu_batch in enumerate(micro):
        batch = to_device(cpu_batch, acc.device)
        sync = contextlib.nullcontext() if m == len(micro) - 1 else acc.no_sync(model)
        with sync, acc.autocast():
            total, logged = reg.loss(task_loss(model, batch), groups=groups, router=router)
            acc.backward(total / len(micro))
        for k, v in logged.items():
            sums[k] = sums[k] + v / len(micro) if k in sums else v / len(micro)
        n_tokens += tokens(cpu_batch)
    return sums, n_tokens


def _to_host(sums: dict[str, torch.Tensor]) -> dict[str, float]:
    """The step's loss terms as numbers, in one copy from the device."""
    names = sorted(sums)
    values = torch.cat([sums[k].detach().double().reshape(1) for k in names]).tolist() if names else []
    return dict(zip(names, values, strict=True))


def _nonfinite(acc, sums: dict[str, float], grad_norm: torch.Tensor | None) -> str | None:
    """Why this step must not update the weights (NaN/inf loss or gradient), agreed by every process."""
    bad = [f"{k} loss {v}" for k, v in sums.items() if not math.isfinite(v)]
    if grad_norm is not None and not math.isfinite(float(grad_norm)):
        bad.append(f"gradient norm {float(grad_norm)}")
    return (", ".join(bad) or "non-finite values on another process") if any_process(acc, bool(bad)) else None


def _across_processes(acc, sums: dict[str, float], n_tokens: int) -> tuple[dict[str, float], int]:
    """Each term's mean over processes and the tokens of all processes, in one reduction (float64: exact for
    one process)."""
    names = sorted(sums)
    values = torch.tensor([sums[k] for k in names] + [float(n_tokens)], device=acc.device, dtype=torch.float64)
    if acc.num_processes > 1:
        values = acc.reduce(values, reduction="sum")
        values[:-1] /= acc.num_processes
    return {k: float(v) for k, v in zip(names, values[:-1].tolist(), strict=True)}, int(values[-1])

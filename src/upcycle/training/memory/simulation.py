"""Two training steps of a model built of fake tensors (torch's FakeTensorMode: shapes and dtypes, no data, no
memory), with every tensor's storage followed from its creation to its release: the bytes a real step would hold
at each moment, by kind, without holding them.

The step is the trainer's (`step.train_step`) without its reads of the device (a fake tensor has no value):
the task's loss and the objective (router losses, the EMA teacher's pass), the backward pass (activation
checkpointing recomputes as it would), gradient clipping, AdamW, the teacher's update (the aux-free bias's
update reads its loads, [experts] numbers, and is left out). The
second step starts with AdamW's state in place, as every step after the first does. The model's code runs as on
the CPU (`memory_trace` says what that means for autocast, attention and the MoE layers).

Kinds: `grads` (a parameter's .grad), `optimizer` (what the optimizer step makes: AdamW's moments and its
temporaries), `teacher` (EESD's EMA copy), `other` (the activations, the weight copies autocast makes, every other
temporary). The parameters themselves exist before and are
not counted here. `MemoryPlan` scales the first three by a layout's sharding and adds what several processes add.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from .peak import Timeline, tracking


def simulate_steps(model: nn.Module, loss: Callable[[nn.Module], torch.Tensor], optimizer: torch.optim.Optimizer,
                   objective, *, autocast_dtype: torch.dtype | None, steps: int = 2,
                   clip_grad: float | None = 1.0) -> Timeline:
    """`steps` training steps of `model` (built in `memory_trace.fake_mode()`, as are `optimizer` and
    `objective`), one micro-batch each: `loss(model)` is the task's loss of one micro-batch."""
    simulation = Timeline()
    autocast = torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype is not None else \
        contextlib.nullcontext()
    params = [p for p in model.parameters() if p.requires_grad]
    with tracking(simulation) as tracker:
        tracker.ignore([*model.parameters(), *model.buffers()])
        handles = [p.register_post_accumulate_grad_hook(lambda p: tracker.move(p.grad, "grads")) for p in params]
        if objective.teacher is not None:
            for p in objective.teacher._teacher_params:
                tracker.add(p, "teacher")
        try:
            for _ in range(steps):
                simulation.phase = "forward"
                with autocast:
                    total, _ = objective.loss(loss(model))
                simulation.phase = "backward"
                total.backward()
                del total
                # what the step makes (AdamW's state, its temporaries) is as sharded as the parameters it updates
                simulation.phase, simulation.kind = "optimizer step", "optimizer"
                if clip_grad is not None:
                    torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], clip_grad)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if objective.teacher is not None:     # the aux-free bias's update reads its loads: [E] numbers
                    objective.teacher.update()
                simulation.kind = "other"
        finally:
            for handle in handles:
                handle.remove()
    return simulation

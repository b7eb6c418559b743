"""The task a model trains on, made from the config: `kind.model_task` names it (causal LM, CLIP, or text pairs for
encoders), `TASKS` says which class builds it (each module is imported only when its task is asked for: the text-pair
readers load for encoders alone), and the class builds its batches, loss and evaluation (`base.Task`)."""

from __future__ import annotations

import importlib

from torch import nn

from ..config import TASKS as TASK_NAMES
from ..config import TrainConfig
from .base import Task
from .kind import model_task

# task name (what the architecture table and `--task` say) -> the module and class that build it
TASKS: dict[str, tuple[str, str]] = {"causal_lm": (".causal_lm", "CausalLMTask"), "clip": (".clip", "CLIPTask"),
                                     "contrastive": (".contrastive", "ContrastiveTask")}
assert set(TASKS) == set(TASK_NAMES)


def task_class(name: str) -> type[Task]:
    module, cls = TASKS[name]
    return getattr(importlib.import_module(module, __package__), cls)


def make_task(cfg: TrainConfig, model: nn.Module, tokenizer, kind: str | None = None) -> Task:
    """The task `cfg` trains `model` on: `kind` when a plan decided it (`training.run_plan.TrainPlan.decided_task`),
    else decided from the model (`kind.model_task`)."""
    return task_class(kind or model_task(model, cfg.task))(cfg, model, tokenizer)

"""The task a model trains on, made from the config: `kind.model_task` decides which (causal LM, CLIP, or text
pairs for encoders), the task's own module builds its batches, loss and evaluation."""

from __future__ import annotations

from torch import nn

from ..config import TrainConfig
from .causal_lm import CausalLMTask, from_embedded_model
from .clip import CLIPTask
from .kind import model_task


def make_task(cfg: TrainConfig, model: nn.Module, tokenizer):
    from .contrastive import ContrastiveTask  # imports the text-pair readers only when asked

    kind = model_task(model, cfg.task)
    if kind == "contrastive":        # encoders: text pairs (upcycle.tasks.contrastive)
        return ContrastiveTask(cfg, model, tokenizer)
    if kind == "clip":
        return CLIPTask(cfg, model, tokenizer)
    return CausalLMTask(cfg, model, tokenizer, is_default=from_embedded_model(cfg.model))

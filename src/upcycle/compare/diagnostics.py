"""The analysis metrics of a model's MoE layers on held-out inputs of its task, for `upcycle compare`.

The numbers are `upcycle.metrics.layer_metrics` (docs/methods.md §5, the functions `upcycle analyze` reports) on each
MoE layer's inputs at the real tokens of a fixed held-out batch: the first `DIAGNOSTIC_TOKENS` tokens of the
held-out text (causal LM), the first `DIAGNOSTIC_PAIRS` held-out image-caption pairs (CLIP: each tower's
layers see their own modality), or the held-out texts the contrastive task keeps for it (its `eval_rows`: the
queries and documents of its first 128 held-out pairs, one text per row; the rows of a batch are cut to its
longest text). Unlike `upcycle analyze`, which reads text sources, this works for every task
`upcycle train` has, so the init and end diagnostics of a CLIP study come from the same functions.

Per layer the table keeps the scalars (mean expert weight similarity over all projections, diversity, output
similarity, routing entropy and its ratio to log E, load CoV, relative compactness); the model's value is the
mean over its MoE layers.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..core.layer_inputs import layer_inputs
from ..core.modes import eval_mode
from ..core.moe import moe_layers
from ..metrics import layer_metrics
from ..tasks.embedding import trim

DIAGNOSTIC_TOKENS = 2048       # causal LM: held-out tokens (whole rows)
DIAGNOSTIC_PAIRS = 256         # CLIP: held-out image-caption pairs
OUTPUT_TOKENS = 256            # tokens every expert runs on (output similarity, relative compactness)
SCALARS = ("expert_similarity", "diversity", "output_similarity", "routing_entropy", "entropy_ratio", "load_cov",
           "relative_compactness")


def held_out_batches(task) -> list[dict[str, torch.Tensor]]:
    """The fixed held-out inputs of a training task (`upcycle.tasks`): [] when it has none."""
    if task.name == "clip":
        if task.held is None:
            return []
        pairs = task.held.subset(list(range(min(len(task.held), DIAGNOSTIC_PAIRS))))
        batch = task.encode(pairs, "held-out image-caption pairs")
        return [{k: batch[k][i:i + 64] for k in batch} for i in range(0, len(pairs), 64)]
    if task.eval_rows is None:
        return []
    if task.name == "contrastive":     # one short text per row: every row, without the padding of the longest
        ids, mask = task.eval_rows
        return [dict(zip(("input_ids", "attention_mask"), trim(ids[i:i + 32], mask[i:i + 32]), strict=True))
                for i in range(0, len(ids), 32)]
    ids, mask = task.eval_rows
    rows = max(1, DIAGNOSTIC_TOKENS // ids.shape[1])
    return [{"input_ids": ids[i:i + 8], "attention_mask": mask[i:i + 8]} for i in range(0, min(rows, len(ids)), 8)]


def _scalars(m: dict) -> dict:
    entropy = m["routing_entropy"]
    return {"expert_similarity": m["weight_similarity"]["all"]["mean"], "diversity": m["diversity"],
            "output_similarity": m["output_similarity"]["mean"], "routing_entropy": entropy,
            "entropy_ratio": entropy / math.log(m["num_experts"]) if m["num_experts"] > 1 else None,
            "load_cov": m["load_cov"], "relative_compactness": m["relative_compactness"], "tokens": m["tokens"]}


@torch.no_grad()
def diagnose(model: nn.Module, batches: list[dict[str, torch.Tensor]]) -> dict | None:
    """{'layers': {name: scalars}, 'mean': {scalar: mean over layers}} of the model on `batches`, or None for a
    model without upcycle MoE layers (the dense baseline) or without held-out inputs."""
    layers = moe_layers(model)
    if not layers or not batches:
        return None
    device = next(model.parameters()).device
    # each layer's own record says which of its tokens are real (a tower without padding: all)
    with layer_inputs(layers, lambda layer, x: layer.last_record.mask_T if layer.last_record else None) as inputs:
        with eval_mode(model):
            for batch in batches:
                model(**{k: v.to(device) for k, v in batch.items()})
    per_layer = {}
    with eval_mode(model):       # capacity as at evaluation, like the held-out metric
        for name, layer in layers.items():
            per_layer[name] = _scalars(layer_metrics(layer, torch.cat(inputs.pop(name)), output_tokens=OUTPUT_TOKENS))
    mean = {}
    for key in SCALARS:
        values = [v[key] for v in per_layer.values() if v[key] is not None]
        mean[key] = sum(values) / len(values) if values else None
    return {"layers": per_layer, "mean": mean}

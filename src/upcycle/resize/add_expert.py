"""One more expert in every MoE layer, made from another fine-tune of the same base (`upcycle grow --add`), the way
`upcycle convert`'s several-source merge makes each source's expert: the fine-tune's FFN of that block, and a
router row from the fine-tune's own text (`methods.source_router.centroid_row`: the unit spherical mean of the
layer's inputs on that text), scaled to the mean norm of the layer's rows so its logits are on their scale.

The fine-tune is checked against the model's base before anything is written (`check_finetune`): the same
architecture and sizes (`checkpoint.differences.architecture_difference`) and the same tokenizer (the model reads the
fine-tune's text and routes its tokens; another token map would train and route other tokens).
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import PlacementConfig
from ..core.architectures import family_of
from ..core.moe import MoELayer, moe_layers
from ..core.resize import append_experts
from ..core.surgery import plan_targets, tower_cfg
from ..errors import UpcycleError
from ..methods.source_router import centroid_row
from .expert_count import moe_inputs, replace_layer


def check_finetune(model: str, finetune: str) -> None:
    """Refuse a fine-tune that is not of the upcycle folder `model`'s base: its architecture, sizes or tokenizer
    (config and tokenizer files only: no weight is read)."""
    from ..checkpoint.differences import architecture_difference, tokenizer_difference
    from ..checkpoint.loading import dense_config
    from ..checkpoint.upcycle_format import base_config

    _, theirs = dense_config(finetune, wanted_by="--add takes a dense fine-tune of the model's base")
    why = architecture_difference(base_config(model), theirs)
    if why is not None:
        raise UpcycleError(f"--add {finetune} does not have the architecture and sizes of {model}'s base: {why}")
    why = tokenizer_difference(model, finetune)
    if why is not None:
        raise UpcycleError(f"--add {finetune} does not share {model}'s tokenizer: {why}")


@torch.no_grad()
def add_expert(model: nn.Module, finetune: nn.Module, batches: list[dict]) -> dict:
    """Append the fine-tune's FFN of each MoE layer's block as an expert, its router row the centroid of the
    layer's inputs on `batches` (the fine-tune's text); returns, per layer, the new expert's index, the largest
    cosine of its row with the others, and the share of those tokens whose top-1 expert it is."""
    layers = {name: layer for name, layer in moe_layers(model).items()}
    if not layers:
        raise UpcycleError("the model has no upcycle MoE layer: --add takes an upcycle folder")
    family = family_of(finetune.config)
    targets = {t.path: t for t in plan_targets(finetune, PlacementConfig(every=1))}
    inputs = moe_inputs(model, layers, batches)
    report = {}
    for name, layer in layers.items():
        block = next((path for path in targets if name.startswith(path + ".")), None)
        if block is None:
            raise UpcycleError(f"{name}: the fine-tune has no block at that place")
        ffn = family.extract(finetune.get_submodule(block), tower_cfg(finetune, family, targets[block]))
        rows = layer.router.weight.detach()
        scale = float(torch.linalg.vector_norm(rows, dim=-1).mean())
        row = centroid_row(inputs[name]).to(rows) * scale
        bias = layer.router.bias.detach().mean().reshape(1) if layer.router.bias is not None else None
        new = append_experts(layer, ffn.map(lambda t: t.detach().unsqueeze(0)), row[None], bias)
        replace_layer(model, name, new)
        cosine = torch.nn.functional.cosine_similarity(rows, row[None], dim=-1)
        top1 = _routed_first(new, inputs[name])
        report[name] = {"added": layer.num_experts, "router_row_max_cosine": float(cosine.max()),
                        "top1_share_of_its_text": top1}
    return report


def _routed_first(layer: MoELayer, x_TD: torch.Tensor) -> float:
    """The share of the tokens whose top-1 expert is the layer's last (the one added), in eval mode."""
    was = layer.training
    layer.eval()
    try:
        ids = layer.route(x_TD.to(layer.router.weight.device)).topk_ids_TK
    finally:
        layer.train(was)
    return float((ids[:, 0] == layer.num_experts - 1).double().mean())

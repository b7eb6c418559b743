"""The upcycled model before any weight exists: the dense skeleton with MoE layers of the method's shapes.

The MoE layers are built on the meta device too, shaped as the method declares (`methods.LayerLayout`: each routed
expert's width, a shared expert, a router bias), so that, before a weight is read:
  - `upcycle convert --dry-run` counts the parameters and the bytes the conversion would write;
  - the streaming conversion knows every output tensor's name, shape and dtype, and so can lay out every shard
    of the output before the first tensor is computed (`checkpoint.writer.ShardedWriter`).
A test converts real tiny models with every method and compares their tensors with this plan.
"""

from __future__ import annotations

import torch
from torch import nn

from ..checkpoint.skeleton import empty_model
from ..config import MoEConfig
from ..core.architectures import family_of
from ..core.expert_shape import ExpertShape
from ..core.ffn import FFNWeights
from ..core.moe import MoELayer
from ..core.surgery import Target, install, plan_targets, tower_cfg
from ..errors import UpcycleError
from ..methods import LayerLayout


def empty_moe_layer(dense: FFNWeights, layout: LayerLayout, moe: MoEConfig, *, dtype: torch.dtype,
                    output_dropout: float = 0.0) -> MoELayer:
    """An MoE layer of the layout's shapes on the meta device (the router float32, as MoELayer makes it)."""
    limit = min(dense.hidden_size, layout.routed_width)
    if moe.experts == "delta" and moe.delta_rank > limit:
        raise UpcycleError(f"moe.delta_rank must be at most min(model width, expert width) = {limit} (a rank-r "
                           f"change of a {layout.routed_width} x {dense.hidden_size} matrix), got {moe.delta_rank}")
    with torch.device("meta"):
        return MoELayer(ExpertShape.of(dense).with_width(layout.routed_width), moe,
                        num_shared_experts=1 if layout.shared_width is not None else 0,
                        shared_intermediate_size=layout.shared_width, router_bias=layout.router_bias,
                        output_dropout=output_dropout, dtype=dtype)


def planned_model(config, moe: MoEConfig, placement, layout_of, *, dtype: torch.dtype,
                  model: nn.Module | None = None) -> tuple[nn.Module, list[Target]]:
    """The upcycled model on the meta device and its MoE targets; `layout_of(dense FFN) -> LayerLayout`.
    `model`: the weightless dense model to install the layers into (default: a new one)."""
    model = model if model is not None else empty_model(config, dtype)
    family = family_of(model.config)
    targets = plan_targets(model, placement)
    for target in targets:
        block = model.get_submodule(target.path)
        tcfg = tower_cfg(model, family, target)
        dense = family.extract(block, tcfg)
        install(model, target.path, empty_moe_layer(dense, layout_of(dense), moe, dtype=dtype,
                                                    output_dropout=family.output_dropout(tcfg)))
    return model, targets


def layout_function(method, args: dict):
    """dense FFN -> the LayerLayout `method` declares for it with resolved `args`."""
    def layout_of(dense: FFNWeights) -> LayerLayout:
        return method.layout(dense.intermediate_size, args)
    return layout_of

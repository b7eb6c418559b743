"""The one place an MoE layer is built from weights in hand (`MoELayer.from_init`'s one caller): a method's output
at conversion (`conversion.upcycle_layer`), a layer's experts picked or extended by prune and grow (`core.resize`),
and a stock model's sparse block copied for the analysis (`core.stock_moe`). Built on the device the experts are
on, in the dtype asked for (default: the experts')."""

from __future__ import annotations

import torch

from ..config import MoEConfig
from .ffn import FFNWeights
from .moe import MoELayer


def layer_from_weights(experts: FFNWeights, router_ED: torch.Tensor, config: MoEConfig, *,
                       shared: FFNWeights | None = None, router_bias_E: torch.Tensor | None = None,
                       dtype: torch.dtype | None = None, output_dropout: float = 0.0,
                       base: FFNWeights | None = None) -> MoELayer:
    """An MoE layer holding `experts` (stacked), router rows `router_ED` (and bias), and `shared` experts; delta
    experts (`config.experts: delta`) as `base` (the dense FFN; default their mean) plus low-rank changes."""
    with torch.device(experts.w_up.device):
        layer = MoELayer.from_init(experts, router_ED, config=config, shared=shared, router_bias_E=router_bias_E,
                                   dtype=dtype, base=base)
    layer.dropout.p = output_dropout
    return layer


def layer_like(layer: MoELayer, experts: FFNWeights, router_ED: torch.Tensor, router_bias_E: torch.Tensor | None,
               selection_bias_E: torch.Tensor) -> MoELayer:
    """A layer of `layer`'s routing options, shared experts, dtype, dropout and mode whose routed experts are
    `experts` (their count from them), with these router rows, router bias and selection bias."""
    config = MoEConfig(**{**vars(layer.config), "num_experts": experts.num_experts})
    shared = layer.shared_experts.weights() if layer.shared_experts is not None else None
    new = layer_from_weights(experts, router_ED, config, shared=shared, router_bias_E=router_bias_E,
                             dtype=layer.experts.dtype, output_dropout=layer.dropout.p)
    with torch.no_grad():
        new.selection_bias.copy_(selection_bias_E)
    return new.train(layer.training)

"""The one place a conversion builds an MoE layer: from a method's output (`methods.ExpertInit`), whichever path
made it (one dense FFN in `blockwise.MethodLayers`, several sources' FFNs in `merge_layers.SourceLayers`)."""

from __future__ import annotations

import torch

from ..config import MoEConfig
from ..core.ffn import FFNWeights
from ..core.layer_build import layer_from_weights
from ..core.moe import MoELayer
from ..methods import ExpertInit


def upcycle_layer(init: ExpertInit, moe: MoEConfig, *, dtype: torch.dtype, output_dropout: float = 0.0,
                  dense: FFNWeights | None = None) -> MoELayer:
    """The MoE layer holding `init`'s experts, router rows (and bias) and shared experts, with the conversion's
    MoE options, built in `dtype` on the device the experts are on (the GPU with --device cuda). Delta experts
    take `dense` (the FFN the method started from) as their base."""
    return layer_from_weights(init.experts, init.router_ED, moe, shared=init.shared, router_bias_E=init.router_bias_E,
                              dtype=dtype, output_dropout=output_dropout, base=dense)

"""`copy`: Sparse Upcycling (Komatsuzaki et al., arXiv 2212.05055; docs/methods.md §2.1).

Every expert is the dense FFN; only the router is new. With renormalized top-k weights (they sum to 1) and no
capacity dropping, sum_k g_k E(x) = E(x): the MoE model computes exactly the dense model's function.
The experts are returned as expanded views of the one dense FFN (no memory of their own): the MoE layer copies
them into its own weights, so converting a layer never holds E float32 copies next to the layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.ffn import FFNWeights
from .registry import ExpertInit, LayerInputs, random_router, register


@dataclass(frozen=True)
class CopyArgs:
    """The arguments of `copy` (`--set method_args.NAME=VALUE`): their types, allowed values and defaults."""

    router_std: float = 0.02


@register("copy", paper="Komatsuzaki et al. 2022, Sparse Upcycling, arXiv:2212.05055",
          preserves_function=lambda args, normalize_topk, dropless: normalize_topk and dropless, no_deltas=None)
def copy(ffn: FFNWeights, layer: LayerInputs, args: CopyArgs) -> ExpertInit:
    """Every expert is a copy of the dense FFN; router ~ N(0, router_std^2)."""
    num_experts, generator = layer.num_experts, layer.generator
    router_std = args.router_std
    experts = ffn.expand(num_experts)
    return ExpertInit(experts=experts,
                      router_ED=random_router(num_experts, ffn.hidden_size, router_std, generator))

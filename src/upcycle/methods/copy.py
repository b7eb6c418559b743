"""`copy`: Sparse Upcycling (Komatsuzaki et al., arXiv 2212.05055; docs/methods.md §2.1).

Every expert is the dense FFN; only the router is new. With renormalized top-k weights (they sum to 1) and no
capacity dropping, sum_k g_k E(x) = E(x): the MoE model computes exactly the dense model's function.
The experts are returned as expanded views of the one dense FFN (no memory of their own): the MoE layer copies
them into its own weights, so converting a layer never holds E float32 copies next to the layer.
"""

from __future__ import annotations

import torch

from ..core.ffn import FFNWeights
from .registry import ExpertInit, random_router, register


@register("copy", paper="Komatsuzaki et al. 2022, Sparse Upcycling, arXiv:2212.05055",
          preserves_function=lambda args, normalize_topk, dropless: normalize_topk and dropless)
def copy(ffn: FFNWeights, *, num_experts: int, top_k: int, generator: torch.Generator,
         router_std: float = 0.02) -> ExpertInit:
    """Every expert is a copy of the dense FFN; router ~ N(0, router_std^2)."""
    experts = ffn.expand(num_experts)
    return ExpertInit(experts=experts,
                      router_ED=random_router(num_experts, ffn.hidden_size, router_std, generator))

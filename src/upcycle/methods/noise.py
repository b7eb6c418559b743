"""`noise`: noise upcycling (Qwen2 technical report; as described by OLMoE and Drop-Upcycling; docs/methods.md §2.2).

    W_i = W + (1 - M_i) * eps_i,   eps_i ~ N(0, sigma^2),

with M_i a random binary mask that keeps (1 - fraction) of the copied entries unperturbed. `std` is absolute,
or relative to each matrix's own entry std when `relative_std` is true (the default: one setting then
suits every layer whatever its scale). Weight matrices are perturbed, biases are copied.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Annotated

import torch

from ..config import Range
from ..core.ffn import FFNWeights
from .registry import ExpertInit, LayerInputs, random_router, register


@dataclass(frozen=True)
class NoiseArgs:
    """The arguments of `noise` (`--set method_args.NAME=VALUE`): their types, allowed values and defaults."""

    std: Annotated[float, Range(0)] = 0.01
    relative_std: bool = True
    fraction: Annotated[float, Range(0, 1)] = 1.0
    router_std: float = 0.02


@register("noise", paper="Qwen2 technical report (arXiv:2407.10671); OLMoE (arXiv:2409.02060)", no_deltas=None)
def noise(ffn: FFNWeights, layer: LayerInputs, args: NoiseArgs) -> ExpertInit:
    """Copies of the dense FFN plus Gaussian noise on a random `fraction` of each weight matrix's entries."""
    num_experts, generator = layer.num_experts, layer.generator
    std, relative_std, fraction, router_std = args.std, args.relative_std, args.fraction, args.router_std
    experts = ffn.repeat(num_experts)
    perturbed = {}
    for name in ("w_up", "w_gate", "w_down"):
        w_E = getattr(experts, name)
        if w_E is None:
            continue
        sigma = std * (getattr(ffn, name).float().std().item() if relative_std else 1.0)
        # drawn on the CPU from the seeded generator (the same bytes on every device), then moved to the weights
        eps = torch.randn(w_E.shape, generator=generator, dtype=torch.float32).to(w_E.device) * sigma
        perturb = (torch.rand(w_E.shape, generator=generator) < fraction).to(w_E.device)   # 1 - M_i
        perturbed[name] = (w_E.float() + eps * perturb).to(w_E.dtype)
    router = random_router(num_experts, ffn.hidden_size, router_std, generator)
    return ExpertInit(experts=replace(experts, **perturbed), router_ED=router)


"""`drop`: Drop-Upcycling (Nakamura et al., arXiv 2502.19261, ICLR 2025; docs/methods.md §2.3).

Each expert draws its own random subset of round(r * F) intermediate neurons. For those neurons the rows of
W_up / W_gate and the columns of W_down are re-initialized from N(mu, sigma^2), where mu and sigma are the mean
and std of the original matrix's entries; everything else is copied. The paper uses r = 0.5 (smaller r, such as
0.25, was found better for CLIP). Our choice where the paper (on bias-free Llama FFNs) is silent: a dropped
neuron's b_up / b_gate entries are re-drawn the same way from their bias vector's statistics; b_down, which
belongs to no neuron, is copied.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Annotated

import torch

from ..config import Range
from ..core.ffn import FFNWeights
from .registry import ExpertInit, LayerInputs, random_router, register

# tensor name -> the dimension that indexes intermediate neurons, in a single (unstacked) tensor
NEURON_DIM = {"w_up": 0, "w_gate": 0, "b_up": 0, "b_gate": 0, "w_down": 1}


@dataclass(frozen=True)
class DropArgs:
    """The arguments of `drop` (`--set method_args.NAME=VALUE`): their types, allowed values and defaults."""

    ratio: Annotated[float, Range(0, 1)] = 0.5
    router_std: float = 0.02


@register("drop", paper="Nakamura et al. 2025, Drop-Upcycling, arXiv:2502.19261", no_deltas=None)
def drop(ffn: FFNWeights, layer: LayerInputs, args: DropArgs) -> ExpertInit:
    """Copies of the dense FFN with a per-expert random fraction `ratio` of neurons re-initialized."""
    num_experts, generator = layer.num_experts, layer.generator
    ratio, router_std = args.ratio, args.router_std
    F = ffn.intermediate_size
    n_drop = round(ratio * F)
    sources = {n: t for n, t in ffn.tensors().items() if n in NEURON_DIM}
    stats = {n: (t.float().mean().item(), t.float().std().item() if t.numel() > 1 else 0.0)
             for n, t in sources.items()}
    stacks = {n: [] for n in sources}
    for _ in range(num_experts):
        neurons = torch.randperm(F, generator=generator)[:n_drop]
        for name, w in sources.items():
            mu, sigma = stats[name]
            dim = NEURON_DIM[name]
            shape = list(w.shape)
            shape[dim] = n_drop
            # drawn on the CPU from the seeded generator (the same bytes on every device)
            fresh = (torch.randn(shape, generator=generator, dtype=torch.float32) * sigma + mu).to(w.device, w.dtype)
            stacks[name].append(w.index_copy(dim, neurons.to(w.device), fresh))
    experts = replace(ffn.expand(num_experts), **{n: torch.stack(s) for n, s in stacks.items()})
    router = random_router(num_experts, ffn.hidden_size, router_std, generator)
    return ExpertInit(experts=experts, router_ED=router, info={"dropped_neurons_per_expert": n_drop})

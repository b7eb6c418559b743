"""Grown copies made to part: each new copy of an expert perturbed as the `noise` or `drop` initialization perturbs
a copy of the dense FFN (Qwen2 / OLMoE noise upcycling; Drop-Upcycling, arXiv:2502.19261; docs/methods.md §2.2-2.3),
with those methods' defaults.

A copy has its source's weights: where the two take the same token (both among its top-k) they receive the same
gradient, and the router split (`core.router_split`) only shares their tokens out, so training alone may part them
slowly (Expert Upcycling, arXiv:2604.19835, perturbs its copies for this reason). Only the copies' weights are
changed; the expert they copy and every router row stay as `core.resize.duplicate_experts` made them.
"""

from __future__ import annotations

import torch

from ..core.moe import Experts
from ..errors import UpcycleError
from ..methods.drop import DropArgs, drop
from ..methods.noise import NoiseArgs, noise
from ..methods.registry import LayerInputs

PERTURB = ("none", "noise", "drop")


def perturb_copies(experts: Experts, copies: range, how: str, generator: torch.Generator) -> None:
    """Experts `copies` of a layer's `experts` (the copies growth appended) perturbed in place by `how`
    (`PERTURB`), each from its own weights, drawn from `generator` (one generator through the layers in order:
    the in-memory and the streamed grow draw alike)."""
    if how not in PERTURB:
        raise UpcycleError(f"--perturb must be one of {', '.join(PERTURB)}, got {how!r}")
    if how == "none":
        return
    stack = experts.weights()                        # views of the layer's parameters (gate and up unfused)
    one = LayerInputs(num_experts=1, top_k=1, generator=generator)
    with torch.no_grad():
        for e in copies:
            made = noise(stack.expert(e), one, NoiseArgs()) if how == "noise" else \
                drop(stack.expert(e), one, DropArgs())
            for name, tensor in made.experts.tensors().items():
                getattr(stack, name)[e].copy_(tensor[0])

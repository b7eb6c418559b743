"""The inputs of a model's MoE layers at its real tokens, gathered while the model runs: what `upcycle analyze`
(`analyze/collect.py`) and `upcycle compare`'s diagnostics (`compare/diagnostics.py`) compute their per-layer
metrics on. Each forward of a layer adds its input rows, flattened to [T, D], keeping the tokens `real_tokens`
marks (padding left out), detached, in float32 on the CPU."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

# (the layer, its input flattened to [T, D]) -> the real tokens' mask [T], or None for all of them
RealTokens = Callable[[nn.Module, torch.Tensor], torch.Tensor | None]


@contextlib.contextmanager
def layer_inputs(layers: dict[str, nn.Module], real_tokens: RealTokens) -> Iterator[dict[str, list[torch.Tensor]]]:
    """While active, each layer's input rows at real tokens, by layer name, one tensor per forward."""
    inputs: dict[str, list[torch.Tensor]] = {name: [] for name in layers}

    def keep(name: str):
        def hook(module, args, output):
            x_TD = args[0].reshape(-1, args[0].shape[-1])
            mask_T = real_tokens(module, x_TD)
            kept = x_TD[mask_T.to(x_TD.device).bool()] if mask_T is not None else x_TD
            inputs[name].append(kept.detach().float().cpu())
        return hook

    handles = [layer.register_forward_hook(keep(name)) for name, layer in layers.items()]
    try:
        yield inputs
    finally:
        for handle in handles:
            handle.remove()

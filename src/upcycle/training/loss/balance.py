"""Auxiliary-loss-free load balancing (DeepSeek-V3; Wang et al. 2024, arXiv 2408.15664; docs/methods.md §4.5).

Each MoE layer holds a per-expert `selection_bias` b_e (a persistent buffer, so it is saved with the model)
that is added to the routing scores for top-k *selection only*; the combine weights stay the router's own
probabilities (see `MoELayer.route`). After each optimizer step

    b_e <- b_e + u * sign(mean_e' load_e' - load_e)

where load_e counts the top-k selections of expert e over the real tokens (padding excluded) of every
training forward since the previous update (all micro-batches of a gradient-accumulation step). Not a loss.
"""

from __future__ import annotations

import torch
from torch import nn

from ...core.hooks import HookHolder
from ...core.moe import MoELayer, moe_layers
from ...core.router import expert_counts
from ...core.routing_context import ROUTING


class AuxFreeBalancer(HookHolder):
    """Counts each MoE layer's expert selections during training forwards; `step()` moves the biases."""

    def __init__(self, model: nn.Module, rate: float = 1e-3) -> None:
        if rate <= 0:
            raise ValueError(f"aux-free balancing: the update rate must be > 0, got {rate}")
        self.rate = rate
        self.layers = moe_layers(model)
        if not self.layers:
            raise ValueError("aux-free balancing: the model has no MoE layers")
        self.counts = {name: torch.zeros(layer.num_experts, device=layer.selection_bias.device)
                       for name, layer in self.layers.items()}
        self._handles = [layer.register_forward_hook(self._count_hook(name)) for name, layer in self.layers.items()]

    def _count_hook(self, name: str):
        def count(layer: MoELayer, args, output):
            record = layer.last_record
            if not layer.training or record is None or ROUTING.recomputing:     # a recomputation counts no load
                return
            self.counts[name] += expert_counts(record.topk_ids_TK, layer.num_experts, record.mask_T).to(
                self.counts[name])
        return count

    @torch.no_grad()
    def step(self) -> None:
        """Update every layer's selection bias from the loads counted since the last step, then reset them."""
        for name, layer in self.layers.items():
            load_E = self.counts[name]
            if load_E.sum() > 0:
                layer.selection_bias.add_(self.rate * torch.sign(load_E.mean() - load_E))
            load_E.zero_()

    def to(self, device: torch.device) -> AuxFreeBalancer:
        """Keep the load counts where the model is (Accelerate's `prepare` moves it after this was built)."""
        self.counts = {name: counts.to(device) for name, counts in self.counts.items()}
        return self


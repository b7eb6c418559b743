"""Stock transformers MoE classes (Qwen2-MoE, Qwen3-MoE, Mixtral) trained and evaluated as they are.

`upcycle convert --export hf` writes these classes; `upcycle train` and `upcycle eval` load them back with
`AutoModelForCausalLM` (no conversion to the upcycle format). Their router losses (docs/methods.md §4) come from the
same routing records as upcycle's own layers: a forward hook on each stock router (`*TopKRouter`, whose forward
returns router logits [T, E], the combine weights and the selected experts [T, k]) keeps them, with the batch's
padding mask. The class's own `output_router_logits` auxiliary loss stays off, so the router losses are the
ones the recipe's coefficients ask for, computed once. EESD and the aux-free selection bias need upcycle's MoE
layer (a teacher copy; a selection bias the stock classes do not have) and are refused for these classes.
`upcycle analyze` reads a stock block through `as_moe_layer`: its router and routed experts as an upcycle
`MoELayer`, so every metric has one implementation.
"""

from __future__ import annotations

import torch
from torch import nn

from .hooks import HookHolder
from .moe import MoELayer
from .router import RoutingRecord
from .routing_context import ROUTING


def is_stock_moe(model_or_config) -> bool:
    """Whether a model (or its config, or config.json as a dict) is a stock transformers MoE class: its config
    routes each token to `num_experts_per_tok` experts (Qwen2-MoE, Qwen3-MoE, Mixtral and any class the export
    registry adds; no dense model's config has that key)."""
    config = getattr(model_or_config, "config", model_or_config)
    value = config.get("num_experts_per_tok") if isinstance(config, dict) else \
        getattr(config, "num_experts_per_tok", None)
    return isinstance(value, int) and not isinstance(value, bool)


class StockRouting(HookHolder):
    """The latest routing record of each router of a stock MoE model, by router name."""

    def __init__(self, model: nn.Module) -> None:
        self.routers = {name: m for name, m in model.named_modules() if type(m).__name__.endswith("TopKRouter")}
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no *TopKRouter modules to record routing from")
        self.records: dict[str, RoutingRecord] = {}
        self._mask: torch.Tensor | None = None
        self._handles = [model.register_forward_pre_hook(self._take_mask, with_kwargs=True)]
        self._handles += [m.register_forward_hook(self._record(name)) for name, m in self.routers.items()]

    def _take_mask(self, module, args, kwargs) -> None:
        mask = kwargs.get("attention_mask")
        self._mask = mask.reshape(-1).bool() if mask is not None and mask.dim() == 2 else None

    def _record(self, name: str):
        def hook(module, args, output) -> None:
            if ROUTING.recomputing:          # activation checkpointing repeats a forward already recorded
                return
            logits_TE, weights_TK, ids_TK = output
            mask = self._mask if self._mask is not None and self._mask.numel() == logits_TE.shape[0] else None
            self.records[name] = RoutingRecord(logits_TE=logits_TE.float(), topk_ids_TK=ids_TK,
                                               topk_weights_TK=weights_TK.float(), kept_TK=None, mask_T=mask)
        return hook


def stock_moe_blocks(model: nn.Module) -> dict[str, nn.Module]:
    """The sparse MoE blocks of a stock model, by name: modules whose `gate` is a `*TopKRouter` and whose
    `experts` hold the fused stacked weights of transformers 5 (`gate_up_proj` [E, 2F, D], gate rows first, and
    `down_proj` [E, D, F])."""
    return {name: m for name, m in model.named_modules()
            if type(getattr(m, "gate", None)).__name__.endswith("TopKRouter")
            and hasattr(getattr(m, "experts", None), "gate_up_proj")}


@torch.no_grad()
def as_moe_layer(block: nn.Module, activation: str) -> MoELayer:
    """An upcycle `MoELayer` with the routed experts and router of a stock block (a copy; its shared expert, an
    always-on MLP, is left out): the same routing and the same experts for the analysis' metrics. Mixtral's
    router always renormalizes the top-k weights; Qwen's read `norm_topk_prob`."""
    from ..config import MoEConfig
    from .ffn import FFNWeights
    from .layer_build import layer_from_weights

    router, experts = block.gate, block.experts
    F_ = experts.gate_up_proj.shape[1] // 2
    weights = FFNWeights(w_gate=experts.gate_up_proj[:, :F_], w_up=experts.gate_up_proj[:, F_:],
                         w_down=experts.down_proj, activation=activation)
    config = MoEConfig(num_experts=weights.num_experts, top_k=router.top_k,
                       normalize_topk=getattr(router, "norm_topk_prob", True))
    return layer_from_weights(weights, router.weight.float(), config)

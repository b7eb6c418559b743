"""How much each expert of an MoE layer contributes on a set of its input tokens: the score pruning ranks by and
growth copies by (`upcycle prune`, `upcycle grow`).

  reap       REAP (router-weighted expert activation pruning; Cerebras, ICLR 2026): over the tokens routed to expert
             j (j among a token's top-k), the mean of g_j(x) * ||f_j(x)||_2, the gate weight the token gives j times
             the norm of j's output; an expert no token reaches scores 0
  frequency  the share of token-slots routed to the expert (MC-SMoE's frequency baseline)
  utility    Expert Upcycling's utility as this project computes it (arXiv:2604.19835 scores experts by load and
             a gradient or output norm): the routing load times the mean output norm, load_j * mean ||f_j(x)||
  random     a seeded uniform draw (the baseline)

The routing is the layer's own (selection bias and score function included), computed in eval mode.
"""

from __future__ import annotations

import torch

from ..core.moe import MoELayer

SALIENCY = ("reap", "frequency", "utility", "random")


@torch.no_grad()
def expert_saliency(layer: MoELayer, x_TD: torch.Tensor, by: str = "reap", *, seed: int = 0) -> torch.Tensor:
    """[E] float64: each expert's score by `by` (module docstring) on the tokens `x_TD` [T, D]."""
    if by not in SALIENCY:
        raise ValueError(f"saliency by {by!r}: one of {', '.join(SALIENCY)}")
    E = layer.num_experts
    if by == "random":
        return torch.rand(E, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    x_TD = x_TD.to(layer.router.weight.device)
    record = layer.route(x_TD)
    ids_TK, weights_TK = record.topk_ids_TK, record.topk_weights_TK.double()
    load_E = torch.bincount(ids_TK.reshape(-1), minlength=E).double()
    if by == "frequency":
        return (load_E / max(ids_TK.numel(), 1)).cpu()
    experts = layer.experts.weights()
    score = torch.zeros(E, dtype=torch.float64)
    for e in range(E):
        chosen_TK = ids_TK == e
        tokens = chosen_TK.any(dim=1).nonzero().reshape(-1)
        if tokens.numel() == 0:
            continue
        y_ND = experts.expert(e)(x_TD.index_select(0, tokens).to(experts.w_down.dtype))
        norm_N = y_ND.double().norm(dim=-1)
        if by == "reap":
            gate_N = (weights_TK * chosen_TK).sum(dim=1).index_select(0, tokens)
            score[e] = float((gate_N * norm_N).mean())
        else:                           # utility: load x mean output norm
            score[e] = float(load_E[e] / ids_TK.numel() * norm_N.mean())
    return score

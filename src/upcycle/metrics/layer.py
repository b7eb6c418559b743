"""Every docs/methods.md §5 metric of one MoE layer on a set of its input tokens, as one plain dict:

    from upcycle.metrics import layer_metrics
    m = layer_metrics(layer, x_TD)                     # x_TD: the layer's inputs (the FFN inputs) [T, D]
    m = layer_metrics(layer, x_TD, TokenSources(sources_T, ["wiki", "code"]))     # + specialization by source

  weight_similarity            per projection (gate, up, down) and over all weights: E x E matrix and mean
  diversity                    SPRI's 1 - mean cos of the down projections
  output_similarity            mean_t cos(E_i(x_t), E_j(x_t)): E x E matrix and mean (on `output_tokens` tokens)
  routing_entropy, router_load, load_cov, expert_routing_probability, probability_histograms   (`routing.py`)
  relative_compactness         Tr(Σ_W Σ_B^†) of the outputs each expert produces on its routed tokens
  simplex                      for E = 3, the router probabilities of up to `simplex_points` tokens
  specialization               with sources: the share matrices, I(S; top-1)/H(S) and its shuffled baseline;
                               for a merged model, router-source agreement per source

The routing is the layer's own (its selection bias included, capacity as in eval mode); the router
probabilities are the softmax (or the normalized sigmoid affinities) that the losses read. Shared experts are
always on and take no part. Everything is a float, None or a nested list: `json.dumps` takes it as is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.moe import MoELayer
from .compactness import relative_compactness
from .experts import diversity
from .routing import expert_routing_probability, load_cov, probability_histograms, router_load, routing_entropy
from .similarity import expert_outputs, output_similarity, weight_similarity
from .specialization import source_metrics


@dataclass(frozen=True)
class TokenSources:
    """Where each token came from: `sources_T`, each token's index into `names`; `expert_source`, for a model
    merged from several sources, the source each expert came from (the analysis's sources being the merge's, in
    its order), which adds router-source agreement to the specialization."""

    sources_T: torch.Tensor
    names: list[str]
    expert_source: list[int] | None = None


@torch.no_grad()
def layer_metrics(layer: MoELayer, x_TD: torch.Tensor, sources: TokenSources | None = None, *,
                  output_tokens: int = 512, bins: int = 40, simplex_points: int = 2000, shuffles: int = 20,
                  seed: int = 0) -> dict:
    """The metrics of the module docstring for `layer` on the tokens `x_TD` (with `sources`, the source of
    each token). Expert outputs are computed on a seeded sample of `output_tokens`."""
    if sources is not None and len(sources.sources_T) != len(x_TD):
        raise ValueError("sources_T needs one source per token")
    x_TD = x_TD.to(layer.router.weight.device)
    E, K, T = layer.num_experts, layer.top_k, x_TD.shape[0]
    record = layer.route(x_TD)
    probs_TE, ids_TK = record.probs_TE.detach(), record.topk_ids_TK
    experts = layer.experts.weights()
    load = router_load(ids_TK, E)
    out = {"num_experts": E, "top_k": K, "tokens": T,
           "weight_similarity": weight_similarity(experts), "diversity": diversity(experts),
           "routing_entropy": routing_entropy(probs_TE), "router_load": load, "load_cov": load_cov(load),
           "expert_routing_probability": expert_routing_probability(probs_TE, ids_TK),
           "probability_histograms": probability_histograms(probs_TE, bins)}

    g = torch.Generator().manual_seed(seed)
    pick = torch.randperm(T, generator=g)[:output_tokens].to(x_TD.device)
    y_ETD = expert_outputs(experts, x_TD[pick])
    out["output_sample_tokens"] = len(pick)
    out["output_similarity"] = output_similarity(y_ETD)
    # every token-slot (t, k) of the sample contributes the output of the expert it was routed to
    slot_experts = ids_TK[pick].reshape(-1)
    slot_tokens = torch.arange(len(pick), device=x_TD.device).repeat_interleave(K)
    out["relative_compactness"] = relative_compactness(y_ETD[slot_experts, slot_tokens], slot_experts)
    if E == 3:
        out["simplex"] = probs_TE[pick[:simplex_points]].double().tolist()
    if sources is not None:
        out["specialization"] = source_metrics(sources.sources_T.to(ids_TK.device), ids_TK, list(sources.names), E,
                                               shuffles=shuffles, seed=seed, expert_source=sources.expert_source)
    return out

"""Routing metrics (docs/methods.md §5), pure functions of one layer's router output on a set of tokens.

  routing_entropy   mean_t H(g(x_t)), H in nats, g the router's softmax over the E experts (log E = uniform)
  router_load       fraction of token-slots per expert: #{(t, k): id_tk = e} / (T k); sums to 1
  load_cov          coefficient of variation std/mean of the loads (0 = perfectly balanced)
  expert_routing_probability   mean g_e over the tokens that chose expert e (how sure the router is when it
                    picks e; 1/E for a uniform router)
  probability_histograms       per expert, the histogram of g_e over all tokens (the DPSL paper's figures)
  record_stats      entropy, load CoV and dropped token-slot fraction of one forward's routing record (the
                    training log's per-layer line)
  top1_agreement    fraction of tokens whose top-1 expert is the given group (Cluster-aware Upcycling's
                    "router = clusters at init" property)

Shape suffixes: T tokens, E experts, K experts per token. `mask_T` (True = real token) restricts every metric
to real tokens.
"""

from __future__ import annotations

import torch

from ..core.moe import MoELayer
from ..core.router import RoutingRecord, expert_counts, token_entropy


def routing_entropy(probs_TE: torch.Tensor, mask_T: torch.Tensor | None = None) -> float:
    h_T = token_entropy(probs_TE.double())
    return float(h_T[mask_T].mean() if mask_T is not None else h_T.mean())


def router_load(ids_TK: torch.Tensor, num_experts: int, mask_T: torch.Tensor | None = None) -> list[float]:
    counts_E = expert_counts(ids_TK, num_experts, mask_T).double()
    return (counts_E / counts_E.sum().clamp_min(1)).tolist()


def load_cov(load_E: list[float]) -> float:
    loads = torch.tensor(load_E, dtype=torch.float64)
    return float(loads.std(unbiased=False) / loads.mean()) if loads.mean() > 0 else 0.0


def expert_routing_probability(probs_TE: torch.Tensor, ids_TK: torch.Tensor,
                               mask_T: torch.Tensor | None = None) -> list[float | None]:
    """Per expert e, mean g_e(x_t) over the tokens t with e among their k choices; None where no token chose e."""
    if mask_T is not None:
        probs_TE, ids_TK = probs_TE[mask_T], ids_TK[mask_T]
    E = probs_TE.shape[1]
    chosen_TE = torch.zeros(probs_TE.shape, dtype=torch.bool, device=probs_TE.device)
    chosen_TE.scatter_(1, ids_TK, True)
    sums_E = (probs_TE.double() * chosen_TE).sum(0)
    counts_E = chosen_TE.sum(0)
    return [float(sums_E[e] / counts_E[e]) if counts_E[e] > 0 else None for e in range(E)]


# upper ends the histograms' range is rounded up to: a router near uniform (1/E) gets fine bins over [0, 0.2],
# a trained one the whole [0, 1]
HISTOGRAM_RANGES = (0.05, 0.1, 0.2, 0.3, 0.5, 1.0)


def probability_histograms(probs_TE: torch.Tensor, bins: int = 40, mask_T: torch.Tensor | None = None,
                           upper: float | None = None) -> dict:
    """{'edges': bins + 1 edges over [0, upper], 'counts': E x bins}: how often the router gives expert e each
    probability (a router that has not specialized piles every expert's mass near 1/E). `upper` defaults to the
    first of HISTOGRAM_RANGES at or above the largest probability."""
    if mask_T is not None:
        probs_TE = probs_TE[mask_T]
    probs = probs_TE.double()
    if upper is None:
        top = float(probs.max()) if probs.numel() else 1.0
        upper = next(r for r in HISTOGRAM_RANGES if r >= top)
    edges = torch.linspace(0, upper, bins + 1, dtype=torch.float64)
    counts = [torch.histc(probs[:, e], bins=bins, min=0.0, max=upper).long().tolist()
              for e in range(probs.shape[1])]
    return {"edges": edges.tolist(), "counts": counts}


@torch.no_grad()
def record_stats(record: RoutingRecord | None) -> dict | None:
    """Routing entropy (nats), load CoV over experts and dropped token-slot fraction of one forward (rounded to
    5 digits: a log line)."""
    if record is None:
        return None
    probs = record.probs_TE.detach()
    load = router_load(record.topk_ids_TK, probs.shape[1], record.mask_T)
    kept = record.kept_TK
    if kept is not None and record.mask_T is not None:
        kept = kept[record.mask_T]
    dropped = 0.0 if kept is None else float(1.0 - kept.float().mean())
    return {"entropy": round(routing_entropy(probs, record.mask_T), 5), "load_cov": round(load_cov(load), 5),
            "dropped": round(dropped, 5)}


def top1_agreement(ids_TK: torch.Tensor, groups_T: torch.Tensor) -> float:
    return float((ids_TK[:, 0] == groups_T.to(ids_TK.device)).double().mean())


@torch.no_grad()
def layer_routing_stats(layer: MoELayer, x_TD: torch.Tensor, groups_T: torch.Tensor | None = None) -> dict:
    """How `layer`'s router (its selection bias included) splits the tokens `x_TD` at init."""
    record = layer.route(x_TD.to(layer.router.weight.device))
    load = router_load(record.topk_ids_TK, layer.num_experts)
    stats = {"router_load": load, "router_load_cov": load_cov(load),
             "routing_entropy": routing_entropy(record.probs_TE)}
    if groups_T is not None:
        stats["router_cluster_agreement"] = top1_agreement(record.topk_ids_TK, groups_T)
    return stats

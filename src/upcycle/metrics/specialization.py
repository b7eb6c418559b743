"""Specialization by data source (docs/methods.md §5; the per-domain routing analyses of Mixtral and OLMoE).

  source_shares     the E x S matrix of each expert's token-slots split over the sources (rows sum to 1: "which
                    sources does expert e serve") and the S x E matrix of each source's token-slots split over the
                    experts (rows sum to 1: "where does source s go")
  specialization    I(S; X) / H(S), S the source of a token and X its top-1 expert: the share of the source's
                    uncertainty that the top-1 expert removes. 0 = the expert says nothing about the source,
                    1 = every expert serves one source only (each source has its own experts). It is the mutual
                    information normalized by the source entropy (Theil's uncertainty coefficient), not by
                    sqrt(H(S) H(X)): with more experts than sources the symmetric forms cannot reach 1 however
                    cleanly the sources are separated.
  shuffled_baseline the same score with the source labels randomly permuted over the tokens, `shuffles` times:
                    what a router that ignores the source scores on this many tokens (plug-in mutual information
                    is biased upwards, by about (E-1)(S-1) / (2T) nats), so a score is signal only when it
                    clearly exceeds the baseline's maximum
  source_agreement  for a model merged from several fine-tunes (one source per fine-tune, `expert_source[e]` the
                    source expert e was made from): per source, the share of its tokens whose top-1 expert is one
                    of its own (Branch-Train-MiX's question: does the router send code to the code expert?);
                    about the source's share of the experts for a router blind to the source

Shape suffixes: T tokens, K experts per token. Sources and experts are small integer labels.
"""

from __future__ import annotations

import torch


def _entropy(p: torch.Tensor) -> torch.Tensor:
    return -torch.special.xlogy(p, p).sum()


def specialization(sources_T: torch.Tensor, experts_T: torch.Tensor, num_sources: int, num_experts: int) -> float:
    """I(S; X) / H(S) in [0, 1] from the joint counts (plug-in estimate); 0 when there is only one source."""
    joint = torch.zeros(num_sources, num_experts, dtype=torch.float64)
    joint.index_put_((sources_T.long(), experts_T.long()), torch.ones(len(sources_T), dtype=torch.float64),
                     accumulate=True)
    joint /= joint.sum().clamp_min(1)
    h_s = _entropy(joint.sum(1))
    if h_s <= 0:
        return 0.0
    mutual = h_s + _entropy(joint.sum(0)) - _entropy(joint)
    return float((mutual / h_s).clamp(0.0, 1.0))


def shuffled_baseline(sources_T: torch.Tensor, experts_T: torch.Tensor, num_sources: int, num_experts: int, *,
                      shuffles: int = 20, seed: int = 0) -> dict:
    """{'mean', 'max', 'shuffles'} of `specialization` with the source labels permuted (seeded)."""
    g = torch.Generator().manual_seed(seed)
    scores = [specialization(sources_T[torch.randperm(len(sources_T), generator=g)], experts_T, num_sources,
                             num_experts) for _ in range(shuffles)]
    return {"mean": sum(scores) / len(scores), "max": max(scores), "shuffles": shuffles}


def source_shares(sources_T: torch.Tensor, ids_TK: torch.Tensor, num_sources: int, num_experts: int) -> dict:
    """{'expert_source_share': E x S, 'source_expert_share': S x E} over the token-slots (all k choices)."""
    counts = torch.zeros(num_sources, num_experts, dtype=torch.float64)
    K = ids_TK.shape[1]
    counts.index_put_((sources_T.long().repeat_interleave(K), ids_TK.reshape(-1).long()),
                      torch.ones(ids_TK.numel(), dtype=torch.float64), accumulate=True)
    per_expert = counts.T / counts.sum(0)[:, None].clamp_min(1)
    per_source = counts / counts.sum(1, keepdim=True).clamp_min(1)
    return {"expert_source_share": per_expert.tolist(), "source_expert_share": per_source.tolist()}


def source_agreement(sources_T: torch.Tensor, top1_T: torch.Tensor, expert_source: list[int],
                     num_sources: int) -> list[float | None]:
    """Per source s: the share of its tokens whose top-1 expert e has expert_source[e] == s (None: no tokens)."""
    origin_T = torch.as_tensor(expert_source, device=top1_T.device)[top1_T.long()]
    out = []
    for s in range(num_sources):
        mine = sources_T == s
        out.append(float((origin_T[mine] == s).double().mean()) if bool(mine.any()) else None)
    return out


def source_metrics(sources_T: torch.Tensor, ids_TK: torch.Tensor, names: list[str], num_experts: int, *,
                   shuffles: int = 20, seed: int = 0, expert_source: list[int] | None = None) -> dict:
    """Everything of this module for one layer: the share matrices, the score on the top-1 expert, its baseline,
    and with `expert_source` the router-source agreement per source."""
    S = len(names)
    # small integer labels: counted on the CPU (the routing may have run on a GPU; the tables are built here)
    sources_T, ids_TK = sources_T.cpu(), ids_TK.cpu()
    top1_T = ids_TK[:, 0]
    out = {"sources": list(names), **source_shares(sources_T, ids_TK, S, num_experts),
           "nmi": specialization(sources_T, top1_T, S, num_experts),
           "nmi_baseline": shuffled_baseline(sources_T, top1_T, S, num_experts, shuffles=shuffles, seed=seed)}
    if expert_source is not None:
        if len(expert_source) != num_experts or max(expert_source) >= S:
            raise ValueError(f"expert_source {expert_source} does not fit {num_experts} experts and {S} sources")
        out["source_agreement"] = dict(zip(names, source_agreement(sources_T, top1_T, expert_source, S),
                                           strict=True))
    return out

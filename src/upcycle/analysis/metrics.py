"""Expert-weight metrics (METHODS §5): how alike the experts of one layer are.

  expert_similarity  mean over expert pairs i < j of cos(vec E_i, vec E_j), each expert's weights
                     (gate, up, down; biases excluded) flattened into one vector
  diversity          SPRI's Div = 1 - mean_{i<j} cos(vec W_i^down, vec W_j^down) over the routed experts

Copy-upcycling gives similarity 1 and diversity 0; the perturbing and structured methods move both.
A single expert has no pairs: both are None.
"""

from __future__ import annotations

import torch

from ..ffn import FFNWeights


def mean_pairwise_cosine(vectors_EP: torch.Tensor) -> float | None:
    """Mean cosine similarity over the E(E-1)/2 pairs of rows."""
    E = vectors_EP.shape[0]
    if E < 2:
        return None
    unit = torch.nn.functional.normalize(vectors_EP.double(), dim=1)
    cos_EE = unit @ unit.T
    i, j = torch.triu_indices(E, E, offset=1)
    return cos_EE[i, j].mean().item()


def expert_similarity(experts: FFNWeights) -> float | None:
    parts = [t.flatten(1) for t in (experts.w_gate, experts.w_up, experts.w_down) if t is not None]
    return mean_pairwise_cosine(torch.cat(parts, dim=1))


def diversity(experts: FFNWeights) -> float | None:
    similarity = mean_pairwise_cosine(experts.w_down.flatten(1))
    return None if similarity is None else 1.0 - similarity

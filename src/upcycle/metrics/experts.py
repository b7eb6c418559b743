"""Expert-weight metrics (docs/methods.md §5): how alike the experts of one layer are.

  expert_similarity  mean over expert pairs i < j of cos(vec E_i, vec E_j), each expert's weights
                     (gate, up, down; biases excluded) flattened into one vector
  diversity          SPRI's Div = 1 - mean_{i<j} cos(vec W_i^down, vec W_j^down) over the routed experts

Copy-upcycling gives similarity 1 and diversity 0; the perturbing and structured methods move both.
A single expert has no pairs: both are None.
"""

from __future__ import annotations

import torch

from ..core.ffn import FFNWeights


def cosine_matrix(gram_EE: torch.Tensor) -> torch.Tensor:
    """The cosines between the vectors whose Gram matrix is `gram_EE` (a zero vector's row is zero)."""
    norms = gram_EE.diagonal().clamp_min(0).sqrt()
    return gram_EE / (norms[:, None] * norms[None, :]).clamp_min(1e-300)


def _mean_offdiagonal_cosine(gram_EE: torch.Tensor) -> float | None:
    E = gram_EE.shape[0]
    if E < 2:
        return None
    cos_EE = cosine_matrix(gram_EE)
    i, j = torch.triu_indices(E, E, offset=1)
    return cos_EE[i, j].mean().item()


# columns of the flattened experts turned into float64 at a time: 8 experts x 2^21 columns = 128 MB, where a
# whole projection of a 2B model's layer would be a 1 GB float64 copy
GRAM_COLUMNS = 2**21


def gram_matrix(parts: list[torch.Tensor]) -> torch.Tensor:
    """sum over parts of P P^T in float64, a block of columns at a time: no float64 copy of whole experts."""
    E = parts[0].shape[0]
    gram = torch.zeros(E, E, dtype=torch.float64, device=parts[0].device)   # on the GPU with --device cuda
    scratch = _scratch(parts, E)
    for part in parts:
        for term in _part_gram(part, E, scratch):
            gram += term
    return gram


def _scratch(parts: list[torch.Tensor], E: int) -> torch.Tensor:
    """One float64 buffer for every block of columns of `parts`: a fresh float64 copy of each block (tens of MB
    at 135M) came from new pages, and the kernel's zeroing of them took most of the Grams' time."""
    columns = max(part.reshape(E, -1).shape[1] for part in parts)
    return torch.empty(E * min(columns, GRAM_COLUMNS), dtype=torch.float64, device=parts[0].device)


def _part_gram(part: torch.Tensor, E: int, scratch: torch.Tensor):
    """P P^T of one part, as the terms `gram_matrix` adds for it, in the same order; each block of columns is
    turned into float64 in `scratch`, which a term no longer needs once the next is asked for."""
    flat = part.reshape(E, -1)          # a view for contiguous and for expanded (copy-upcycled) experts
    if E > 1 and flat.stride(0) == 0:   # one tensor expanded E times: every entry is its squared norm
        yield sum(torch.dot(b, b) for b in (c.double() for c in flat[0].split(GRAM_COLUMNS)))
        return
    for block in flat.split(GRAM_COLUMNS, dim=1):
        p = scratch[:block.numel()].view(block.shape).copy_(block)
        yield p @ p.T


def similarity_and_diversity(experts: FFNWeights) -> tuple[float | None, float | None]:
    """(`expert_similarity`, `diversity`) with each down-projection block's Gram computed once for both: the
    same sums in the same order as the two functions, so the same numbers."""
    parts = [t for t in (experts.w_gate, experts.w_up, experts.w_down) if t is not None]
    E = parts[0].shape[0]
    gram = torch.zeros(E, E, dtype=torch.float64, device=parts[0].device)
    down = torch.zeros(E, E, dtype=torch.float64, device=parts[0].device)
    scratch = _scratch(parts, E)
    for part in parts:
        for term in _part_gram(part, E, scratch):
            gram += term
            if part is experts.w_down:
                down += term
    similarity = _mean_offdiagonal_cosine(down)
    return _mean_offdiagonal_cosine(gram), None if similarity is None else 1.0 - similarity


def mean_pairwise_cosine(vectors_EP: torch.Tensor) -> float | None:
    """Mean cosine similarity over the E(E-1)/2 pairs of rows."""
    return _mean_offdiagonal_cosine(gram_matrix([vectors_EP]))


def expert_similarity(experts: FFNWeights) -> float | None:
    parts = [t for t in (experts.w_gate, experts.w_up, experts.w_down) if t is not None]
    return _mean_offdiagonal_cosine(gram_matrix(parts))


def diversity(experts: FFNWeights) -> float | None:
    similarity = mean_pairwise_cosine(experts.w_down)
    return None if similarity is None else 1.0 - similarity

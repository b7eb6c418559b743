"""Length-bucketed chunks: a batch of texts of different lengths run as a few forwards of near-equal lengths.

An encoder embeds each text on its own (attention never crosses texts), so a batch may be cut into any chunks of
texts and each chunk padded only to its own longest text: the embeddings are the same. Padding one batch of 1,024
short texts to its longest (64 tokens) computes five positions for each real token; sorted by length and cut
well, the same texts need a few percent more positions than real tokens. Each extra chunk is one more forward,
whose fixed cost (kernel launches on a GPU, Python) is counted as `overhead` positions, so the cut is the one that
minimizes

    sum over chunks (rows x width) + overhead x chunks,

found exactly by dynamic programming over the distinct lengths (a cut between two texts of one length never
helps). Shape suffixes: N texts, C chunks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def bucket_plan(lengths: Sequence[int] | torch.Tensor, overhead: float) -> list[torch.Tensor]:
    """The texts' indices, sorted by length (stable), cut into chunks as the module docstring says; each chunk's
    width is its last text's length. `overhead` >= 0; 0 gives one chunk per distinct length."""
    lengths_N = torch.as_tensor(lengths, dtype=torch.long).reshape(-1)
    if lengths_N.numel() == 0:
        return []
    if not overhead >= 0:
        raise ValueError(f"overhead must be >= 0, got {overhead}")
    order_N = torch.sort(lengths_N, stable=True).indices
    if math.isinf(overhead):            # every extra forward too dear: the batch in one, padded to its longest
        return [order_N]
    distinct, counts = torch.unique_consecutive(lengths_N[order_N], return_counts=True)
    widths, ends = distinct.tolist(), torch.cumsum(counts, 0).tolist()
    m = len(widths)
    # best[j]: the least cost of the texts of the first j distinct lengths; cut[j]: where its last chunk starts
    best, cut = [0.0] + [float("inf")] * m, [0] * (m + 1)
    for j in range(1, m + 1):
        rows_end = ends[j - 1]
        for i in range(j):
            cost = best[i] + (rows_end - (ends[i - 1] if i else 0)) * widths[j - 1] + overhead
            if cost < best[j]:
                best[j], cut[j] = cost, i
    bounds, j = [], m
    while j > 0:
        bounds.append((ends[cut[j] - 1] if cut[j] else 0, ends[j - 1]))
        j = cut[j]
    return [order_N[start:end] for start, end in reversed(bounds)]


def positions_computed(lengths: Sequence[int] | torch.Tensor, chunks: list[torch.Tensor]) -> int:
    """Positions a plan computes: each chunk's rows times its longest text."""
    lengths_N = torch.as_tensor(lengths, dtype=torch.long).reshape(-1)
    return sum(len(c) * int(lengths_N[c].max()) for c in chunks)

"""The router rows of grown copies: how a copied expert's tokens are shared out between it and its copies while
top-k stays fixed (Expert Upcycling, arXiv:2604.19835 §3-4: duplicated experts take their source's router
weights, unscaled, so the router reaches them, and continued training breaks their symmetry).

An exact copy of a router row ties with its source on every token, so under top-k the tie decides: with k = 1 the
lower index takes every token and the copy none; a copy whose logits are shifted down (-log n, to share the
source's softmax probability) loses to every unshifted expert and is never chosen. Instead each copy's row is its
source's plus an offset that splits the source's tokens into n + 1 parts of about equal size:

    X          the layer's inputs at the calibration tokens the source expert e takes (top-k), [T_e, D]; mu their
               mean
    V          [D, r] the top r = 16 principal directions of X - mu orthogonal to mu; sigma their spreads over
               all the layer's calibration tokens; Q [r, n] a seeded random orthonormal mix of them
    w_j        = V diag(1/sigma) Q (s_j - s_0) / |s_j - s_0|, then moved along mu so that w_j . x has its median
               over the source's tokens at 0 (the split's threshold at their median, not their mean)
    row_j      = row_e + scale * delta * w_j,  j = 1..n (row_0 = row_e: the source's logits stay as they were)
    delta      the median, over the source's tokens, of how far its selection logit is above the first expert
               the token leaves out; scale 1 under top-k >= 2 (the member that loses a token's split typically
               falls out of its top-k, rather than two members of one group taking two of the token's k slots),
               0.1 under top-1 (no token can take two members; the smallest move splits)

where s_0..s_n are the n + 1 unit vertices of a regular simplex (`simplex_vertices`): the member whose vertex lies
nearest the token's mixed coordinates takes it, a split of e's tokens into n + 1 parts of about equal size. Mixing
several directions keeps any one of them (one that follows the token's position, say) from deciding the split.
Every copy's row differs from its source's, so no grown copy is an exact copy (`core.resize.copy_groups`). A source
with fewer than n + 2 tokens takes its directions from all the layer's calibration tokens.
"""

from __future__ import annotations

from collections import Counter

import torch

from .moe import MoELayer

PRINCIPAL = 16      # the source's principal directions the split mixes
# the offset's size on a typical token, in units of delta: under top-k >= 2 delta itself, so the member that loses
# a token's split typically falls out of its top-k (else a token leading with the expert takes two of its members
# among its k, crowding out its other choice); under top-1 no token can take two members, and a tenth of delta
# splits the tokens while moving the logits least (measured in docs/expert-count.md)
SCALE_TOP1 = 0.1


def simplex_vertices(n: int) -> torch.Tensor:
    """[n + 1, n] float64: n + 1 unit vectors in R^n, pairwise equally far apart, summing to 0."""
    centered = torch.eye(n + 1, dtype=torch.float64) - 1.0 / (n + 1)
    basis = torch.linalg.svd(centered).Vh[:n]               # the sum-zero subspace's orthonormal basis
    vertices = centered @ basis.T
    return vertices / vertices.norm(dim=1, keepdim=True)


@torch.no_grad()
def copy_row_offsets(layer: MoELayer, x_TD: torch.Tensor, sources: list[int], seed: int = 0) -> torch.Tensor:
    """[len(sources), D] float32: what each copy of `sources` (copy i of `sources[i]`) adds to its source's router
    row (module docstring), from the layer's inputs at the calibration tokens `x_TD` [T, D]; `seed` draws the
    split's directions."""
    D = layer.router.weight.shape[1]
    offsets = torch.zeros(len(sources), D, dtype=torch.float64)
    if x_TD.shape[0] < 2:
        return offsets.float()
    x_TD = x_TD.to(layer.router.weight.device)
    record = layer.route(x_TD)
    k = layer.top_k
    selection_TE = (record.logits_TE.float() + layer.selection_bias.float())
    chosen = selection_TE.sort(dim=1, descending=True).values
    # how far above the first expert left out each token's k-th choice is (and, per source, its own choice)
    first_out_T = chosen[:, k] if layer.num_experts > k else chosen[:, -1] - 1
    gap_T = (chosen[:, k - 1] - first_out_T).double().cpu()
    everyone = x_TD.double().cpu()
    generator = torch.Generator().manual_seed(seed)
    for e, n in Counter(sources).items():
        routed = (record.topk_ids_TK == e).any(dim=1).cpu()
        tokens = routed if int(routed.sum()) >= n + 2 else torch.ones_like(routed)
        X = everyone[tokens]
        mu = X.mean(dim=0)
        unit = mu / mu.norm().clamp_min(1e-12)
        centered = X - mu
        centered = centered - (centered @ unit)[:, None] * unit          # directions orthogonal to the mean
        V = torch.linalg.svd(centered, full_matrices=False).Vh[:PRINCIPAL].T            # [D, r]
        # each direction's spread over all the layer's tokens, not the source's alone: a token far from the
        # source's cloud moves by as much as a typical token, so a copy does not take other experts' tokens
        spread = (everyone @ V).std(dim=0)
        whiten = V / spread.clamp_min(1e-6 * float(spread.max()) + 1e-12)
        # n random orthonormal mixes of the r whitened directions: no single direction (one that tracks the
        # token's position, say) decides the split
        mix = torch.linalg.qr(torch.randn(V.shape[1], n, generator=generator, dtype=torch.float64)).Q
        if mix.shape[1] < n:                                            # fewer directions than copies
            mix = torch.cat([mix, torch.zeros(mix.shape[0], n - mix.shape[1], dtype=mix.dtype)], dim=1)
        # the source's tokens: how far above the first expert left out it is; the other tokens: their k-th choice
        margin_T = (selection_TE[:, e] - first_out_T).double().cpu() if tokens is routed else gap_T
        delta = max(float(margin_T[tokens].median()), 1e-3)
        vertices = simplex_vertices(n)
        along = X @ unit                                   # each token's coordinate along the mean: > 0 for most
        positive = along > 0
        copies = [i for i, source in enumerate(sources) if source == e]
        for j, i in enumerate(copies, start=1):
            step = vertices[j] - vertices[0]
            w = whiten @ (mix @ (step / step.norm()))
            # the split's threshold moved to the median of the source's tokens: w - t * unit, t = median(w.x / u.x),
            # gives w.x - t u.x = u.x (w.x / u.x - t), which changes sign at that median where u.x > 0
            if float(positive.double().mean()) > 0.9:
                w = w - float(((X[positive] @ w) / along[positive]).median()) * unit
            offsets[i] = (SCALE_TOP1 if k == 1 else 1.0) * delta * w
    return offsets.float()

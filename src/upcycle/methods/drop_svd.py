"""`drop_svd`: structured (spectral) drop-upcycling (Cluster-aware Upcycling, CVPR 2026, arXiv 2604.13508,
supplementary; docs/methods.md §2.4).

For every expert and every weight matrix W (w_up, w_gate, w_down), with W = U S V^T:

    W_i = U_keep S_keep V_keep^T + Q_i S_low P_i^T

where the last n_low = round(fraction * r) singular triplets (r = min(rows, cols)) are the "low" part and
Q_i, P_i are fresh random orthonormal bases of the orthogonal complements of U_keep and V_keep. The dominant
subspace and the whole spectrum are preserved; only the directions of the weak part change.

Choices where the paper is silent (stated here so they can be cited):
- The low part is counted by number of singular values, n_low = round(fraction * r) (Python rounding), not by
  spectral energy.
- Both the left AND the right singular vectors of the low part are redrawn (independently).
- The random bases: a standard Gaussian matrix (float64, from the seeded generator), projected twice onto the
  orthogonal complement of the kept vectors, then the Q factor of its reduced QR. Per expert and matrix the
  draw order is: left basis, then right basis; experts in order 0..E-1, matrices in order up, gate, down;
  the router is drawn last. Every expert gets its own draw (no expert is an exact copy unless fraction = 0).
- The SVD is of the dense matrix (all experts start as copies, so it is computed once), in float64;
  W_i is formed as W + (Q S_low P^T - U_low S_low V_low^T) in float64 and cast back to W's dtype, so
  fraction = 0 returns the dense weights bit for bit.
- Biases are copied. The router is `random_router` (N(0, router_std^2)), as in Sparse Upcycling.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Annotated

import torch

from ..config import Range
from ..core.ffn import FFNWeights
from .registry import ExpertInit, LayerInputs, random_router, register

MATRICES = ("w_up", "w_gate", "w_down")


def orthonormal_complement(basis: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
    """n random orthonormal columns orthogonal to the orthonormal columns of `basis` [m, k] (float64)."""
    m = basis.shape[0]
    g = torch.randn(m, n, generator=generator, dtype=torch.float64).to(basis.device)
    for _ in range(2):          # re-orthogonalize once more: Gram-Schmidt twice is enough
        g = g - basis @ (basis.T @ g)
    return torch.linalg.qr(g, mode="reduced").Q


@dataclass(frozen=True)
class DropSvdArgs:
    """The arguments of `drop_svd` (`--set method_args.NAME=VALUE`): their types, allowed values and defaults."""

    fraction: Annotated[float, Range(0, 1)] = 0.25
    router_std: float = 0.02


@register("drop_svd", paper="Cluster-aware Upcycling (CVPR 2026, arXiv:2604.13508), supplementary",
          preserves_function=lambda args, normalize_topk, dropless: args["fraction"] == 0 and normalize_topk
          and dropless, no_deltas=None)
def drop_svd(ffn: FFNWeights, layer: LayerInputs, args: DropSvdArgs) -> ExpertInit:
    """Copies of the dense FFN whose weakest `fraction` of singular vectors are redrawn per expert."""
    num_experts, generator = layer.num_experts, layer.generator
    fraction, router_std = args.fraction, args.router_std
    sources = {n: t for n, t in ffn.tensors().items() if n in MATRICES}
    plans = {}
    for name, w in sources.items():
        w64 = w.detach().to(torch.float64)
        U, S, Vh = torch.linalg.svd(w64, full_matrices=False)
        n_low = round(fraction * S.numel())
        keep = S.numel() - n_low
        low = (U[:, keep:] * S[keep:]) @ Vh[keep:]
        plans[name] = (w64, U[:, :keep], Vh[:keep].T, S[keep:], low, n_low)
    stacks = {n: [] for n in sources}
    for _ in range(num_experts):
        for name, w in sources.items():
            w64, U_keep, V_keep, s_low, low, n_low = plans[name]
            if n_low == 0:
                stacks[name].append(w.clone())
                continue
            Q = orthonormal_complement(U_keep, n_low, generator)
            P = orthonormal_complement(V_keep, n_low, generator)
            stacks[name].append((w64 - low + (Q * s_low) @ P.T).to(w.dtype))
    experts = replace(ffn.expand(num_experts), **{n: torch.stack(s) for n, s in stacks.items()})
    router = random_router(num_experts, ffn.hidden_size, router_std, generator)
    return ExpertInit(experts=experts, router_ED=router,
                      info={"replaced_singular_vectors": {n: p[-1] for n, p in plans.items()}})

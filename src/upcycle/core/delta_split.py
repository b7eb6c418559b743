"""Full experts split into one shared base plus rank-R deltas (DeRS, CVPR 2025, §3: upcycled experts stay close to
their mean, so each expert's difference from a base is kept in low rank): what `upcycle compress` will store.

For each matrix (gate, up, down) and each expert e, the residual W_e − W_base is cut to its best rank-R approximation
by truncated SVD (Eckart–Young): A_e = U_R diag(S_R), B_e = V_Rᵀ, so that W_base + A_e B_e is the closest rank-R
change of the base to W_e in the Frobenius norm. The energy kept, Σ_{i≤R} s_i² / Σ_i s_i², says how much of each
expert's difference survives (1 when it had none). The base is the experts' mean, or the dense FFN when it is known
(an upcycled model's source). Experts equal to the base (a copy) split without an SVD: zero A, and a B drawn from a
fixed seed so that training can move A.

Biases have no per-expert delta in `delta_experts.DeltaExperts`: the base takes the experts' mean bias, and
`bias_drift` reports how far any expert's bias was from it (0 for the experts of a copy, whose biases never part
unless trained).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .ffn import FFNWeights

MATRICES = ("w_gate", "w_up", "w_down")


@dataclass(frozen=True)
class DeltaSplit:
    """A stack of experts as base + low-rank deltas (module docstring)."""

    base: FFNWeights                                        # one FFN
    deltas: dict[str, tuple[torch.Tensor, torch.Tensor]]   # matrix -> (A [E, rows, R], B [E, R, cols])
    energy: dict[str, torch.Tensor]                          # matrix -> [E] the share of the residual kept
    bias_drift: float                                        # the largest |expert bias − base bias|


def _start_factor(num_experts: int, rank: int, cols: int, like: torch.Tensor) -> torch.Tensor:
    """B for a zero delta (A = 0): drawn as `delta_experts` draws a new layer's B (uniform, bound 1/sqrt(cols)), from
    a fixed seed so that the same experts split to the same bytes. A nonzero B lets A's gradient through."""
    generator = torch.Generator().manual_seed(rank * 1_000_003 + cols)
    bound = 1.0 / cols ** 0.5
    return (torch.rand(num_experts, rank, cols, generator=generator, dtype=torch.float64) * 2 - 1).mul(bound).to(
        device=like.device, dtype=like.dtype)


def split_experts(experts: FFNWeights, rank: int, base: FFNWeights | None = None) -> DeltaSplit:
    """`experts` (stacked, E of them) as `base` (default: their mean) plus rank-`rank` deltas per matrix."""
    if not experts.stacked:
        raise ValueError("split_experts takes stacked experts [E, ...]")
    limit = min(experts.hidden_size, experts.intermediate_size)
    if not 1 <= rank <= limit:
        raise ValueError(f"rank must be between 1 and min(D, F) = {limit}, got {rank}")
    if base is None:
        base = experts.map(lambda t: t.mean(0))
    elif base.stacked or base.gated != experts.gated or base.w_down.shape != experts.w_down.shape[1:]:
        raise ValueError("the base must be one FFN of the experts' shape")
    deltas, energy = {}, {}
    for name in MATRICES:
        w = getattr(experts, name)
        if w is None:
            continue
        residual = (w - getattr(base, name).unsqueeze(0)).double()
        if not residual.any():          # a copy's experts: nothing to decompose (an SVD of a large zero is slow)
            deltas[name] = (w.new_zeros(*w.shape[:2], rank), _start_factor(w.shape[0], rank, w.shape[2], w))
            energy[name] = torch.ones(w.shape[0])
            continue
        U, S, Vh = torch.linalg.svd(residual, full_matrices=False)
        a = (U[..., :rank] * S[..., None, :rank]).to(w.dtype)
        b = Vh[..., :rank, :].to(w.dtype)
        deltas[name] = (a, b)
        total = S.pow(2).sum(-1)
        energy[name] = torch.where(total > 0, S[..., :rank].pow(2).sum(-1) / total.clamp_min(1e-300),
                                   torch.ones_like(total)).float()
    drift = 0.0
    for name in ("b_gate", "b_up", "b_down"):
        bias = getattr(experts, name)
        if bias is not None:
            drift = max(drift, float((bias - getattr(base, name).unsqueeze(0)).abs().max()))
    return DeltaSplit(base, deltas, energy, drift)

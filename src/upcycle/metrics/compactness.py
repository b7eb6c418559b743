"""Relative compactness of the experts' output subspaces (docs/methods.md §5; the Cluster-aware Upcycling paper's RC):

    RC = Tr(Σ_W Σ_B^†)

Σ_W is the within-expert covariance of the token representations each expert produces, pooled over experts
(every token-slot routed to expert e contributes E_e(x_t), centred on expert e's mean output); Σ_B is the
covariance of the experts' mean outputs (each expert one point, unweighted); † is the Moore-Penrose
pseudo-inverse (Σ_B has rank at most E - 1). It is the within-class scatter measured in units of the
between-class scatter, Fisher's ratio turned around: lower = tighter, better separated expert subspaces.
Experts with no token have no mean and are left out; with fewer than two experts in use RC is undefined (None).
"""

from __future__ import annotations

import torch

# eigenvalues of Σ_B below this fraction of its largest are treated as zero by the pseudo-inverse (float64
# rounding of a rank-(E-1) matrix leaves values around 1e-16 of the largest in the null directions)
PINV_RCOND = 1e-10


@torch.no_grad()
def relative_compactness(features_ND: torch.Tensor, groups_N: torch.Tensor) -> float | None:
    """RC of N representations `features_ND` labelled by `groups_N` (the expert that produced each)."""
    x = features_ND.double()
    labels, groups_N = torch.unique(groups_N, return_inverse=True)
    G = len(labels)
    if G < 2:
        return None
    counts_G = torch.bincount(groups_N, minlength=G).double()
    sums_GD = torch.zeros(G, x.shape[1], dtype=torch.float64, device=x.device).index_add_(0, groups_N, x)
    means_GD = sums_GD / counts_G[:, None]
    centred = x - means_GD[groups_N]
    sigma_w = centred.T @ centred / x.shape[0]
    between = means_GD - means_GD.mean(0)
    sigma_b = between.T @ between / G
    # Tr(Σ_W Σ_B^†) through Σ_B's eigenvectors U with eigenvalues λ > 0: Σ_i u_i^T Σ_W u_i / λ_i
    lam, U = torch.linalg.eigh(sigma_b)
    keep = lam > PINV_RCOND * lam.max().clamp_min(1e-300)
    if not keep.any():
        return None
    U, lam = U[:, keep], lam[keep]
    return float(((U.T @ sigma_w @ U).diagonal() / lam).sum())

"""`cluster`: Cluster-aware Upcycling (CVPR 2026, arXiv 2604.13508; docs/methods.md §2.5).

From the layer's calibration activations X ([N, D], one row per real token):
  1. optional PCA of X to D / pca_factor dimensions (paper: factor 8), centered;
  2. spherical k-means with E clusters (k-means++, restarts, empty clusters repaired): centroids mu_i, and the
     partition X_1..X_E, each token in the cluster of its most similar final centroid;
  3. expert i: data-aware truncated SVD on X_i of each first linear layer (a gated FFN's W_gate and W_up, which
     both read x; a plain MLP's W_up): S_i S_i^T = X_i^T X_i (Cholesky, damped when singular), W S_i = U Sigma V^T,
     rank r_i = smallest r keeping tau of the energy but >= min_rank_fraction of the full rank,
     W~_i = U_r Sigma_r V_r^T S_i^{-1}; so ||W X_i - W~_i X_i||_F^2 = sum_{j>r_i} sigma_j^2. W_down is copied;
  4. router rows = unit centroids. With PCA the centroid mu_i maps back to w_i = P^T mu_i, and centering gives
     the bias -mu_i^T P m: kept when `router_bias` is true (the router then reproduces the clusters exactly),
     otherwise dropped and its size reported (the stock Qwen2-MoE/Mixtral routers have no bias).

Choices where the paper is silent:
- The partition is recomputed with the final centroids (Lloyd stops after a centroid update), so without PCA
  the router's top-1 expert is each calibration token's cluster for every token. Should that recomputation
  empty a cluster (it has not happened in practice), the repaired k-means partition is kept instead and the
  report's router_cluster_agreement shows the difference.
- Biases are copied (the data-aware SVD preserves W x; a bias is added after it unchanged).
- Everything but k-means (float32) runs in float64 and is cast back to the weights' dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Annotated

import torch
import torch.nn.functional as F

from ..config import Range
from ..core.ffn import FFNWeights
from ..errors import UpcycleError
from .linalg import pca, spherical_kmeans, truncate_whitened, whitening_factor
from .registry import ExpertInit, LayerInputs, LayerLayout, register


@dataclass(frozen=True)
class ClusterArgs:
    """The arguments of `cluster` (`--set method_args.NAME=VALUE`): their types, allowed values and defaults."""

    tau: Annotated[float, Range(0, 1, low_open=True)] = 0.95
    min_rank_fraction: Annotated[float, Range(0, 1)] = 0.5
    pca_factor: Annotated[int, Range(1)] = 1
    router_bias: bool = False
    restarts: Annotated[int, Range(1)] = 3
    iters: Annotated[int, Range(1)] = 50
    damping: Annotated[float, Range(0)] = 0.0


@register("cluster", paper="Cluster-aware Upcycling (CVPR 2026, arXiv 2604.13508)", needs_calibration=True,
          layout=lambda width, args: LayerLayout(width, router_bias=args["pca_factor"] > 1 and args["router_bias"]),
          no_deltas="its experts are truncated SVDs of the dense FFN, each kept to its cluster's directions: each "
                    "differs from the dense FFN by most of the FFN's rank, not by a low-rank change")
def cluster(ffn: FFNWeights, layer: LayerInputs, args: ClusterArgs) -> ExpertInit:
    """Experts = per-cluster data-aware truncated SVDs of the FFN's input layers; router = k-means centroids."""
    num_experts, generator, activations = layer.num_experts, layer.generator, layer.activations
    tau, min_rank_fraction, pca_factor = args.tau, args.min_rank_fraction, args.pca_factor
    router_bias, restarts, iters, damping = args.router_bias, args.restarts, args.iters, args.damping
    E = num_experts
    if activations is None:
        raise UpcycleError("cluster: needs the layer's calibration activations (none were given)")
    X_ND = activations
    if X_ND.dim() != 2 or X_ND.shape[1] != ffn.hidden_size:
        raise UpcycleError(f"cluster: activations must be [tokens, {ffn.hidden_size}], got {tuple(X_ND.shape)}")
    N, D = X_ND.shape
    if N < E:
        raise UpcycleError(f"cluster: {N} calibration tokens cannot form {E} clusters; give more calibration "
                           f"data (calibration.tokens) or fewer experts")
    if pca_factor > D:          # >= 1 is declared; the hidden size is known only here
        raise UpcycleError(f"cluster: pca_factor must be in [1, {D}] (the hidden size), got {pca_factor}")
    if not torch.isfinite(X_ND).all():
        raise UpcycleError("cluster: calibration activations contain NaN or inf")
    X_ND = X_ND.to(device=ffn.w_up.device, dtype=torch.float32)

    # 1-2: cluster (in PCA coordinates when asked)
    proj = pca(X_ND, D // pca_factor) if pca_factor > 1 else None
    Z_Nd = proj.project(X_ND).float() if proj is not None else X_ND
    if bool((torch.linalg.vector_norm(Z_Nd, dim=1) == 0).any()):
        raise UpcycleError("cluster: a calibration token is the zero vector (after PCA centering): its cosine to "
                           "a centroid is undefined")
    km = spherical_kmeans(Z_Nd, E, generator=generator, restarts=restarts, iters=iters)
    clusters_N = F.linear(Z_Nd, km.centroids_KD).argmax(1)
    sizes = torch.bincount(clusters_N, minlength=E)
    recomputed = True
    if bool((sizes == 0).any()):
        clusters_N, recomputed = km.assign_N, False
        sizes = torch.bincount(clusters_N, minlength=E)

    # 4: router
    if proj is None:
        router_ED, bias_E, dropped = km.centroids_KD.clone(), None, 0.0
    else:
        P_dD = proj.components_dD.double()
        router_ED = (km.centroids_KD.double() @ P_dD).float()
        centering_E = -(km.centroids_KD.double() @ (P_dD @ proj.mean_D.double())).float()
        bias_E, dropped = (centering_E, 0.0) if router_bias else (None, float(centering_E.abs().max()))

    # 3: experts
    names = ("w_gate", "w_up") if ffn.gated else ("w_up",)
    full_rank = min(ffn.intermediate_size, D)
    min_rank = max(1, math.ceil(min_rank_fraction * full_rank))
    # written expert by expert into the stacked tensors: a list then torch.stack would hold every expert twice
    truncated = {name: getattr(ffn, name).new_empty(E, *getattr(ffn, name).shape) for name in names}
    ranks = {name.removeprefix("w_"): [] for name in names}
    energy = {name.removeprefix("w_"): [] for name in names}
    dampings = []
    # W^T W in float64 once per matrix: every cluster's truncation of that matrix reads it
    wtw = {name: (w := getattr(ffn, name).double()).T @ w for name in names}
    for i in range(E):
        X_i = X_ND[clusters_N == i].double()
        S_DD, lam = whitening_factor(X_i.T @ X_i, damping=damping)
        dampings.append(lam)
        for name in names:
            result = truncate_whitened(getattr(ffn, name), S_DD, lam, tau=tau, min_rank=min_rank,
                                       wtw_DD=wtw[name])
            truncated[name][i] = result.W_approx
            ranks[name.removeprefix("w_")].append(result.rank)
            energy[name.removeprefix("w_")].append(result.retained_energy)
    experts = replace(ffn.expand(E), **truncated)
    info = {"cluster_sizes": sizes.tolist(), "ranks": ranks, "full_rank": full_rank, "retained_energy": energy,
            "damping": dampings, "damped_clusters": sum(lam > 0 for lam in dampings),
            "kmeans": {"objective": km.objective, "iters": km.iters, "repaired_empty_clusters": km.repaired,
                       "restarts": restarts, "partition": "final centroids" if recomputed else "k-means"},
            "pca_dim": proj.components_dD.shape[0] if proj is not None else None,
            "pca_bias_dropped_max_abs": dropped if proj is not None else None, "calibration_tokens": N}
    return ExpertInit(experts=experts, router_ED=router_ED, router_bias_E=bias_E, info=info,
                      token_clusters=clusters_N)

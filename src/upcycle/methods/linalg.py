"""Linear algebra behind Cluster-aware Upcycling (arXiv 2604.13508, steps 2-4; docs/methods.md §2.5).

  pca                   step 2: optional dimension reduction of the calibration activations before clustering.
  spherical_kmeans      step 3: spherical k-means (Dhillon & Modha 2001, "Concept decompositions for large sparse
                        text data using clustering") on l2-normalized activations: maximize
                        sum_j max_i mu_i^T x_j with ||mu_i|| = 1, seeded by k-means++ (Arthur & Vassilvitskii 2007,
                        "k-means++: the advantages of careful seeding") with restarts and empty-cluster repair.
  whitening_factor      step 4: S with S S^T = X X^T (Cholesky, damped when X X^T is singular).
  truncated_svd_rank    step 4: smallest r with sum_{j<=r} s_j^2 / sum_j s_j^2 >= tau, floored at half the rank.
  data_aware_truncation step 4: SVD W S = U Sigma V^T, W~ = U_r Sigma_r V_r^T S^{-1}, so that
                        ||W X - W~ X||_F^2 = sum_{j>r} sigma_j^2 (exact when no damping was needed); the SVD
                        is taken as the eigendecomposition of (W S)^T (W S), about twice as fast on CPU.

Pure torch; every function runs on its input's device. Randomness is drawn only from the caller's (CPU)
torch.Generator, so a seed fixes the result. Shape suffixes: N points, D width, K clusters, F output width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# --------------------------------------------------------------------------------------------- k-means


@dataclass(frozen=True)
class KMeansResult:
    centroids_KD: torch.Tensor   # unit-norm float32 centroids
    assign_N: torch.Tensor       # long, the cluster of each point (no cluster is empty)
    objective: float             # mean cosine of each point to its assigned centroid
    iters: int                   # Lloyd iterations run by the kept restart
    repaired: int                # empty clusters repaired during the kept restart


def _points(x_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x float32, 1/||x_n||). The points are not normalized into a copy: cosine and argmax only need the
    inverse norms, and skipping the copy keeps memory at the input's size (400 MB for N=131072, D=768)."""
    if x_ND.dim() != 2:
        raise ValueError(f"expected a 2-D [N, D] tensor of points, got shape {tuple(x_ND.shape)}")
    x_ND = x_ND.float()
    norms_N = torch.linalg.vector_norm(x_ND, dim=1)
    if not torch.isfinite(norms_N).all():
        # a NaN/inf entry makes its row's norm NaN/inf; a finite row can also overflow float32 when squared
        if not torch.isfinite(x_ND).all():
            raise ValueError("points contain NaN or inf")
        norms_N = torch.linalg.vector_norm(x_ND, dim=1, dtype=torch.float64).float()
    zero = int((norms_N == 0).sum())
    if zero:
        raise ValueError(f"{zero} point(s) are zero vectors: their direction (cosine) is undefined")
    return x_ND, norms_N.reciprocal()


def _default_batch(k: int) -> int:
    # Rows per chunk of x: the [batch, K] similarity and weight blocks stay <= 2^21 floats for large K; 16384
    # rows amortize the per-chunk overhead (measured on CPU: 4096 -> 16384 rows is up to 2x faster under load).
    return max(256, min(16384, (1 << 21) // max(k, 1)))


def _assign(x_ND, inv_N, c_KD, assign_N, cos_N, sims_BK, sums_KD=None, weights_BK=None) -> None:
    """assign_N, cos_N <- argmax / max over clusters of cos(x, c), chunked over N in sims_BK's rows (the
    preallocated [min(batch, N), K] buffer).
    With sums_KD, also add each cluster's normalized points, sum_j x_j / ||x_j||, in the same pass over x, as a
    matmul with a one-hot matrix weighted by 1/||x_j|| (index_add_ was up to 30x slower with 2 CPU threads)."""
    batch = max(sims_BK.shape[0], 1)        # N = 0: no chunk
    for start in range(0, x_ND.shape[0], batch):
        stop = min(start + batch, x_ND.shape[0])
        xc, sims, a = x_ND[start:stop], sims_BK[: stop - start], assign_N[start:stop]
        torch.matmul(xc, c_KD.T, out=sims)
        torch.max(sims, dim=1, out=(cos_N[start:stop], a))   # argmax is unchanged by the positive 1/||x||
        if sums_KD is not None:
            w = weights_BK[: stop - start].zero_().scatter_(1, a[:, None], inv_N[start:stop, None])
            sums_KD.addmm_(w.T, xc)
    cos_N.mul_(inv_N)


def spherical_assign(x_ND: torch.Tensor, centroids_KD: torch.Tensor, *,
                     batch: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(assign_N, cos_N): each point's most similar centroid by cosine, and that cosine (centroids are normalized
    here too). The mean of cos_N is the spherical k-means objective of those centroids."""
    x_ND, inv_N = _points(x_ND)
    c_KD, c_inv = _points(centroids_KD.to(x_ND.device))
    c_KD = c_KD * c_inv[:, None]
    k, N = c_KD.shape[0], x_ND.shape[0]
    assign_N = torch.empty(N, dtype=torch.long, device=x_ND.device)
    cos_N = torch.empty(N, dtype=torch.float32, device=x_ND.device)
    batch = batch or _default_batch(k)
    _assign(x_ND, inv_N, c_KD, assign_N, cos_N, x_ND.new_empty(min(batch, N), k))
    return assign_N, cos_N


def _kmeanspp(x_ND: torch.Tensor, inv_N: torch.Tensor, k: int, generator: torch.Generator) -> torch.Tensor:
    """k-means++ seeding. For unit vectors ||x - c||^2 = 2 (1 - cos), so sampling proportional to the cosine
    distance 1 - cos is exactly k-means++'s D(x)^2 weighting."""
    N = x_ND.shape[0]

    def distance(i: int) -> torch.Tensor:
        return (1.0 - (x_ND @ x_ND[i]) * inv_N * inv_N[i]).clamp_min_(0.0)

    picks = [int(torch.randint(N, (1,), generator=generator))]
    dist_N = distance(picks[0])
    for _ in range(1, k):
        u = float(torch.rand((), generator=generator, dtype=torch.float64))
        cum_N = torch.cumsum(dist_N, 0, dtype=torch.float64)
        total = float(cum_N[-1])
        if total > 0:
            # first index whose cumulative weight exceeds u * total: zero-weight points (chosen ones) never win
            target = torch.tensor([u * total], dtype=torch.float64, device=cum_N.device)
            pick = min(int(torch.searchsorted(cum_N, target, right=True)), N - 1)
        else:
            # every point coincides with a chosen centre (duplicates): take the first unchosen index; the
            # duplicate centroid empties a cluster, which the Lloyd loop then repairs
            chosen = set(picks)
            pick = next(i for i in range(N) if i not in chosen)
        picks.append(pick)
        torch.minimum(dist_N, distance(pick), out=dist_N)
    return x_ND[picks] * inv_N[picks, None]


def _repair(assign_N: torch.Tensor, cos_N: torch.Tensor, k: int) -> int:
    """Give each empty cluster the point least similar to its own centroid, taken from a cluster that keeps at
    least one point. Deterministic: candidates in order of increasing similarity, ties by index (stable sort)."""
    counts_K = torch.bincount(assign_N, minlength=k)
    empty = (counts_K == 0).nonzero().flatten().tolist()
    if not empty:
        return 0
    counts = counts_K.tolist()
    # a candidate is skipped only when its cluster is a singleton, so len(empty) + k candidates always suffice
    order = torch.argsort(cos_N, stable=True)[: len(empty) + k].tolist()
    owners = assign_N[order].tolist()
    pos = 0
    for e in empty:
        while counts[owners[pos]] <= 1:
            pos += 1
        i, j = order[pos], owners[pos]
        counts[j] -= 1
        counts[e] += 1
        assign_N[i] = e
        pos += 1
    return len(empty)


def _lloyd(x_ND, inv_N, c_KD, iters, tol, batch):
    """Lloyd iterations from c_KD; returns (centroids, assign, objective, iters run, repairs).

    The cluster sums S_i = sum_{j in i} x_j / ||x_j|| are kept in float64 and updated incrementally: once few
    points change cluster (the usual case after the first steps), a step costs one pass over x (the similarity
    matmul) plus a gather of the moved rows, instead of a second full pass to re-accumulate every cluster."""
    N, D = x_ND.shape
    k = c_KD.shape[0]
    assign_N = torch.empty(N, dtype=torch.long, device=x_ND.device)
    prev_N = torch.full((N,), -1, dtype=torch.long, device=x_ND.device)
    basis_N = torch.empty(N, dtype=torch.long, device=x_ND.device)
    cos_N = torch.empty(N, dtype=torch.float32, device=x_ND.device)
    sims_BK = x_ND.new_empty(min(batch, N), k)
    weights_BK = x_ND.new_empty(min(batch, N), k)
    sums32_KD = x_ND.new_empty(k, D)
    sums_KD = None
    objective, repaired, run, changed = -math.inf, 0, 0, N
    while run < iters:
        run += 1
        # a full re-accumulation (fused into the assignment pass) when many points moved: beyond ~N/8 moved rows,
        # gathering them costs about as much as the pass itself; it also resets any float drift of the updates
        if changed > N // 8:
            _assign(x_ND, inv_N, c_KD, assign_N, cos_N, sims_BK, sums32_KD.zero_(), weights_BK)
            sums_KD = sums32_KD.double()
            basis_N.copy_(assign_N)   # the assignment sums_KD now represents
        else:
            _assign(x_ND, inv_N, c_KD, assign_N, cos_N, sims_BK)
            basis_N.copy_(prev_N)
        repaired += _repair(assign_N, cos_N, k)
        moved = (assign_N != basis_N).nonzero().flatten()
        for start in range(0, moved.numel(), batch):   # move each such point's x / ||x|| between cluster sums
            idx = moved[start:start + batch]
            xs = (x_ND[idx] * inv_N[idx, None]).double()
            sums_KD.index_add_(0, assign_N[idx], xs).index_add_(0, basis_N[idx], xs, alpha=-1)
        norms_K = torch.linalg.vector_norm(sums_KD, dim=1)
        # a cluster's normalized mean maximizes the summed cosine of its points; a cluster whose points cancel
        # exactly (sum 0) has every direction optimal, so it keeps its previous centroid
        c_KD = torch.where(norms_K[:, None] > 0, (sums_KD / norms_K.clamp_min(1e-300)[:, None]).float(), c_KD)
        # sum_{j in cluster i} x_j . c_i = ||S_i|| when c_i = S_i / ||S_i||: the objective without another pass
        new_objective = float(norms_K.sum()) / N
        changed = int((assign_N != prev_N).sum())
        # tol < 0 runs all `iters` (fixed-work comparisons); otherwise stop at a fixed point or a small gain
        converged = tol >= 0 and (changed == 0 or new_objective - objective <= tol)
        objective = new_objective
        if converged:
            break
        prev_N.copy_(assign_N)
    return c_KD, assign_N, objective, run, repaired


def spherical_kmeans(x_ND: torch.Tensor, k: int, *, generator: torch.Generator, restarts: int = 3, iters: int = 50,
                     tol: float = 1e-6, batch: int | None = None) -> KMeansResult:
    """Spherical k-means of the rows of x_ND (normalized first) into k clusters; the best objective of `restarts`
    k-means++ seedings, each drawn from `generator`. A restart stops when its assignments repeat or the mean cosine
    gains <= tol (tol < 0: runs all `iters`). `batch` rows of x are processed at a time (default: see
    `_default_batch`); float32 input is not copied."""
    x_ND, inv_N = _points(x_ND)
    N = x_ND.shape[0]
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if k > N:
        raise ValueError(f"k={k} clusters but only {N} points: need at least as many points as clusters")
    if restarts < 1 or iters < 1:
        raise ValueError(f"restarts and iters must be >= 1, got restarts={restarts}, iters={iters}")
    batch = batch or _default_batch(k)
    best = None
    for _ in range(restarts):
        seeds_KD = _kmeanspp(x_ND, inv_N, k, generator)
        c_KD, assign_N, objective, its, repaired = _lloyd(x_ND, inv_N, seeds_KD, iters, tol, batch)
        if best is None or objective > best.objective:   # strict: the earliest restart wins ties
            best = KMeansResult(c_KD, assign_N, objective, its, repaired)
    return best


# ------------------------------------------------------------------------------------ whitening and SVD


def whitening_factor(gram_DD: torch.Tensor, *, damping: float = 0.0) -> tuple[torch.Tensor, float]:
    """(S_DD, lam): lower-triangular float64 S with S S^T = G + lam I (Cholesky). lam = `damping` (0.0 by
    default, so S S^T = G exactly) if Cholesky of G + damping I succeeds with every pivot above 1e-12 of G's
    largest diagonal entry; otherwise lam starts at max(damping, 1e-6 mean(diag G)) and doubles until it does.
    Callers report lam: with lam > 0 the data-aware SVD's error identity holds for G + lam I, not for G."""
    if gram_DD.dim() != 2 or gram_DD.shape[0] != gram_DD.shape[1]:
        raise ValueError(f"expected a square [D, D] Gram matrix, got shape {tuple(gram_DD.shape)}")
    if damping < 0:
        raise ValueError(f"damping must be >= 0, got {damping}")
    G = gram_DD.double()
    if not torch.isfinite(G).all():
        raise ValueError("Gram matrix contains NaN or inf")
    G = 0.5 * (G + G.T)   # Cholesky reads one triangle; symmetrize so rounding in X X^T cannot bias it
    eye = torch.eye(G.shape[0], dtype=G.dtype, device=G.device)
    scale = float(G.diagonal().abs().max()) if G.numel() else 0.0

    def factor(M):
        # Rounding can let Cholesky "succeed" on a singular matrix with pivots ~1e-16 of the scale; S^{-1} would
        # then amplify noise by ~1e8. Such a factor counts as a failure.
        S, info = torch.linalg.cholesky_ex(M)
        ok = int(info) == 0 and float(S.diagonal().min()) ** 2 > 1e-12 * scale
        return S, ok

    S, ok = factor(G + damping * eye if damping > 0 else G)
    if ok:
        return S, float(damping)
    mean_diag = float(G.diagonal().mean())
    lam = max(damping, 1e-6 * mean_diag if mean_diag > 0 else 1e-12)
    for _ in range(40):
        S, ok = factor(G + lam * eye)
        if ok:
            return S, lam
        lam *= 2
    raise ValueError(f"Gram matrix is not positive semi-definite: Cholesky failed even with damping {lam / 2:.3g}")


def truncated_svd_rank(s: torch.Tensor, tau: float = 0.95, min_rank: int | None = None) -> int:
    """Smallest r with sum_{j<=r} s_j^2 / sum_j s_j^2 >= tau for descending singular values s, clamped to
    [min_rank, len(s)]; min_rank defaults to ceil(len(s) / 2) (docs/methods.md §2.5: never below half the full rank)."""
    if s.dim() != 1 or s.numel() == 0:
        raise ValueError(f"expected a non-empty 1-D tensor of singular values, got shape {tuple(s.shape)}")
    if not 0 < tau <= 1:
        raise ValueError(f"tau must be in (0, 1], got {tau}")
    n = s.numel()
    floor = math.ceil(n / 2) if min_rank is None else int(min_rank)
    energy = s.double() ** 2
    cum = torch.cumsum(energy, 0)
    total = float(cum[-1])
    if total == 0:
        r = n
    else:
        # count of prefixes still below tau, plus one; tau = 1 may stay below by rounding, hence the clamp
        r = int((cum / total < tau).sum()) + 1
    return max(1, min(n, max(r, floor)))


@dataclass(frozen=True)
class DataAwareSVD:
    W_approx: torch.Tensor   # [F, D] in W's dtype: U_r Sigma_r V_r^T S^{-1}
    rank: int
    retained_energy: float   # sum_{j<=r} sigma_j^2 / sum_j sigma_j^2
    discarded: float         # sum_{j>r} sigma_j^2 = ||(W - W~) S||_F^2 (= ||W X - W~ X||_F^2 when damping == 0)
    damping: float           # lam added to X X^T before Cholesky (0.0 when none was needed)


def data_aware_truncation(W_FD: torch.Tensor, X_DN: torch.Tensor, *, tau: float = 0.95, min_rank: int | None = None,
                          damping: float = 0.0) -> DataAwareSVD:
    """Truncate W so that W X is preserved (not W itself): whiten by S (S S^T = X X^T), keep the top singular
    directions of W S, unwhiten. All in float64; S^{-1} is applied by a triangular solve, never formed."""
    if W_FD.dim() != 2 or X_DN.dim() != 2 or W_FD.shape[1] != X_DN.shape[0]:
        raise ValueError(f"need W [F, D] and X [D, N] with matching D, got {tuple(W_FD.shape)} and "
                         f"{tuple(X_DN.shape)}")
    X = X_DN.to(device=W_FD.device, dtype=torch.float64)
    if not torch.isfinite(X).all():
        raise ValueError("X contains NaN or inf")
    S_DD, lam = whitening_factor(X @ X.T, damping=damping)
    return truncate_whitened(W_FD, S_DD, lam, tau=tau, min_rank=min_rank)


def truncate_whitened(W_FD: torch.Tensor, S_DD: torch.Tensor, damping: float, *, tau: float = 0.95,
                      min_rank: int | None = None, wtw_DD: torch.Tensor | None = None) -> DataAwareSVD:
    """`data_aware_truncation` with the whitening factor (and the damping it needed) already computed, so one
    Cholesky serves every matrix that reads the same X (a gated FFN's gate and up). `wtw_DD` = W^T W in float64
    when the caller has it: it depends on W only, so every cluster's truncation of the same W can share it.

    The SVD of A = W S is taken through the eigendecomposition of the [D, D] matrix A^T A = S^T (W^T W) S:
    eigenvalues sigma_j^2, eigenvectors V, and U_r Sigma_r V_r^T = A V_r V_r^T, so
    W~ = W (S V_r V_r^T S^{-1}). A thin SVD of the [F, D] A costs about twice as much on CPU (measured at
    F=8192, D=2048: 8.6 s against 4.0 s, 3.0 s with W^T W shared); the squared condition number costs nothing
    here, since only the energy of the discarded directions and the span of the kept ones are used, both exact to
    float64 rounding of the largest sigma^2."""
    if W_FD.dim() != 2 or S_DD.shape != (W_FD.shape[1], W_FD.shape[1]):
        raise ValueError(f"need W [F, D] and S [D, D], got {tuple(W_FD.shape)} and {tuple(S_DD.shape)}")
    if not torch.isfinite(W_FD).all():
        raise ValueError("W contains NaN or inf")
    W = W_FD.double()
    S_DD = S_DD.to(device=W.device, dtype=torch.float64)
    if wtw_DD is None:
        wtw_DD = W.T @ W
    B_DD = S_DD.T @ wtw_DD.to(device=W.device, dtype=torch.float64) @ S_DD
    evals, V_DD = torch.linalg.eigh(0.5 * (B_DD + B_DD.T))   # ascending
    # A has min(F, D) singular values; the rest of the D eigenvalues are zero up to rounding
    n = min(W.shape)
    energy = evals.flip(0)[:n].clamp_min(0.0)
    V_Dn = V_DD.flip(1)[:, :n]
    r = truncated_svd_rank(energy.sqrt(), tau, min_rank)
    total = float(energy.sum())
    V_r = V_Dn[:, :r]
    # oblique projector (S V_r)(V_r^T S^{-1}); S^{-1} applied by a triangular solve, never formed
    P_DD = (S_DD @ V_r) @ torch.linalg.solve_triangular(S_DD, V_r.T, upper=False, left=False)
    W_approx = W @ P_DD
    return DataAwareSVD(W_approx=W_approx.to(W_FD.dtype), rank=r,
                        retained_energy=float(energy[:r].sum()) / total if total > 0 else 1.0,
                        discarded=float(energy[r:].sum()), damping=damping)


# -------------------------------------------------------------------------------------------------- PCA


@dataclass(frozen=True)
class PCA:
    mean_D: torch.Tensor
    components_dD: torch.Tensor      # orthonormal rows, by decreasing variance
    explained_variance: torch.Tensor  # [d] variance along each component (denominator N - 1)

    def project(self, x_ND: torch.Tensor) -> torch.Tensor:
        """[N, D] -> [N, d] coordinates in the principal basis."""
        return (x_ND.to(self.mean_D.dtype) - self.mean_D) @ self.components_dD.T

    def reconstruct(self, z_Nd: torch.Tensor) -> torch.Tensor:
        """[N, d] -> [N, D]; exact inverse of `project` when d = D (and a vector x maps back as P^T z + mean)."""
        return z_Nd.to(self.mean_D.dtype) @ self.components_dD + self.mean_D


def pca(x_ND: torch.Tensor, dim: int) -> PCA:
    """Top-`dim` principal components of the rows of x_ND, from the SVD of the centered data in float64.
    Signs are fixed (largest-magnitude entry of each component positive) so the basis is reproducible."""
    if x_ND.dim() != 2:
        raise ValueError(f"expected a 2-D [N, D] tensor, got shape {tuple(x_ND.shape)}")
    N, D = x_ND.shape
    if not 1 <= dim <= min(N, D):
        raise ValueError(f"dim must be in [1, min(N, D)] = [1, {min(N, D)}], got {dim}")
    if not torch.isfinite(x_ND).all():
        raise ValueError("data contains NaN or inf")
    dtype = x_ND.dtype if x_ND.is_floating_point() else torch.float32
    x = x_ND.double()
    mean_D = x.mean(0)
    _, s, Vh = torch.linalg.svd(x - mean_D, full_matrices=False)
    comps = Vh[:dim]
    signs = torch.sign(comps.gather(1, comps.abs().argmax(1, keepdim=True)))
    comps = comps * torch.where(signs == 0, 1.0, signs)
    var = s[:dim] ** 2 / max(N - 1, 1)
    return PCA(mean_D=mean_D.to(dtype), components_dD=comps.to(dtype), explained_variance=var.to(dtype))

"""upcycle.methods.linalg: spherical k-means, whitening, the rank rule, data-aware truncated SVD and PCA
(docs/methods.md §2.5)."""

from __future__ import annotations

import itertools

import pytest
import torch

from upcycle.methods.linalg import (
    data_aware_truncation,
    pca,
    spherical_assign,
    spherical_kmeans,
    truncate_whitened,
    truncated_svd_rank,
    whitening_factor,
)


@pytest.fixture(autouse=True)
def one_thread():
    # These tensors are tiny: with 2+ OpenMP threads on a loaded shared CI machine each op can wait ~10 ms for
    # its thread team (measured: one k-means call 0.95 s vs 8 ms), so run this module single-threaded.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def mixture(n=400, d=16, k=4, noise=0.05, seed=0):
    g = gen(seed)
    centres = torch.nn.functional.normalize(torch.randn(k, d, generator=g), dim=1)
    labels = torch.arange(n) % k
    scale = torch.rand(n, 1, generator=g) * 3 + 0.5   # norms vary: clustering must use directions only
    return (centres[labels] + noise * torch.randn(n, d, generator=g)) * scale, labels


# ------------------------------------------------------------------------------------------------ k-means


def assert_same_partition(assign, labels):
    """A bijection between found and true clusters that maps every point correctly."""
    mapping = {}
    for a, l in zip(assign.tolist(), labels.tolist(), strict=True):
        assert mapping.setdefault(a, l) == l
    assert sorted(mapping.values()) == sorted(set(labels.tolist()))


def test_kmeans_recovers_separated_clusters_up_to_permutation():
    x, labels = mixture()
    res = spherical_kmeans(x, 4, generator=gen(1))
    assert res.centroids_KD.dtype == torch.float32 and res.assign_N.dtype == torch.long
    torch.testing.assert_close(res.centroids_KD.norm(dim=1), torch.ones(4))
    assert_same_partition(res.assign_N, labels)
    # objective = mean cosine of each point to its assigned centroid
    xn = torch.nn.functional.normalize(x, dim=1)
    direct = (xn * res.centroids_KD[res.assign_N]).sum(1).mean()
    assert res.objective == pytest.approx(float(direct), abs=1e-5)
    assert res.objective > 0.9


def test_kmeans_plus_plus_seeds_one_centre_per_separated_cluster():
    # k-means++ picks far points, so one Lloyd step already separates 4 orthogonal tight clusters, for every
    # seed (a same-cluster pick has probability ~1e-3; uniform seeding hits all 4 with probability 4!/4^4 < 10%)
    labels = torch.arange(400) % 4
    x = torch.eye(16)[labels] + 0.01 * torch.randn(400, 16, generator=gen(6))
    for seed in range(5):
        res = spherical_kmeans(x, 4, generator=gen(seed), restarts=1, iters=1, tol=-1.0)
        assert res.iters == 1
        assert_same_partition(res.assign_N, labels)


def test_kmeans_deterministic_for_a_seed():
    x, _ = mixture(n=300, d=8, k=6, noise=0.4, seed=3)
    a = spherical_kmeans(x, 6, generator=gen(7))
    b = spherical_kmeans(x, 6, generator=gen(7))
    assert torch.equal(a.centroids_KD, b.centroids_KD) and torch.equal(a.assign_N, b.assign_N)
    assert a.objective == b.objective and a.iters == b.iters
    c = spherical_kmeans(x, 6, generator=gen(8))   # may differ; must still be a valid clustering
    assert torch.bincount(c.assign_N, minlength=6).min() > 0


def test_kmeans_objective_non_decreasing_in_lloyd_steps_and_restarts():
    x, _ = mixture(n=500, d=8, k=5, noise=0.6, seed=2)
    # same generator seed -> same k-means++ seeds; tol < 0 runs exactly `iters` Lloyd steps
    objectives = [spherical_kmeans(x, 5, generator=gen(0), restarts=1, iters=i, tol=-1.0).objective
                  for i in range(1, 8)]
    assert all(b >= a - 1e-7 for a, b in itertools.pairwise(objectives)), objectives
    assert objectives[-1] > objectives[0]   # the single step from the init is not already optimal here
    one = spherical_kmeans(x, 5, generator=gen(0), restarts=1)
    three = spherical_kmeans(x, 5, generator=gen(0), restarts=3)   # restart 1 draws the same seeds as `one`
    assert three.objective >= one.objective
    # the incrementally updated cluster sums still give the true objective and centroids (normalized means)
    xn = torch.nn.functional.normalize(x, dim=1)
    for res in (three, spherical_kmeans(x, 5, generator=gen(0), restarts=1, iters=30, tol=-1.0)):
        assert res.objective == pytest.approx(float((xn * res.centroids_KD[res.assign_N]).sum(1).mean()), abs=1e-6)
        means = torch.zeros(5, 8).index_add_(0, res.assign_N, xn)
        torch.testing.assert_close(res.centroids_KD, torch.nn.functional.normalize(means, dim=1), atol=1e-5, rtol=0)
    # reassigning to the returned centroids can only improve the returned objective
    _, cos = spherical_assign(x, three.centroids_KD)
    assert float(cos.mean()) >= three.objective - 1e-6


def test_kmeans_repairs_empty_clusters():
    # 3 distinct directions, each 4 times: k-means++ must seed duplicates, whose clusters empty (argmax ties)
    base = torch.nn.functional.normalize(torch.randn(3, 5, generator=gen(4)), dim=1)
    x = base.repeat(4, 1)
    for k in (5, 12):   # k == N included
        res = spherical_kmeans(x, k, generator=gen(0))
        assert res.repaired > 0
        assert torch.bincount(res.assign_N, minlength=k).min() > 0
        assert res.objective == pytest.approx(1.0, abs=1e-6)


def test_kmeans_errors():
    x, _ = mixture(n=10, d=4, k=2)
    for k, match in ((11, "only 10 points"), (0, "k must be >= 1")):
        with pytest.raises(ValueError, match=match):
            spherical_kmeans(x, k, generator=gen())
    bad = x.clone()
    bad[3, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        spherical_kmeans(bad, 2, generator=gen())
    bad[3, 1] = float("inf")
    with pytest.raises(ValueError, match="NaN or inf"):
        spherical_kmeans(bad, 2, generator=gen())
    with pytest.raises(ValueError, match="2-D"):
        spherical_kmeans(x[0], 2, generator=gen())
    zero = x.clone()
    zero[5] = 0
    with pytest.raises(ValueError, match="zero vectors"):
        spherical_kmeans(zero, 2, generator=gen())


# -------------------------------------------------------------------------------------------- whitening


def test_whitening_factor_exact_for_pd_and_damped_for_singular():
    X = torch.randn(8, 50, generator=gen(0), dtype=torch.float64)
    G = X @ X.T
    S, lam = whitening_factor(G)
    assert lam == 0.0 and S.dtype == torch.float64
    assert torch.equal(S, S.tril())
    torch.testing.assert_close(S @ S.T, G, rtol=1e-12, atol=1e-10)

    Xs = torch.randn(8, 3, generator=gen(1), dtype=torch.float64)   # rank 3 < 8: singular Gram
    Gs = Xs @ Xs.T
    Ss, lam = whitening_factor(Gs)
    assert lam >= 1e-6 * float(Gs.diagonal().mean())
    torch.testing.assert_close(Ss @ Ss.T, Gs + lam * torch.eye(8, dtype=torch.float64), rtol=1e-12, atol=1e-10)

    # numerically singular: Cholesky succeeds (as it does by rounding for about half of random rank-deficient
    # Gram matrices), but a pivot of 1e-15 of the scale would make S^{-1} amplify noise 3e7-fold: damped
    tiny = torch.diag(torch.tensor([1.0, 1e-15], dtype=torch.float64))
    assert int(torch.linalg.cholesky_ex(tiny)[1]) == 0 and whitening_factor(tiny)[1] > 0

    _, lam = whitening_factor(G, damping=0.5)   # an explicit damping is applied and reported
    assert lam == 0.5
    with pytest.raises(ValueError, match="not positive semi-definite"):
        whitening_factor(-torch.eye(4))


def test_truncated_svd_rank_rule():
    s = torch.tensor([4.0, 2.0, 1.0, 1.0])   # energies 16, 4, 1, 1 of 22: cumulative .727 .909 .955 1
    assert truncated_svd_rank(s, 0.7, min_rank=1) == 1
    assert truncated_svd_rank(s, 0.7) == 2            # half-rank floor: ceil(4 / 2)
    assert truncated_svd_rank(s, 0.9, min_rank=1) == 2
    assert truncated_svd_rank(s, 0.95, min_rank=1) == 3
    assert truncated_svd_rank(s, 1.0, min_rank=1) == 4
    assert truncated_svd_rank(torch.tensor([9.0, 1, 1, 1, 1]), 0.5) == 3   # ceil(5 / 2)
    assert truncated_svd_rank(s, 0.5, min_rank=10) == 4                     # never above len(s)
    with pytest.raises(ValueError):
        truncated_svd_rank(s, 0.0)


# ------------------------------------------------------------------------------------- data-aware SVD


def test_data_aware_truncation_error_equals_discarded_energy():
    W = torch.randn(48, 32, generator=gen(0), dtype=torch.float64)
    X = torch.randn(32, 200, generator=gen(1), dtype=torch.float64) * torch.linspace(0.1, 3, 32)[:, None].double()
    res = data_aware_truncation(W, X, tau=0.9)
    assert res.damping == 0.0 and res.W_approx.shape == W.shape and res.W_approx.dtype == W.dtype
    assert 16 <= res.rank < 32 and res.retained_energy >= 0.9
    err = float(((W @ X - res.W_approx @ X) ** 2).sum())
    assert err == pytest.approx(res.discarded, rel=1e-4)
    sigma = torch.linalg.svdvals(W @ torch.linalg.cholesky(X @ X.T))
    assert res.rank == truncated_svd_rank(sigma, 0.9)
    assert res.discarded == pytest.approx(float((sigma[res.rank:] ** 2).sum()), rel=1e-9)

    full = data_aware_truncation(W, X, min_rank=32)   # nothing discarded: W X reproduced
    assert full.discarded == 0.0
    torch.testing.assert_close(full.W_approx @ X, W @ X, rtol=1e-9, atol=1e-9)

    res32 = data_aware_truncation(W.float(), X.float(), tau=0.9)   # float32 in, float64 inside, float32 out
    assert res32.W_approx.dtype == torch.float32 and res32.rank == res.rank
    err32 = float(((W @ X - res32.W_approx.double() @ X) ** 2).sum())
    assert err32 == pytest.approx(res.discarded, rel=1e-3)


@pytest.mark.parametrize("F", [48, 20])   # taller than D, and wider (min(F, D) = F singular values)
def test_truncation_by_eigh_equals_the_explicit_svd(F):
    # The eigendecomposition route against the definition W~ = U_r Sigma_r V_r^T S^{-1} with a thin SVD of W S.
    W = torch.randn(F, 32, generator=gen(6), dtype=torch.float64)
    X = torch.randn(32, 300, generator=gen(7), dtype=torch.float64) * torch.linspace(0.2, 2, 32)[:, None].double()
    S, lam = whitening_factor(X @ X.T)
    U, sigma, Vh = torch.linalg.svd(W @ S, full_matrices=False)
    r = truncated_svd_rank(sigma, 0.9)
    reference = torch.linalg.solve_triangular(S, (U[:, :r] * sigma[:r]) @ Vh[:r], upper=False, left=False)
    for shared in (None, W.T @ W):         # W^T W computed inside, or given by the caller: the same result
        res = truncate_whitened(W, S, lam, tau=0.9, wtw_DD=shared)
        assert res.rank == r
        # both are float64 computations of the same matrix; 1e-9 of its scale is far above their rounding
        torch.testing.assert_close(res.W_approx, reference, rtol=0, atol=1e-9 * float(reference.abs().max()))
        assert res.discarded == pytest.approx(float((sigma[r:] ** 2).sum()), rel=1e-9)
        assert res.retained_energy == pytest.approx(float((sigma[:r] ** 2).sum() / (sigma**2).sum()), rel=1e-12)


def test_data_aware_truncation_rank_deficient_x_needs_damping():
    W = torch.randn(48, 32, generator=gen(2), dtype=torch.float64)
    X = torch.randn(32, 20, generator=gen(3), dtype=torch.float64)   # N < D: X X^T singular
    res = data_aware_truncation(W, X, tau=0.95)
    assert res.damping > 0
    # exact for the damped Gram G + lam I = S S^T: ||(W - W~) S||^2 = discarded; on X alone it can only be lower
    S, lam = whitening_factor(X @ X.T)
    assert lam == res.damping
    damped = float((((W - res.W_approx) @ S) ** 2).sum())
    assert damped == pytest.approx(res.discarded, rel=1e-4)
    err = float(((W @ X - res.W_approx @ X) ** 2).sum())
    assert err <= res.discarded * (1 + 1e-6)


# -------------------------------------------------------------------------------------------------- PCA


def test_pca_orthonormal_and_exact_at_full_dim():
    g = gen(5)
    x = torch.randn(100, 10, generator=g, dtype=torch.float64) @ torch.randn(10, 10, generator=g).double() + 3.0
    full = pca(x, 10)
    torch.testing.assert_close(full.components_dD @ full.components_dD.T, torch.eye(10, dtype=torch.float64))
    torch.testing.assert_close(full.reconstruct(full.project(x)), x)
    z = full.project(x)
    torch.testing.assert_close(z.var(0), full.explained_variance)
    assert torch.all(full.explained_variance[:-1] >= full.explained_variance[1:])
    part = pca(x, 3)
    torch.testing.assert_close(part.components_dD @ part.components_dD.T, torch.eye(3, dtype=torch.float64))
    torch.testing.assert_close(part.components_dD, full.components_dD[:3])   # signs fixed: same basis
    biggest = full.components_dD.gather(1, full.components_dD.abs().argmax(1, keepdim=True))
    assert torch.all(biggest > 0)   # the sign convention
    with pytest.raises(ValueError, match="dim"):
        pca(x, 11)

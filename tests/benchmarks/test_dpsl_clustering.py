"""The pieces of benchmarks/studies/dpsl_clustering.py that its numbers rest on: the Hungarian-matched accuracy, the
data generator's proportions, SwAV's Sinkhorn codes, the DPSL schedule gate, and that the loss is the project's own."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import upcycle.training.loss.dpsl

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "studies"))
import dpsl_clustering as bench  # noqa: E402


def test_hungarian_accuracy_ignores_cluster_names_and_knows_collapse():
    true = np.repeat([0, 1, 2], [40, 10, 10])
    permuted = np.array([2, 0, 1])[true]
    assert bench.hungarian_accuracy(permuted, true) == 1.0
    # everything in one cluster on 4:1:1 data: only the big cluster can be matched, 40/60
    assert bench.hungarian_accuracy(np.zeros_like(true), true) == pytest.approx(2 / 3)
    # one of the small clusters split off wrongly: 5 of its 10 points land in the big cluster's name
    pred = permuted.copy()
    pred[50:55] = 2
    assert bench.hungarian_accuracy(pred, true) == pytest.approx(55 / 60)


@pytest.mark.parametrize("n", [3000, 1001, 7])
def test_cluster_sizes_follow_the_proportions_and_sum_to_n(n):
    sizes = bench.cluster_sizes((4.0, 1.0, 1.0), n)
    assert sum(sizes) == n
    assert all(abs(s - n * p / 6) < 1 for s, p in zip(sizes, (4, 1, 1), strict=True))   # largest remainders: within 1
    assert bench.cluster_sizes((4.0, 1.0, 1.0), 3000) == [2000, 500, 500]


@pytest.mark.parametrize("name", sorted(bench.REGIMES))
def test_make_data_has_the_regime_proportions_and_is_standardized_and_seeded(name):
    regime = bench.REGIMES[name]
    x, y = bench.make_data(regime, 3000, seed=1)
    assert x.shape == (3000, 2) and x.dtype == np.float32
    assert np.bincount(y).tolist() == bench.cluster_sizes(regime.proportions, 3000)
    np.testing.assert_allclose(x.mean(0), 0.0, atol=1e-5)
    np.testing.assert_allclose(x.std(0), 1.0, atol=1e-5)
    assert np.array_equal(bench.make_data(regime, 3000, seed=1)[0], x)
    assert not np.array_equal(bench.make_data(regime, 3000, seed=2)[0], x)


def test_sinkhorn_codes_are_distributions_with_equal_cluster_shares():
    """SwAV's equipartition: even when every point prefers cluster 0, the codes give each cluster B/K of the
    mass (to the convergence of the iterations), and each point's code sums to 1."""
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(256, 3, generator=g) * 0.2 + torch.tensor([0.8, 0.0, 0.0])
    q = bench.sinkhorn(scores, iterations=200)
    torch.testing.assert_close(q.sum(1), torch.ones(256))
    torch.testing.assert_close(q.sum(0), torch.full((3,), 256 / 3), rtol=1e-3, atol=0)
    assert (q.argmax(1) != 0).any()           # the preference alone would put every point in cluster 0
    # equal scores: the uniform code
    torch.testing.assert_close(bench.sinkhorn(torch.zeros(8, 3)), torch.full((8, 3), 1 / 3))


def test_the_dpsl_window_gates_the_loss_exactly():
    """A DPSL weight outside its window changes nothing (bit-identical run); inside it changes the run."""
    x, _ = bench.make_data(bench.REGIMES["overlapping"], 300, seed=0)
    base = bench.Setting(targets="swap", steps=20, batch=64)
    plain, plain_info = bench.train(x, base, seed=0)
    gated, info = bench.train(x, bench.Setting(**{**base.__dict__, "dpsl_lambda": 1.0, "dpsl_start": 1.0}), seed=0)
    assert np.array_equal(plain, gated) and info["dpsl_at_last_shaped_step"] is None
    _, shaped = bench.train(x, bench.Setting(**{**base.__dict__, "dpsl_lambda": 1.0}), seed=0)
    assert shaped["dpsl_at_last_shaped_step"] is not None
    assert shaped["mean_max_probability"] != plain_info["mean_max_probability"]
    with pytest.raises(ValueError, match="targets"):
        bench.train(x, bench.Setting(targets="kmeans", steps=1), seed=0)


def test_the_benchmark_uses_the_projects_dpsl():
    assert bench.dpsl is upcycle.training.loss.dpsl.dpsl

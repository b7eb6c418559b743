"""Expert-weight metrics: exact values on constructed experts."""

from __future__ import annotations

import math

import pytest
import torch

from upcycle.core.ffn import FFNWeights
from upcycle.metrics.experts import diversity, expert_similarity, mean_pairwise_cosine


def test_identical_experts_have_similarity_one_and_diversity_zero():
    g = torch.Generator().manual_seed(0)
    one = FFNWeights(w_up=torch.randn(6, 4, generator=g), w_gate=torch.randn(6, 4, generator=g),
                     w_down=torch.randn(4, 6, generator=g), activation="silu")
    stack = one.repeat(3)
    assert expert_similarity(stack) == pytest.approx(1.0)
    assert diversity(stack) == pytest.approx(0.0, abs=1e-12)


def test_known_cosines():
    # rows e0 = (1, 0), e1 = (0, 1), e2 = (1, 1)/sqrt2: cosines 0, 1/sqrt2, 1/sqrt2
    rows = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    assert mean_pairwise_cosine(rows) == pytest.approx((0 + 2 / math.sqrt(2)) / 3)
    down = rows.view(3, 2, 1)
    experts = FFNWeights(w_up=torch.ones(3, 1, 2), w_down=down, activation="gelu")
    assert diversity(experts) == pytest.approx(1 - (2 / math.sqrt(2)) / 3)


def test_single_expert_has_no_pairs():
    experts = FFNWeights(w_up=torch.ones(1, 3, 2), w_down=torch.ones(1, 2, 3), activation="gelu")
    assert expert_similarity(experts) is None and diversity(experts) is None


def test_similarity_is_the_same_computed_in_column_blocks(monkeypatch):
    """The Gram matrix is accumulated a block of columns at a time (memory at real sizes); any block size gives
    the same numbers, for contiguous experts and for the expanded views copy-upcycling returns."""
    import upcycle.metrics.experts as metrics
    from upcycle.core.ffn import FFNWeights

    g = torch.Generator().manual_seed(3)
    experts = FFNWeights(w_up=torch.randn(4, 12, 5, generator=g), w_gate=torch.randn(4, 12, 5, generator=g),
                         w_down=torch.randn(4, 5, 12, generator=g), activation="silu")
    whole = (metrics.expert_similarity(experts), metrics.diversity(experts))
    monkeypatch.setattr(metrics, "GRAM_COLUMNS", 7)
    assert (metrics.expert_similarity(experts), metrics.diversity(experts)) == pytest.approx(whole, rel=1e-12)
    one = experts.expert(0)
    views = one.map(lambda t: t.unsqueeze(0).expand(3, *t.shape))
    assert metrics.expert_similarity(views) == pytest.approx(1.0, abs=1e-12)


def test_expanded_experts_take_the_norm_shortcut_with_the_same_gram():
    """Copy-upcycled experts are one tensor expanded E times (stride 0): the Gram matrix is then its squared norm
    everywhere, computed once instead of E^2 times, and equal (to float64 rounding) to that of real copies."""
    import upcycle.metrics.experts as metrics

    g = torch.Generator().manual_seed(5)
    one = torch.randn(7, 9, generator=g)
    expanded = one.unsqueeze(0).expand(4, 7, 9)
    assert expanded.stride(0) == 0
    torch.testing.assert_close(metrics.gram_matrix([expanded]), metrics.gram_matrix([expanded.contiguous()]),
                               rtol=1e-12, atol=0)
    assert metrics.gram_matrix([expanded]).unique().numel() == 1

"""docs/methods.md §5 metrics of `upcycle.metrics` on constructed layers and labels with known answers."""

from __future__ import annotations

import math

import pytest
import torch

from upcycle.core.ffn import FFNWeights
from upcycle.core.moe import MoELayer
from upcycle.metrics import TokenSources, layer_metrics
from upcycle.metrics.compactness import relative_compactness
from upcycle.metrics.experts import diversity, expert_similarity
from upcycle.metrics.routing import (
    expert_routing_probability,
    layer_routing_stats,
    load_cov,
    probability_histograms,
    record_stats,
    router_load,
)
from upcycle.metrics.similarity import expert_outputs, output_similarity, weight_similarity
from upcycle.metrics.specialization import shuffled_baseline, source_metrics, specialization


def _layer(experts: FFNWeights, router_ED: torch.Tensor, top_k: int = 1) -> MoELayer:
    return MoELayer.from_init(experts, router_ED, top_k=top_k)


def _random_ffn(seed: int, D: int = 8, F: int = 12) -> FFNWeights:
    g = torch.Generator().manual_seed(seed)
    return FFNWeights(w_up=torch.randn(F, D, generator=g), w_gate=torch.randn(F, D, generator=g),
                      w_down=torch.randn(D, F, generator=g), activation="silu")


def test_identical_experts_similarity_one_diversity_zero_output_similarity_one():
    experts = _random_ffn(0).repeat(4)
    layer = _layer(experts, torch.randn(4, 8, generator=torch.Generator().manual_seed(1)), top_k=2)
    m = layer_metrics(layer, torch.randn(300, 8, generator=torch.Generator().manual_seed(2)))
    for name in ("gate", "up", "down", "all"):
        assert m["weight_similarity"][name]["mean"] == pytest.approx(1.0, abs=1e-12)
        assert torch.tensor(m["weight_similarity"][name]["matrix"]) == pytest.approx(torch.ones(4, 4), abs=1e-12)
    assert m["diversity"] == pytest.approx(0.0, abs=1e-12)
    assert m["output_similarity"]["mean"] == pytest.approx(1.0, abs=1e-12)


def _orthogonal_experts() -> FFNWeights:
    """Two experts on disjoint coordinates: expert e reads inputs 2e, 2e+1 and writes outputs 2e, 2e+1 only."""
    g = torch.Generator().manual_seed(0)
    w_up, w_gate, w_down = torch.zeros(2, 3, 4), torch.zeros(2, 3, 4), torch.zeros(2, 4, 3)
    for e in range(2):
        cols = slice(2 * e, 2 * e + 2)
        w_up[e, :, cols] = torch.randn(3, 2, generator=g)
        w_gate[e, :, cols] = torch.randn(3, 2, generator=g)
        w_down[e, cols, :] = torch.randn(2, 3, generator=g)
    return FFNWeights(w_up=w_up, w_gate=w_gate, w_down=w_down, activation="silu")


def test_orthogonal_experts_have_similarity_zero_in_weights_and_outputs():
    experts = _orthogonal_experts()
    sims = weight_similarity(experts)
    for name in ("gate", "up", "down", "all"):
        assert sims[name]["mean"] == 0.0 and sims[name]["matrix"][0][1] == 0.0   # disjoint supports: exactly 0
    assert diversity(experts) == 1.0
    y_ETD = expert_outputs(experts, torch.randn(50, 4, generator=torch.Generator().manual_seed(3)))
    assert output_similarity(y_ETD)["mean"] == 0.0


def test_all_weights_similarity_is_the_conversion_reports_expert_similarity():
    g = torch.Generator().manual_seed(5)
    experts = FFNWeights(w_up=torch.randn(5, 6, 4, generator=g), w_gate=torch.randn(5, 6, 4, generator=g),
                         w_down=torch.randn(5, 4, 6, generator=g), activation="silu")
    assert weight_similarity(experts)["all"]["mean"] == pytest.approx(expert_similarity(experts), rel=1e-12)
    cos = torch.nn.functional.cosine_similarity(experts.w_down[0].flatten(), experts.w_down[3].flatten(), dim=0)
    assert weight_similarity(experts)["down"]["matrix"][0][3] == pytest.approx(float(cos), rel=1e-6)


def test_uniform_router_has_entropy_log_e_and_routing_probability_one_over_e():
    E = 4
    layer = _layer(_random_ffn(0).repeat(E), torch.zeros(E, 8), top_k=2)
    m = layer_metrics(layer, torch.randn(64, 8, generator=torch.Generator().manual_seed(0)))
    assert m["routing_entropy"] == pytest.approx(math.log(E), abs=1e-12)
    chosen = [p for p in m["expert_routing_probability"] if p is not None]
    assert chosen == pytest.approx([1 / E] * len(chosen), abs=1e-12)
    # 0.25 exactly: the range is rounded up to [0, 0.3], and 0.25 falls in bin 33 of 40 (0.2475 to 0.255)
    assert all(c == ([0] * 33 + [64] + [0] * 6) for c in m["probability_histograms"]["counts"])


def test_a_balanced_router_has_load_cov_zero_and_an_unbalanced_one_does_not():
    """Router rows eps * e_i and tokens cycling over the basis vectors: each expert gets every E-th token, with
    probabilities within O(eps) of uniform (entropy log E - O(eps^2))."""
    E, eps = 4, 1e-4
    router = torch.zeros(E, 8)
    router[:, :E] = eps * torch.eye(E)
    x = torch.eye(8)[torch.arange(400) % E]
    m = layer_metrics(_layer(_random_ffn(0).repeat(E), router), x)
    assert m["router_load"] == [0.25] * 4 and m["load_cov"] == 0.0
    assert m["routing_entropy"] == pytest.approx(math.log(E), abs=1e-6)
    assert load_cov([0.5, 0.5, 0.0, 0.0]) == pytest.approx(1.0)         # std 0.25 / mean 0.25


def test_routing_probability_and_histograms_on_known_probabilities():
    probs = torch.tensor([[0.72, 0.18, 0.10], [0.12, 0.58, 0.30], [0.52, 0.43, 0.05]])   # off the bin edges
    ids = probs.topk(1).indices
    assert expert_routing_probability(probs, ids) == pytest.approx([0.62, 0.58, None])
    h = probability_histograms(probs, bins=10)           # largest 0.72: the whole [0, 1]
    assert h["counts"][0] == [0, 1, 0, 0, 0, 1, 0, 1, 0, 0] and [sum(c) for c in h["counts"]] == [3, 3, 3]
    assert h["edges"] == pytest.approx([i / 10 for i in range(11)])


def test_the_conversion_report_training_log_and_analyze_read_the_same_routing_numbers():
    """One computation of entropy and load: the conversion report (`layer_routing_stats`), the training log
    (`record_stats` of a forward's record) and `layer_metrics` agree on the same tokens."""
    g = torch.Generator().manual_seed(7)
    layer = _layer(FFNWeights(w_up=torch.randn(4, 12, 8, generator=g), w_down=torch.randn(4, 8, 12, generator=g),
                              activation="gelu"), torch.randn(4, 8, generator=g), top_k=2)
    x = torch.randn(200, 8, generator=g)
    m = layer_metrics(layer, x)
    report = layer_routing_stats(layer, x)
    assert report["routing_entropy"] == m["routing_entropy"] and report["router_load"] == m["router_load"]
    assert report["router_load_cov"] == m["load_cov"]
    layer(x)
    log = record_stats(layer.last_record)
    assert log["entropy"] == round(m["routing_entropy"], 5) and log["load_cov"] == round(m["load_cov"], 5)
    assert router_load(layer.last_record.topk_ids_TK, 4) == m["router_load"]


def test_a_router_that_sends_each_source_to_its_own_experts_scores_one():
    sources = torch.arange(3).repeat_interleave(100)
    own = torch.stack([2 * sources + (torch.arange(300) % 2), (2 * sources + 7) % 8], dim=1)   # top-1: 2s or 2s+1
    m = source_metrics(sources, own, ["wiki", "code", "law"], 8)
    assert m["nmi"] == pytest.approx(1.0, abs=1e-12)
    assert m["nmi_baseline"]["max"] < 0.05
    shares = torch.tensor(m["expert_source_share"], dtype=torch.float64)
    assert shares.shape == (8, 3) and torch.allclose(shares.sum(1)[shares.sum(1) > 0], torch.ones(1).double())
    assert shares[0].tolist() == [1.0, 0.0, 0.0] and shares[4].tolist() == [0.0, 0.0, 1.0]


def test_random_routing_scores_about_zero_within_the_shuffled_baseline():
    g = torch.Generator().manual_seed(11)
    sources = torch.randint(0, 3, (6000,), generator=g)
    experts = torch.randint(0, 8, (6000,), generator=g)
    score = specialization(sources, experts, 3, 8)
    baseline = shuffled_baseline(sources, experts, 3, 8, shuffles=50, seed=1)
    # plug-in bias (E-1)(S-1)/(2T) nats = 1.2e-3 nats, over H(S) = log 3: about 1e-3; 0.01 leaves 10x room
    assert score < 0.01 and baseline["max"] < 0.01
    assert score <= baseline["max"]       # independent labels: the score is one more draw of the baseline
    assert specialization(sources, sources, 3, 3) == pytest.approx(1.0)


def _clusters(separation: float, sigma: float = 0.5, D: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """Three clusters centred at separation * e_g, each the 2D points mean +- sigma * e_d (covariance
    sigma^2/D I): Σ_W = sigma^2/D I, Σ_B has eigenvalue separation^2/3 twice, so RC = 6 sigma^2 / (D s^2)."""
    points, labels = [], []
    for g in range(3):
        mean = separation * torch.eye(D)[g]
        for d in range(D):
            for sign in (1, -1):
                points.append(mean + sign * sigma * torch.eye(D)[d])
                labels.append(g)
    return torch.stack(points).double(), torch.tensor(labels)


def test_relative_compactness_known_value_and_order_by_cluster_separation():
    values = []
    for s in (0.5, 1.0, 2.0, 4.0):
        rc = relative_compactness(*_clusters(s))
        assert rc == pytest.approx(6 * 0.25 / (6 * s**2), rel=1e-9)
        values.append(rc)
    assert values == sorted(values, reverse=True)
    noisy = torch.Generator().manual_seed(0)
    x, y = _clusters(1.0)
    assert relative_compactness(x + 0.3 * torch.randn(x.shape, generator=noisy, dtype=x.dtype), y) > values[1]
    assert relative_compactness(x, torch.zeros(len(x), dtype=torch.long)) is None       # one expert: undefined


def test_layer_metrics_for_three_experts_has_the_simplex_and_specialization():
    g = torch.Generator().manual_seed(2)
    layer = _layer(FFNWeights(w_up=torch.randn(3, 12, 8, generator=g), w_down=torch.randn(3, 8, 12, generator=g),
                              activation="gelu"), torch.randn(3, 8, generator=g))
    x = torch.randn(90, 8, generator=g)
    m = layer_metrics(layer, x, TokenSources(torch.arange(90) % 3, ["a", "b", "c"]), simplex_points=50)
    assert len(m["simplex"]) == 50 and all(sum(p) == pytest.approx(1.0) for p in m["simplex"])
    assert m["specialization"]["sources"] == ["a", "b", "c"] and 0 <= m["specialization"]["nmi"] <= 1
    with pytest.raises(ValueError):
        layer_metrics(layer, x, TokenSources(torch.arange(89) % 3, ["a", "b", "c"]))

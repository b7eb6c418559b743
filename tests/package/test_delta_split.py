"""`core.delta_split.split_experts`: full experts as a base plus rank-R deltas by truncated SVD. At full rank the
delta experts are the source's experts; experts whose differences have rank R come back exactly at rank R; below,
the energy kept is the SVD's; a copy's experts are their base with zero deltas."""

from __future__ import annotations

import pytest
import torch

from upcycle.core.delta_experts import DeltaExperts
from upcycle.core.delta_split import split_experts
from upcycle.core.expert_shape import ExpertShape
from upcycle.core.ffn import FFNWeights

E, D, F_ = 4, 16, 24


def stacked(seed: int = 0, *, biases: bool = False) -> FFNWeights:
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)   # noqa: E731
    return FFNWeights(w_gate=r(E, F_, D), w_up=r(E, F_, D), w_down=r(E, D, F_), activation="silu",
                      b_up=r(E, F_) if biases else None, b_gate=r(E, F_) if biases else None,
                      b_down=r(E, D) if biases else None)


def delta_of(split, rank: int) -> DeltaExperts:
    layer = DeltaExperts(E, ExpertShape.of(split.base), rank, dtype=torch.float64)
    layer.load_base(split.base)
    layer.load_deltas(split.deltas)
    return layer


def test_full_rank_gives_back_the_experts():
    experts = stacked()
    split = split_experts(experts, rank=min(D, F_))
    got = delta_of(split, min(D, F_)).weights()
    for name in ("w_gate", "w_up", "w_down"):
        want = getattr(experts, name)
        assert (getattr(got, name) - want).abs().max() <= 1e-10 * want.abs().max(), name
        assert torch.allclose(split.energy[name], torch.ones(E), atol=1e-6)


def test_differences_of_rank_r_come_back_exactly_and_less_rank_keeps_the_svd_share():
    g = torch.Generator().manual_seed(1)
    dense = stacked(2).map(lambda t: t[0])
    rank2 = {name: torch.randn(E, getattr(dense, name).shape[0], 2, generator=g, dtype=torch.float64) @
             torch.randn(E, 2, getattr(dense, name).shape[1], generator=g, dtype=torch.float64)
             for name in ("w_gate", "w_up", "w_down")}
    experts = FFNWeights(**{n: getattr(dense, n).unsqueeze(0) + rank2[n] for n in rank2}, activation="silu")
    split = split_experts(experts, rank=2, base=dense)
    got = delta_of(split, 2).weights()
    for name, delta in rank2.items():
        assert (getattr(got, name) - getattr(experts, name)).abs().max() <= 1e-10 * delta.abs().max(), name
    one = split_experts(experts, rank=1, base=dense)
    for name, delta in rank2.items():
        s = torch.linalg.svdvals(delta)
        want = (s[:, 0] ** 2 / (s ** 2).sum(-1)).float()
        assert torch.allclose(one.energy[name], want, rtol=1e-5), name
        assert (one.energy[name] < 1).all()


def test_a_copys_experts_are_their_base_with_zero_deltas():
    dense = stacked(3, biases=True).map(lambda t: t[0])
    split = split_experts(dense.repeat(E), rank=4)
    assert split.bias_drift == 0.0
    for name, (a, b) in split.deltas.items():
        assert torch.count_nonzero(a @ b) == 0 and torch.equal(split.energy[name], torch.ones(E)), name
        assert torch.equal(getattr(split.base, name), getattr(dense, name))


def test_bias_drift_is_reported_and_bad_requests_refused():
    experts = stacked(4, biases=True)
    split = split_experts(experts, rank=3)
    want = max(float((getattr(experts, n) - getattr(experts, n).mean(0)).abs().max())
               for n in ("b_gate", "b_up", "b_down"))
    assert split.bias_drift == pytest.approx(want)
    with pytest.raises(ValueError, match="rank must be between 1 and min"):
        split_experts(experts, rank=17)
    with pytest.raises(ValueError, match="stacked experts"):
        split_experts(experts.map(lambda t: t[0]), rank=2)
    with pytest.raises(ValueError, match="one FFN of the experts' shape"):
        split_experts(experts, rank=2, base=experts)

"""`core.delta_experts.DeltaExperts`: E experts as a shared base FFN plus rank-R deltas. With zero deltas it is the
dense FFN it was loaded from (every family, gated and plain, with and without biases); with any deltas it is the
full-expert layer built from its materialized experts, forward and backward, on the grouped and the loop path; a
frozen base stays bit-identical and gets no gradient; and its multiply-adds are the dense FFN's plus each selected
expert's 3·R·(D + F)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from conftest import FAMILIES, make_tiny
from upcycle.config import PlacementConfig
from upcycle.core.architectures import family_of
from upcycle.core.delta_experts import DeltaExperts, low_rank_path
from upcycle.core.expert_shape import ExpertShape
from upcycle.core.ffn import FFNWeights
from upcycle.core.grouped_ffn import forced_kernel_path
from upcycle.core.moe import Experts
from upcycle.core.surgery import plan_targets, tower_cfg


def dense_of(kind: str) -> FFNWeights:
    """The first target block's FFN of a tiny model of `kind`, in float64 (exact comparisons below)."""
    model = make_tiny(kind)
    family = family_of(model.config)
    target = plan_targets(model, PlacementConfig())[0]
    ffn = family.extract(model.get_submodule(target.path), tower_cfg(model, family, target))
    return ffn.map(lambda t: t.detach().double())


def delta_like(dense: FFNWeights, num_experts: int, rank: int, **kw) -> DeltaExperts:
    layer = DeltaExperts(num_experts, ExpertShape.of(dense), rank, dtype=torch.float64, **kw)
    layer.load_base(dense)
    return layer


def routed(T: int, E: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k distinct experts per token with weights summing to 1, as slots sorted by expert: (tokens_N, weights_N,
    counts_E)."""
    g = torch.Generator().manual_seed(seed)
    ids_TK = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w_TK = torch.softmax(torch.randn(T, k, generator=g, dtype=torch.float64), -1)
    ids_N, order = torch.sort(ids_TK.reshape(-1), stable=True)
    return order // k, w_TK.reshape(-1)[order], torch.bincount(ids_N, minlength=E)


def random_deltas(layer: DeltaExperts, seed: int = 1, scale: float = 0.05) -> None:
    g = torch.Generator().manual_seed(seed)
    deltas = {name: (torch.randn(a.shape, generator=g, dtype=a.dtype) * scale,
                     torch.randn(b.shape, generator=g, dtype=b.dtype))
              for name, (_, a, b) in layer._pairs().items()}
    layer.load_deltas(deltas)


@pytest.mark.parametrize("kind", FAMILIES)
def test_zero_deltas_compute_the_dense_ffn(kind):
    dense = dense_of(kind)
    layer = delta_like(dense, num_experts=4, rank=2)
    T = 9
    x = torch.randn(T, dense.hidden_size, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    tokens, weights, counts = routed(T, 4, 2)
    y = layer(x, tokens, weights, counts)
    want = dense(x)                     # weights sum to 1 per token: the dense FFN, whichever experts are chosen
    assert torch.allclose(y, want, rtol=0, atol=1e-12 * want.abs().max()), (y - want).abs().max()


@pytest.mark.parametrize("kind", ["llama", "gpt2"])          # a gated FFN; a plain one with biases
@pytest.mark.parametrize("path", ["grouped_mm", "loop"])
def test_a_delta_layer_is_the_full_layer_of_its_materialized_experts(kind, path, monkeypatch):
    """In float32, the dtype both paths run in (grouped_mm takes no float64); on the grouped path the delta layer
    reads no slot count on the host."""
    dense = dense_of(kind).map(lambda t: t.float())
    E, k, T = 4, 2, 11
    delta = delta_like(dense, E, rank=4).float()       # 4 float32 columns: 16-byte rows, as grouped_mm needs
    random_deltas(delta)
    full = Experts(E, ExpertShape.of(dense), dtype=torch.float32)
    full.load_weights(delta.weights())
    tokens, weights, counts = routed(T, E, k)
    weights = weights.float()
    x = torch.randn(T, dense.hidden_size, generator=torch.Generator().manual_seed(4))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    wa, wb = weights.clone().requires_grad_(), weights.clone().requires_grad_()     # the router's weights learn
    if path == "grouped_mm":            # the counts stay where they are: no per-expert segments are read
        import upcycle.core.delta_experts as module

        monkeypatch.setattr(module, "expert_segments", lambda *a: pytest.fail("the grouped path read the counts"))
    with forced_kernel_path(path):      # both kinds on the path: the delta layer's low-rank products as well
        assert low_rank_path(x.device, torch.float32, 4, dense.hidden_size, dense.intermediate_size) == path
        y_delta = delta(xa, tokens, wa, counts)
        y_full = full(xb, tokens, wb, counts)
    # the same sums in two orders (base and delta apart, or the materialized sum): float32 rounding, a few 1e-7 of
    # the largest value over sums of 64 terms; bound 1e-5 of it
    assert (y_delta - y_full).abs().max() <= 1e-5 * y_full.abs().max()
    g = torch.randn(y_full.shape, generator=torch.Generator().manual_seed(5))
    (y_delta * g).sum().backward()
    (y_full * g).sum().backward()
    assert (xa.grad - xb.grad).abs().max() <= 1e-5 * xb.grad.abs().max()
    assert (wa.grad - wb.grad).abs().max() <= 1e-5 * wb.grad.abs().max()
    # the base's gradient is the sum of the full experts' (every expert is base + its delta)
    assert (delta.base_down.grad - full.w_down.grad.sum(0)).abs().max() <= 1e-5 * full.w_down.grad.abs().max()
    # a factor's gradient is its expert's full gradient through the product: dL/dA_e = dL/dW_e B_eᵀ
    want = torch.bmm(full.w_down.grad, delta.down_b.detach().transpose(1, 2))
    assert (delta.down_a.grad - want).abs().max() <= 1e-5 * want.abs().max()


def test_a_frozen_base_stays_bit_identical_and_holds_no_optimizer_state():
    dense = dense_of("llama")
    layer = delta_like(dense, 4, rank=2, train_base=False)
    before = {n: p.detach().clone() for n, p in layer.named_parameters()}
    trainable = [p for p in layer.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    for step in range(3):
        tokens, weights, counts = routed(8, 4, 2, seed=step)
        x = torch.randn(8, dense.hidden_size, generator=torch.Generator().manual_seed(step), dtype=torch.float64)
        layer(x, tokens, weights, counts).pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    base = {id(p) for p in layer.base_parameters()}
    for name, p in layer.named_parameters():
        if id(p) in base:
            assert torch.equal(p, before[name]) and p.grad is None and p not in optimizer.state, name
        elif name.endswith("_a"):     # A starts at zero and moves once trained
            assert not torch.equal(p, before[name]), name
    assert len(optimizer.state) == len(trainable) == 6          # A and B of gate, up and down


@pytest.mark.parametrize("kind, rank", [("llama", 2), ("llama", 8), ("gpt2", 4)])
def test_a_delta_layer_costs_the_dense_ffn_plus_each_selected_experts_low_rank_terms(kind, rank):
    dense = dense_of(kind)
    E, k, T = 8, 2, 64
    layer = delta_like(dense, E, rank)
    x = torch.randn(T, dense.hidden_size, dtype=torch.float64)
    tokens, weights, counts = routed(T, E, k)
    with FlopCounterMode(display=False) as delta_count:
        layer(x, tokens, weights, counts)
    with FlopCounterMode(display=False) as dense_count:
        dense(x)
    D, F_ = dense.hidden_size, dense.intermediate_size
    matrices = 3 if dense.gated else 2
    bound = dense_count.get_total_flops() * (1 + k * rank * (D + F_) / (D * F_)) * 1.05
    assert delta_count.get_total_flops() <= bound
    # and exactly: the base once per token, each slot's delta factors (2 flops per multiply-add)
    assert delta_count.get_total_flops() == 2 * T * matrices * D * F_ + 2 * T * k * matrices * rank * (D + F_)


def test_the_rank_and_the_factors_shapes_are_checked():
    dense = dense_of("llama")
    with pytest.raises(ValueError, match="delta rank must be between 1 and"):
        delta_like(dense, 4, rank=0)
    layer = delta_like(dense, 4, rank=2)
    with pytest.raises(ValueError, match="w_up: factors"):
        layer.load_deltas({"w_up": (torch.zeros(4, 3, 2), torch.zeros(4, 2, 3))})
    with pytest.raises(ValueError, match="does not fit"):
        layer.load_base(dense_of("gpt2"))


def autocast_case(T: int, device: str = "cpu") -> tuple[DeltaExperts, Experts, tuple]:
    """A float32 rank-8 delta layer (random deltas), the full-expert layer of its materialized experts, and the
    layers' inputs: T tokens routed top-2 of 4 experts; all on `device`."""
    dense = dense_of("llama").map(lambda t: t.float())
    delta = delta_like(dense, 4, rank=8).float()
    random_deltas(delta)
    full = Experts(4, ExpertShape.of(dense), dtype=torch.float32)
    full.load_weights(delta.weights())
    tokens, weights, counts = routed(T, 4, 2)
    x = torch.randn(T, dense.hidden_size, generator=torch.Generator().manual_seed(4))
    return delta.to(device), full.to(device), tuple(t.to(device) for t in (x, tokens, weights.float(), counts))


def bfloat16_errors(delta: DeltaExperts, full: Experts, inputs: tuple) -> tuple[torch.Tensor, float, float]:
    """The delta layer's output under bfloat16 autocast, its root-mean-square error against the float32 full-expert
    layer, and the full experts' own error under the same autocast."""
    exact = full(*inputs).detach()
    with torch.autocast(inputs[0].device.type, dtype=torch.bfloat16):
        y = delta(*inputs)
        y_full = full(*inputs)
    return y, (y - exact).pow(2).mean().sqrt(), (y_full - exact).pow(2).mean().sqrt()


@pytest.mark.parametrize("path", ["grouped_mm", "loop"])
def test_under_autocast_a_delta_layer_computes_in_bfloat16_as_its_full_experts_do(path):
    """Mixed precision (float32 parameters, bfloat16 autocast): the products in bfloat16, the output in the input's
    dtype, float32 gradients for the float32 parameters; and its error against the float32 layer of the order of
    the full experts' error under the same autocast. They round different things (the full experts each
    materialized W_e, the delta layer the base and each correction apart: about two roundings where the full
    experts make one), so the bound is on the root-mean-square error: measured 1.04-1.92x the full experts' over 30
    seeds, both paths, gated and plain FFNs; 3x here."""
    delta, full, inputs = autocast_case(16)
    with forced_kernel_path(path):
        y, error, full_error = bfloat16_errors(delta, full, inputs)
    assert y.dtype == torch.float32
    assert 0 < error <= 3 * full_error, (error, full_error)       # bfloat16 was used, and about as well as theirs
    y.pow(2).sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in delta.parameters())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the grouped path's own device)")
def test_on_a_gpu_a_delta_layer_runs_grouped_and_computes_as_its_full_experts_do(monkeypatch):
    """The path a GPU takes unforced: grouped_mm for every low-rank product, no slot count read on the host; under
    bfloat16 autocast its error against the float32 full-expert layer is of the order of the full experts' own under
    the same autocast (the CPU test's bound above, 3x their root-mean-square error)."""
    import upcycle.core.delta_experts as module

    delta, full, inputs = autocast_case(64, "cuda")
    assert low_rank_path(inputs[0].device, torch.bfloat16, 8, delta.hidden_size, delta.intermediate_size) \
        == "grouped_mm"
    monkeypatch.setattr(module, "expert_segments", lambda *a: pytest.fail("the grouped path read the counts"))
    y, error, full_error = bfloat16_errors(delta, full, inputs)
    assert y.dtype == torch.float32 and 0 < error <= 3 * full_error, (error, full_error)
    y.pow(2).sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 and p.grad.isfinite().all()
               for p in delta.parameters())

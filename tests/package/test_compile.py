"""torch.compile traces the MoE layer whole: no graph break inside it on the grouped path (bfloat16, as mixed-precision
training computes the experts). torch's grouped_mm has a compile-time kernel for bfloat16 only, so a float32 layer
under torch.compile takes the per-expert loop, whose breaks (it reads the counts on the host) are named here."""

from __future__ import annotations

import pytest
import torch

from upcycle.config import MoEConfig
from upcycle.core.ffn import FFNWeights
from upcycle.core.moe import MoELayer
from upcycle.core.routing_context import padding_mask

dynamo = pytest.importorskip("torch._dynamo")


def _layer(dtype: torch.dtype) -> MoELayer:
    g = torch.Generator().manual_seed(0)
    E, D, F_ = 4, 32, 64
    w = FFNWeights(w_up=torch.randn(E, F_, D, generator=g), w_gate=torch.randn(E, F_, D, generator=g),
                   w_down=torch.randn(E, D, F_, generator=g), activation="silu")
    return MoELayer.from_init(w, torch.randn(E, D, generator=g), top_k=2, dtype=dtype)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test traces from scratch, and leaves no traced graph (nor the fake tensors it holds) behind for the
    tests that count live tensors."""
    import gc

    dynamo.reset()
    yield
    dynamo.reset()
    gc.collect()


def _explain(layer: MoELayer, x: torch.Tensor, mask: torch.Tensor | None = None):
    dynamo.reset()
    with padding_mask(mask):
        return dynamo.explain(layer)(x)


def test_the_grouped_path_compiles_into_one_graph():
    layer = _layer(torch.bfloat16)
    x = torch.randn(2, 16, 32, dtype=torch.bfloat16, requires_grad=True)
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 9:] = 0
    for m in (None, mask):
        explained = _explain(layer, x, m)
        reasons = [str(b.reason).splitlines()[0] for b in explained.break_reasons]
        assert explained.graph_break_count == 0 and explained.graph_count == 1, reasons


def test_no_autocast_query_is_traced(monkeypatch):
    """On CUDA, torch 2.11's dynamo broke the graph at every torch.amp.is_autocast_available call (7 breaks, 8
    graphs). The branch is forced here: that function is made untraceable, and the layer still compiles into one
    graph, because the device types that can autocast are read at import (`upcycle.core.autocast`)."""
    calls = []

    @dynamo.disable
    def untraceable(device_type):
        calls.append(device_type)
        return True

    monkeypatch.setattr(torch.amp, "is_autocast_available", untraceable)
    layer = _layer(torch.bfloat16)
    explained = _explain(layer, torch.randn(2, 16, 32, dtype=torch.bfloat16, requires_grad=True))
    reasons = [str(b.reason).splitlines()[0] for b in explained.break_reasons]
    assert explained.graph_break_count == 0 and explained.graph_count == 1 and calls == [], reasons


def test_a_float32_layer_under_compile_takes_the_loop_and_names_its_breaks():
    explained = _explain(_layer(torch.float32), torch.randn(2, 16, 32))
    assert explained.graph_break_count >= 1
    where = {f.line.strip() for b in explained.break_reasons for f in b.user_stack[-1:]}
    assert any("tolist" in line for line in where), where


@pytest.mark.slow
def test_upcycle_train_runs_compiled(tiny_lm, tmp_path):
    """`--set compile=true` trains the compiled model; its losses follow the eager run's (compiled kernels round
    differently: 1e-3 relative on a 2-step tiny run covers that, a wrong graph would be far off)."""
    from upcycle.config import TrainConfig
    from upcycle.training.trainer import train

    _, moe, train_txt, held = tiny_lm
    base = dict(model=str(moe), data=str(train_txt), eval_data=str(held), steps=2, batch_size=4, sequence_length=32,
                eval_tokens=64, lr=1e-3)
    eager = train(TrainConfig(**base), tmp_path / "eager", progress=False)
    compiled = train(TrainConfig(**base, compile=True), tmp_path / "compiled", progress=False)
    assert compiled["step"] == 2
    assert compiled["eval_after"]["perplexity"] == pytest.approx(eager["eval_after"]["perplexity"], rel=1e-3)


def test_a_delta_layer_compiles_to_its_eager_output_and_gradients_breaking_only_where_it_reads_the_counts():
    """Delta experts read their slot counts on the host (one segment per expert), as the float32 loop does: a
    break there, named; the compiled layer's output and gradients are the eager layer's (aot_eager: the same
    kernels, so equal up to float32 reassociation in the traced graph)."""
    g = torch.Generator().manual_seed(0)
    E, D, F_ = 4, 32, 64
    dense = FFNWeights(w_up=torch.randn(F_, D, generator=g), w_gate=torch.randn(F_, D, generator=g),
                       w_down=torch.randn(D, F_, generator=g), activation="silu")
    experts = dense.repeat(E).map(lambda t: t + 0.05 * torch.randn(t.shape, generator=g))
    config = MoEConfig(num_experts=E, top_k=2, experts="delta", delta_rank=4)
    layer = MoELayer.from_init(experts, torch.randn(E, D, generator=g), config=config, base=dense)
    x = torch.randn(2, 16, D, generator=g)
    explained = _explain(layer, x)
    where = {f.line.strip() for b in explained.break_reasons for f in b.user_stack[-1:]}
    assert explained.graph_break_count >= 1 and any("tolist" in line for line in where), where
    compiled = torch.compile(layer, backend="aot_eager")
    outputs = []
    for run in (layer, compiled):
        layer.zero_grad(set_to_none=True)
        y = run(x)
        y.pow(2).sum().backward()
        outputs.append((y.detach(), {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}))
    (y0, g0), (y1, g1) = outputs
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-5)
    assert g0.keys() == g1.keys() and any(n.endswith("_a") for n in g0)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-4, atol=1e-4, msg=name)

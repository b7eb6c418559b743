"""The MoE layer under mixed precision: a float32 router under any autocast, an expert kernel with
stated dtypes on both of its paths, no host synchronisation in a dropless grouped-matmul forward, and training
in bfloat16 (autocast, and bfloat16 weights) that stays finite."""

from __future__ import annotations

import json

import pytest
import torch

import upcycle.core.grouped_ffn as kernel
from upcycle.core.ffn import FFNWeights, activation_fn
from upcycle.core.moe import MoELayer
from upcycle.training.loss.teacher import ensemble_output

DTYPES = [torch.bfloat16, torch.float16]
# Bound: a matmul of width <= 64 in bfloat16 (8-bit mantissa, eps 2^-8 = 3.9e-3) or float16 (eps 2^-11 = 4.9e-4)
# rounds its inputs and output once each, so outputs and gradients sit within a few eps of float32; measured
# here at most 1.1e-2 (bf16) and 1.5e-3 (fp16) of the output's scale. The bounds below are 5-7x that.
RELATIVE = {torch.bfloat16: 6e-2, torch.float16: 1e-2}


def _layer(shared: bool, capacity: float | None, seed: int = 0) -> MoELayer:
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.2

    experts = FFNWeights(w_gate=w(4, 64, 32), w_up=w(4, 64, 32), w_down=w(4, 32, 64), activation="silu")
    shared_w = FFNWeights(w_gate=w(1, 64, 32), w_up=w(1, 64, 32), w_down=w(1, 32, 64), activation="silu") \
        if shared else None
    return MoELayer.from_init(experts, w(4, 32), top_k=2, shared=shared_w, capacity_factor_train=capacity,
                              capacity_factor_eval=capacity).train()


def _reference(layer: MoELayer, x_TD: torch.Tensor) -> torch.Tensor:
    """Per-token float32 reference with the layer's own (float32) routing: sum_k w_tk FFN_{e_tk}(x_t) + shared."""
    record = layer.route(x_TD)

    def ffn_all(weights: FFNWeights) -> torch.Tensor:      # [E, T, D]: every expert on every token
        act = activation_fn(weights.activation)
        h = act(torch.einsum("efd,td->etf", weights.w_gate, x_TD)) * torch.einsum("efd,td->etf", weights.w_up, x_TD)
        return torch.einsum("edf,etf->etd", weights.w_down, h)

    y_ETD = ffn_all(layer.experts.weights(detach=False))
    T = torch.arange(x_TD.shape[0])
    out = sum(record.topk_weights_TK[:, k, None] * y_ETD[record.topk_ids_TK[:, k], T] for k in range(layer.top_k))
    if layer.shared_experts is not None:
        out = out + ffn_all(layer.shared_experts.weights(detach=False)).sum(0)
    return out


def _grads(layer: MoELayer, x: torch.Tensor, out: torch.Tensor, g: torch.Tensor) -> list[torch.Tensor]:
    params = [x, layer.router.weight, layer.experts.w_in, layer.experts.w_down]
    return list(torch.autograd.grad((out.float() * g).sum(), params, allow_unused=False))


@pytest.fixture
def forced_path():
    """forced_path(path): every MoE batch of the test takes `path`."""
    import contextlib

    with contextlib.ExitStack() as stack:
        yield lambda path: stack.enter_context(kernel.forced_kernel_path(path))


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("path", ["grouped_mm", "loop"])
@pytest.mark.parametrize("shared, capacity", [(False, None), (True, None), (False, 1.0)],
                         ids=["dropless", "shared", "capacity"])
def test_autocast_forward_and_backward_match_a_float32_reference(forced_path, dtype, path, shared, capacity):
    forced_path(path)
    layer = _layer(shared, capacity)
    x = torch.randn(24, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
    g = torch.randn(24, 32, generator=torch.Generator().manual_seed(2))
    with torch.autocast("cpu", dtype=dtype):
        out = layer(x)
    record = layer.last_record
    assert record.logits_TE.dtype == torch.float32 and record.topk_weights_TK.dtype == torch.float32
    assert out.dtype == torch.float32                   # the input's dtype: a float32 residual stream
    if capacity is not None:
        assert not record.kept_TK.all()                 # capacity 1.0 with top-2 of 4 drops some slots
    ref = _reference(layer, x)
    scale = ref.abs().max()
    assert (out - ref).abs().max() <= RELATIVE[dtype] * scale
    for got, want in zip(_grads(layer, x, out, g), _grads(layer, x, ref, g), strict=True):
        assert got.dtype == want.dtype == torch.float32
        assert (got - want).abs().max() <= RELATIVE[dtype] * want.abs().max()


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_router_and_teacher_router_stay_float32_under_autocast(dtype):
    layer = _layer(False, None).eval()
    x = torch.randn(8, 32)
    with torch.autocast("cpu", dtype=dtype):
        layer(x)
        teacher = ensemble_output(layer, x)
    exact = torch.nn.functional.linear(x, layer.router.weight)
    assert torch.equal(layer.last_record.logits_TE, exact)       # not a bf16-rounded copy: the same float32 op
    assert teacher.dtype == torch.float32


def test_layer_with_bfloat16_weights_combines_in_float32():
    """Weights in bfloat16, no autocast: experts run in bf16, the router and combine weights in float32, and the
    output comes back in the input's dtype."""
    layer = _layer(True, None)
    layer.experts.to(torch.bfloat16)
    layer.shared_experts.to(torch.bfloat16)
    x = torch.randn(16, 32).to(torch.bfloat16)
    out = layer(x)
    assert out.dtype == torch.bfloat16 and layer.last_record.logits_TE.dtype == torch.float32
    ref = _reference(_layer(True, None), x.float())
    assert (out.float() - ref).abs().max() <= RELATIVE[torch.bfloat16] * ref.abs().max()


class _SyncCounter:
    """Counts the device->host reads Python can observe: tolist, item, and bool/int/float/index of a tensor."""

    NAMES = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__")

    def __init__(self, monkeypatch) -> None:
        self.calls: list[str] = []
        for name in self.NAMES:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, original))

    def _wrap(self, name, original):
        def counted(tensor, *args, **kwargs):
            self.calls.append(name)
            return original(tensor, *args, **kwargs)
        return counted


@pytest.mark.parametrize("shared", [False, True], ids=["routed", "shared"])
def test_dropless_grouped_mm_forward_has_no_host_sync(monkeypatch, shared):
    layer = _layer(shared, None)
    layer.selection_bias.add_(torch.tensor([0.1, 0.0, -0.1, 0.0]))   # an active aux-free bias, too
    x = torch.randn(2, 12, 32)
    layer(x)                                            # warm-up outside the counter
    counter = _SyncCounter(monkeypatch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        layer(x)
    layer(x)
    assert counter.calls == []
    # the counter does see syncs: the per-expert loop reads its counts once per call
    with kernel.forced_kernel_path("loop"):
        layer(x)
    assert "tolist" in counter.calls


def _run_cli(args: list[str]) -> int:
    from upcycle.cli import main

    return main(args)


def test_train_with_bf16_mixed_precision_stays_finite(tiny_lm, tmp_path):
    _, moe, train_txt, held = tiny_lm
    run = tmp_path / "run"
    assert _run_cli(["train", str(moe), str(run), "--data", str(train_txt), "--eval-data", str(held),
                     "--steps", "5", "--batch-size", "4", "--sequence-length", "32", "--mixed-precision", "bf16",
                     "--quiet", "--set", "eval_tokens=64", "--set", "regularizers.load_balance=0.01",
                     "--set", "regularizers.z_loss=0.001"]) == 0
    rows = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "loss" in row]
    assert len(steps) == 5 and all(torch.isfinite(torch.tensor(list(r["loss"].values()))).all() for r in steps)
    assert torch.isfinite(torch.tensor(rows[-1]["eval"]["perplexity"]))


def test_bfloat16_weights_convert_and_train(tiny_lm, tmp_path):
    """--dtype bfloat16 conversion, then training the bfloat16 weights (routers stay float32)."""
    import upcycle
    from upcycle.core.moe import moe_layers

    dense, _, train_txt, held = tiny_lm
    moe = tmp_path / "moe-bf16"
    assert _run_cli(["convert", str(dense), str(moe), "--num-experts", "4", "--top-k", "2", "--dtype", "bfloat16",
                     "--probe-text", str(held), "--quiet"]) == 0
    model = upcycle.load(moe)
    assert model.dtype == torch.bfloat16
    assert all(layer.router.weight.dtype == torch.float32 for layer in moe_layers(model).values())
    run = tmp_path / "run"
    assert _run_cli(["train", str(moe), str(run), "--data", str(train_txt), "--steps", "3", "--batch-size", "4",
                     "--sequence-length", "32", "--mixed-precision", "no", "--quiet", "--set", "eval_tokens=64",
                     "--set", "regularizers.load_balance=0.01"]) == 0
    rows = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    assert all(torch.isfinite(torch.tensor(r["loss"]["total"])) for r in rows if "loss" in r)
    trained = upcycle.load(run / "model")
    assert trained.dtype == torch.bfloat16
    assert all(torch.isfinite(p.float()).all() for p in trained.parameters())

"""Architecture rows (issue 12 item 10): the extracted canonical FFN computes each family's own MLP, and what a
family exports to comes from its row of the table."""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny
from upcycle.core.architectures import family_of
from upcycle.core.ffn import activation_fn
from upcycle.errors import UpcycleError


def _canonical(ffn, x):
    act = activation_fn(ffn.activation)
    h = act(x @ ffn.w_gate.t()) * (x @ ffn.w_up.t()) if ffn.w_gate is not None else act(x @ ffn.w_up.t())
    return h @ ffn.w_down.t()


@pytest.mark.parametrize("kind", ["phi3", "gemma3", "llama"])
def test_extracted_ffn_computes_the_models_own_mlp(kind):
    model = make_tiny(kind)
    family = family_of(model.config)
    block = model.model.layers[1]
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(0))
    ffn = family.extract(block, model.config)
    want = block.mlp(x).detach()
    scale = want.abs().max()            # ~3e-3 at the tiny models' init (std 0.02): bounds are relative to it
    # same matmuls, another association order: float32 rounding, ~1e-7 of the scale; bound 1e-5
    assert (_canonical(ffn, x) - want).abs().max() <= 1e-5 * scale
    if kind == "phi3":          # a swapped split computes something else: measured ~25% of the scale
        swapped = ffn.__class__(w_gate=ffn.w_up, w_up=ffn.w_gate, w_down=ffn.w_down, activation=ffn.activation)
        assert (_canonical(swapped, x) - want).abs().max() > 0.05 * scale
    if kind == "gemma3":
        assert ffn.activation == "gelu_pytorch_tanh"


@pytest.mark.parametrize("kind", ["phi3", "gemma3"])
def test_families_without_a_stock_moe_class_are_not_exported(kind, tmp_path):
    from upcycle import ConvertConfig, MoEConfig, convert

    folder = tmp_path / kind
    make_tiny(kind).save_pretrained(folder)
    with pytest.raises(UpcycleError, match="no stock transformers MoE class"):
        convert(ConvertConfig(model=str(folder), moe=MoEConfig(num_experts=2, top_k=1), export="hf",
                              export_class="qwen2_moe"), tmp_path / "out", progress=False)
    report = convert(ConvertConfig(model=str(folder), moe=MoEConfig(num_experts=2, top_k=1), export="hf"),
                     tmp_path / "auto", progress=False).report
    assert report["export"]["format"] == "upcycle" and "no stock" in report["export"]["why_not_hf"]

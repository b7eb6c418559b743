"""Architecture rows: the extracted canonical FFN computes each family's own MLP, what a
family exports to comes from its row of the table, and a family added to the table alone converts, loads and
calibrates."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

import upcycle
from conftest import make_tiny
from upcycle import ConvertConfig, MoEConfig, convert
from upcycle.config import CalibrationConfig, CheckConfig, PlacementConfig
from upcycle.core import architectures
from upcycle.core.architectures import PIXELS, Family, Tower, family_of
from upcycle.core.ffn import FFNWeights, activation_fn
from upcycle.core.moe import moe_layers
from upcycle.errors import UpcycleError
from upcycle.probe import make_probe, probe_output


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
    folder = tmp_path / kind
    make_tiny(kind).save_pretrained(folder)
    with pytest.raises(UpcycleError, match="no stock transformers MoE class"):
        convert(ConvertConfig(model=str(folder), moe=MoEConfig(num_experts=2, top_k=1), export="hf",
                              export_class="qwen2_moe"), tmp_path / "out", progress=False)
    report = convert(ConvertConfig(model=str(folder), moe=MoEConfig(num_experts=2, top_k=1), export="hf"),
                     tmp_path / "auto", progress=False).report.to_dict()
    assert report["export"]["format"] == "upcycle" and "no stock" in report["export"]["why_not_hf"]


# A family added at test time through the table alone: StarCoder2, a transformers decoder the
# package does not support, whose MLP is neither gated nor bias-free nor GPT-2's Conv1D: nn.Linear c_fc / c_proj
# with biases, GELU, and a residual dropout of its own. Its row (the two functions below and the `Family`) is the
# only change; convert, load, calibration and the cluster method must then work with no other code touched.
def _starcoder2_extract(block, cfg) -> FFNWeights:
    mlp = block.mlp
    return FFNWeights(w_up=mlp.c_fc.weight.detach(), b_up=mlp.c_fc.bias.detach(),
                      w_down=mlp.c_proj.weight.detach(), b_down=mlp.c_proj.bias.detach(), activation=cfg.hidden_act)


def _set_mlp(block, moe) -> None:
    block.mlp = moe


STARCODER2 = Family("starcoder2", ("starcoder2",), {"text": Tower("layers", 1)}, _starcoder2_extract, _set_mlp,
                    output_dropout=lambda cfg: cfg.residual_dropout)


def _tiny_starcoder2(folder):
    """A 4-block random StarCoder2 (hidden 32, FFN 64, vocab 128) saved as a local folder (no tokenizer)."""
    import transformers as T

    torch.manual_seed(0)
    model = T.Starcoder2ForCausalLM(T.Starcoder2Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, residual_dropout=0.1, bos_token_id=1, eos_token_id=2))
    model.save_pretrained(folder)
    return model.eval()


@pytest.fixture
def with_starcoder2(monkeypatch):
    monkeypatch.setattr(architectures, "FAMILIES", (*architectures.FAMILIES, STARCODER2))


def test_an_unsupported_model_type_is_refused_with_the_tables_list(tmp_path):
    _tiny_starcoder2(tmp_path / "sc2")
    listed = ", ".join(t for family in architectures.FAMILIES for t in family.model_types)
    assert listed.startswith("llama, mistral, qwen2, qwen3, gemma3_text, phi3, gpt2, bert, clip")
    with pytest.raises(UpcycleError) as refused:
        convert(ConvertConfig(model=str(tmp_path / "sc2")), tmp_path / "out", progress=False)
    assert str(refused.value) == f"unsupported architecture 'starcoder2'; supported model types: {listed}"
    assert not (tmp_path / "out").exists()


def test_a_family_added_only_to_the_table_converts_loads_and_calibrates(tmp_path, with_starcoder2):
    dense = _tiny_starcoder2(tmp_path / "sc2")
    block = dense.model.layers[1]
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(0))
    want = block.mlp(x).detach()
    # the row's extraction (biases included) computes the model's own MLP: float32 rounding, ~1e-7 of the scale
    assert (STARCODER2.extract(block, dense.config)(x) - want).abs().max() <= 1e-5 * want.abs().max()

    cfg = ConvertConfig(model=str(tmp_path / "sc2"), moe=MoEConfig(num_experts=4, top_k=2),
                        placement=PlacementConfig(every=2), check=CheckConfig(tokens=16))
    result = convert(cfg, tmp_path / "copy", progress=False)
    r = result.report.to_dict()
    assert r["model_type"] == "starcoder2" and r["moe_layers"] == ["text.1", "text.3"]
    p = r["preservation"]
    assert p["promised"] and p["passed"] and p["compared_output"] == "logits"
    assert r["max_abs_logit_diff"] <= p["allowed_max_abs_logit_diff"]
    layers = moe_layers(result.model)
    assert len(layers) == 2 and all(layer.dropout.p == 0.1 for layer in layers.values())   # the row's dropout

    loaded = upcycle.load(tmp_path / "copy")
    assert type(loaded).__name__ == "Starcoder2ForCausalLM" and set(moe_layers(loaded)) == set(layers)
    probe = make_probe(loaded, None, None, CheckConfig(tokens=16), seed=3)
    assert torch.equal(probe_output(loaded, probe).values_NC, probe_output(result.model, probe).values_NC)

    # cluster: calibration replays the row's blocks and hooks its FFN input; padding is excluded
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 128, (12, 16), generator=g)
    mask = torch.ones_like(ids)
    mask[::3, 10:] = 0
    save_file({"input_ids": ids, "attention_mask": mask}, tmp_path / "calibration.safetensors")
    cfg = ConvertConfig(model=str(tmp_path / "sc2"), method="cluster", moe=MoEConfig(num_experts=4, top_k=1),
                        placement=PlacementConfig(every=2), check=CheckConfig(tokens=16),
                        calibration=CalibrationConfig(data=str(tmp_path / "calibration.safetensors"), batch_size=5))
    clustered = convert(cfg, tmp_path / "cluster", progress=False)
    for layer in clustered.report.to_dict()["layers"]:
        assert layer["calibration_tokens_kept"] == layer["calibration_tokens_seen"] == int(mask.sum())
        assert layer["router_cluster_agreement"] == 1.0
    reloaded = upcycle.load(tmp_path / "cluster")
    assert torch.equal(probe_output(reloaded, probe).values_NC, probe_output(clustered.model, probe).values_NC)


# A second family added through the table alone, one that reads pixels: ViT (transformers 5 lays out ViTModel as
# `layers`, each block's `mlp` = fc1, GELU, fc2). Its tower is named "image" on purpose: nothing may key on the
# tower's name; what it reads (pixels), its lack of a padding mask and its sizes come from the row.
def _vit_extract(block, cfg) -> FFNWeights:
    mlp = block.mlp
    return FFNWeights(w_up=mlp.fc1.weight.detach(), b_up=mlp.fc1.bias.detach(), w_down=mlp.fc2.weight.detach(),
                      b_down=mlp.fc2.bias.detach(), activation=cfg.hidden_act)


VIT = Family("vit", ("vit",), {"image": Tower("layers", None, input=PIXELS)}, _vit_extract, _set_mlp,
             auto_class="AutoModel")


def test_an_image_family_added_only_to_the_table_probes_checks_and_calibrates_on_pixels(tmp_path, monkeypatch):
    import transformers as T

    monkeypatch.setattr(architectures, "FAMILIES", (*architectures.FAMILIES, VIT))
    torch.manual_seed(0)
    T.ViTModel(T.ViTConfig(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=64,
                           image_size=16, patch_size=8, num_channels=2)).save_pretrained(tmp_path / "vit")
    base = dict(model=str(tmp_path / "vit"), moe=MoEConfig(num_experts=4, top_k=2), placement=PlacementConfig(every=2))
    result = convert(ConvertConfig(**base, check=CheckConfig(sequences=3)), tmp_path / "copy", progress=False)
    r = result.report.to_dict()
    assert r["moe_layers"] == ["image.1", "image.3"]
    p = r["preservation"]
    assert p["probe_source"] == "random pixels" and p["probe_shape"] == [3, 2, 16, 16]   # the config's sizes
    assert p["promised"] and p["passed"] and p["compared_output"] == "last_hidden_state"
    assert p["compared_rows"] == 3 * 5 and r["kl_to_dense"] is None       # 4 patches + CLS per image, no mask
    loaded = upcycle.load(tmp_path / "copy")
    probe = make_probe(loaded, None, None, CheckConfig(sequences=3), seed=1)
    assert set(probe.inputs) == {"pixel_values"}
    # compared on the device the conversion ran on (a GPU with --device auto): the same kernels, the same bits
    loaded.to(next(result.model.parameters()).device)
    assert torch.equal(probe_output(loaded, probe).values_NC, probe_output(result.model, probe).values_NC)

    text = tmp_path / "text.txt"
    text.write_text("words, not images")
    with pytest.raises(UpcycleError, match="is a vision model, which calibrates on images, not text"):
        convert(ConvertConfig(**base, method="cluster", calibration=CalibrationConfig(data=str(text))),
                tmp_path / "o1", progress=False)
    save_file({"input_ids": torch.zeros(2, 4, dtype=torch.long)}, tmp_path / "ids.safetensors")
    with pytest.raises(UpcycleError, match="needs pixel_values in every batch"):
        convert(ConvertConfig(**base, method="cluster",
                              calibration=CalibrationConfig(data=str(tmp_path / "ids.safetensors"))),
                tmp_path / "o3", progress=False)

    save_file({"pixel_values": torch.randn(12, 2, 16, 16, generator=torch.Generator().manual_seed(0))},
              tmp_path / "images.safetensors")
    clustered = convert(ConvertConfig(**base | {"moe": MoEConfig(num_experts=4, top_k=1)}, method="cluster",
                                      calibration=CalibrationConfig(data=str(tmp_path / "images.safetensors"),
                                                                    batch_size=5)),
                        tmp_path / "cluster", progress=False).report.to_dict()
    for layer in clustered["layers"]:
        assert layer["calibration_tokens_kept"] == 12 * 5 and layer["router_cluster_agreement"] == 1.0
    assert not any((tmp_path / name).exists() for name in ("o1", "o3"))

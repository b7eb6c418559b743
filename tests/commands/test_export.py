"""Export to stock transformers MoE classes: loads with plain AutoModelForCausalLM, same logits, generates."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as T

import upcycle
from conftest import make_tiny
from upcycle.cli import main
from upcycle.config import ConvertConfig
from upcycle.config_reader import build
from upcycle.conversion.pipeline import convert, upcycle_model
from upcycle.core.ffn import FFNWeights
from upcycle.core.moe import MoELayer, moe_layers
from upcycle.errors import UpcycleError
from upcycle.export.qwen2_moe import SHARED_GATE
from upcycle.export.stock_folder import export_hf

DECODERS = ("llama", "mistral", "qwen2", "qwen3")
IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))


def cfg(model, **data) -> ConvertConfig:
    base = {"model": str(model), "moe": {"num_experts": 4, "top_k": 2}, "check": {"tokens": 16}, "export": "hf"}
    return build(ConvertConfig, {**base, **data})


def stock_logits_match(folder, ours: torch.nn.Module) -> T.PreTrainedModel:
    stock, info = T.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not any(info.values()), info          # no missing, unexpected or mismatched tensor
    with torch.no_grad():
        # ours is where the conversion ran (the GPU when there is one: device auto); compared on the CPU
        ours_logits = ours.eval()(input_ids=IDS.to(ours.device)).logits.cpu()
        diff = (stock.eval()(input_ids=IDS).logits - ours_logits).abs().max().item()
    assert diff <= 1e-5
    out = stock.generate(IDS[:, :4], max_new_tokens=4, do_sample=False)
    assert out.shape == (2, 8)
    return stock


@pytest.fixture(params=DECODERS)
def decoder_path(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    make_tiny(request.param).save_pretrained(path)
    return request.param, path


@pytest.mark.parametrize("method", ["copy", "noise", "drop"])
def test_every_method_and_decoder_exports_to_a_stock_class(decoder_path, tmp_path, method):
    kind, path = decoder_path
    result = convert(cfg(path, method=method, placement={"every": 2}), tmp_path / "out", progress=False)
    export = result.report.to_dict()["export"]
    expected = "Qwen3MoeForCausalLM" if kind == "qwen3" else "Qwen2MoeForCausalLM"
    assert export["format"] == "hf" and export["class"] == expected and export["dense_layers"] == [0, 2]
    assert export["max_abs_logit_diff_vs_upcycle"] <= 1e-5
    stock = stock_logits_match(tmp_path / "out", result.model)
    assert type(stock).__name__ == expected
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    for key in ("num_experts", "num_local_experts", "rope_theta", "rope_parameters", "torch_dtype", "mlp_only_layers",
                "router_aux_loss_coef", "transformers_version"):
        assert key in config
    assert config["norm_topk_prob"] is True and config["moe_intermediate_size"] == 64
    if kind != "qwen3":      # no shared expert: a width-1 one with zero weights, whose output is exactly zero
        assert config["shared_expert_intermediate_size"] == 1
    assert not (tmp_path / "out" / "upcycle_config.json").exists()
    assert json.loads((tmp_path / "out" / "upcycle_report.json").read_text())["export"]["class"] == expected


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_mixtral_when_every_block_is_moe(kind, tmp_path):
    model = make_tiny(kind)
    model.save_pretrained(tmp_path / "m")
    result = convert(cfg(tmp_path / "m", method="drop", export_class="mixtral"), tmp_path / "out", progress=False)
    assert result.report.to_dict()["export"]["class"] == "MixtralForCausalLM"
    stock_logits_match(tmp_path / "out", result.model)


def test_mixtral_refusals(tmp_path):
    model = make_tiny("llama")
    model.save_pretrained(tmp_path / "m")
    with pytest.raises(UpcycleError, match="Mixtral needs every block"):
        convert(cfg(tmp_path / "m", export_class="mixtral", placement={"every": 2}), tmp_path / "o", progress=False)
    make_tiny("qwen3").save_pretrained(tmp_path / "q")
    with pytest.raises(UpcycleError, match="qwen3 source exports to"):
        convert(cfg(tmp_path / "q", export_class="mixtral"), tmp_path / "o", progress=False)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("num_shared", [1, 2])
def test_shared_expert_gate_scale_is_folded(tmp_path, num_shared):
    """Qwen2-MoE multiplies its shared expert by sigmoid(0) = 0.5: the export writes its down projection x2."""
    model = make_tiny("llama")
    upcycle_model(model, build(ConvertConfig, {"method": "noise", "moe": {"num_experts": 4, "top_k": 2},
                                               "check": {"tokens": 16}}), progress=False)
    g = torch.Generator().manual_seed(1)
    for name, layer in moe_layers(model).items():
        shared = FFNWeights(w_up=torch.randn(num_shared, 48, 32, generator=g) * 0.1,
                            w_gate=torch.randn(num_shared, 48, 32, generator=g) * 0.1,
                            w_down=torch.randn(num_shared, 32, 48, generator=g) * 0.1, activation="silu")
        new = MoELayer.from_init(layer.experts.weights(), layer.router.weight.detach(), top_k=2, shared=shared)
        model.get_submodule(name.rsplit(".", 1)[0]).mlp = new
    info = export_hf(model, tmp_path, input_ids=IDS, tolerance=1e-5)
    assert [f["scale"] for f in info["folded_scales"]] == [2.0] * 4
    assert json.loads((tmp_path / "config.json").read_text())["shared_expert_intermediate_size"] == 48 * num_shared
    stock_logits_match(tmp_path, model)


@pytest.mark.parametrize("family", ["gpt2", "bert", "clip"])
def test_no_stock_class_keeps_the_upcycle_format_and_says_why(family, tmp_path, capsys):
    make_tiny(family).save_pretrained(tmp_path / "m")
    result = convert(cfg(tmp_path / "m"), tmp_path / "out", progress=False)
    assert result.report.to_dict()["export"]["format"] == "upcycle"
    assert f"no stock transformers MoE class computes a '{family}'" in result.report.to_dict()["export"]["why_not_hf"]
    captured = capsys.readouterr()
    assert "not exported to a stock class" in captured.out + captured.err
    assert (tmp_path / "out" / "upcycle_config.json").exists()
    upcycle.load(tmp_path / "out")


def test_unrepresentable_routing_keeps_the_upcycle_format(tmp_path):
    make_tiny("llama").save_pretrained(tmp_path / "m")
    result = convert(cfg(tmp_path / "m", moe={"num_experts": 4, "top_k": 2, "capacity_factor_eval": 2.0}),
                     tmp_path / "out", progress=False)
    assert "expert capacity" in result.report.to_dict()["export"]["why_not_hf"]
    assert (tmp_path / "out" / "upcycle_config.json").exists()


def test_export_command_round_trip_and_refusals(tmp_path, capsys):
    make_tiny("qwen2").save_pretrained(tmp_path / "m")
    convert(build(ConvertConfig, {"model": str(tmp_path / "m"), "method": "drop", "placement": {"every": 2},
                                  "moe": {"num_experts": 4, "top_k": 2}, "check": {"tokens": 16}}),
            tmp_path / "up", progress=False)
    assert main(["export", str(tmp_path / "up"), str(tmp_path / "hf")]) == 0
    assert "AutoModelForCausalLM" in capsys.readouterr().out
    stock_logits_match(tmp_path / "hf", upcycle.load(tmp_path / "up"))
    report = json.loads((tmp_path / "hf" / "upcycle_report.json").read_text())
    assert report["method"] == "drop" and report["export"]["class"] == "Qwen2MoeForCausalLM"
    # the way back is refused with a pointer to transformers
    with pytest.raises(UpcycleError, match="stock transformers qwen2_moe checkpoint.*AutoModelForCausalLM"):
        upcycle.load(tmp_path / "hf")
    assert main(["export", str(tmp_path / "up"), str(tmp_path / "hf")]) == 2          # exists
    assert main(["export", str(tmp_path / "up"), str(tmp_path / "x"), "--export-class", "mixtral"]) == 2
    assert "a qwen2 source exports to" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_cli_convert_export_hf(tmp_path, capsys):
    make_tiny("qwen3").save_pretrained(tmp_path / "m")
    assert main(["convert", str(tmp_path / "m"), str(tmp_path / "out"), "--export", "hf", "--every", "2",
                 "--num-experts", "4", "--set", "check.tokens=8", "--quiet"]) == 0
    summary = json.loads(capsys.readouterr().out.split("\nwrote")[0])
    assert summary["export"]["class"] == "Qwen3MoeForCausalLM"
    T.AutoModelForCausalLM.from_pretrained(tmp_path / "out")


def test_raw_topk_weights_and_any_placement(tmp_path):
    """norm_topk_prob follows normalize_topk; mlp_only_layers takes any placement, not only every n-th."""
    make_tiny("mistral", layers=5).save_pretrained(tmp_path / "m")
    result = convert(cfg(tmp_path / "m", method="noise", placement={"layers": [0, 3, 4]},
                         moe={"num_experts": 4, "top_k": 2, "normalize_topk": False}), tmp_path / "out",
                     progress=False)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["norm_topk_prob"] is False and config["mlp_only_layers"] == [1, 2]
    stock_logits_match(tmp_path / "out", result.model)


def test_granular_exports_with_its_fold_in_the_weights(tmp_path):
    make_tiny("llama").save_pretrained(tmp_path / "m")
    result = convert(cfg(tmp_path / "m", method="granular", method_args={"granularity": 2}, export_class="qwen2_moe"),
                     tmp_path / "out", progress=False)
    report = result.report.to_dict()
    assert report["folded_scales"] and report["export"]["class"] == "Qwen2MoeForCausalLM"
    assert json.loads((tmp_path / "out" / "config.json").read_text())["moe_intermediate_size"] == 32
    stock_logits_match(tmp_path / "out", result.model)


def test_config_holds_what_the_class_needs_not_every_default(tmp_path):
    """As save_pretrained of a fresh stock model writes it: no id2label, problem_type, output_attentions..."""
    make_tiny("llama").save_pretrained(tmp_path / "m")
    for cls in ("qwen2_moe", "mixtral"):
        convert(cfg(tmp_path / "m", export_class=cls), tmp_path / cls, progress=False)
        config = json.loads((tmp_path / cls / "config.json").read_text())
        for noise in ("id2label", "label2id", "problem_type", "output_attentions", "return_dict", "_name_or_path"):
            assert noise not in config, (cls, noise)
        assert config["transformers_version"] == T.__version__ and config["router_aux_loss_coef"] == 0.001
        assert config["model_type"] == cls and config["num_hidden_layers"] == 4 and config["hidden_size"] == 32
        assert len(config) < 40, sorted(config)      # 58 keys when every default was dumped


def test_no_shared_expert_loads_without_warnings_and_stays_zero_under_training(tmp_path, recwarn):
    """Qwen2-MoE blocks always hold a shared expert: without one the export writes a width-1 shared expert of
    zeros (not width 0, whose every load warns "Initializing zero-element tensors is a no-op") and a gate of
    SHARED_GATE (nonzero for llama.cpp's silu(z)/z). Its output and every gradient of it and of its gate are
    exactly zero, so training leaves it a no-op."""
    make_tiny("llama").save_pretrained(tmp_path / "m")
    result = convert(cfg(tmp_path / "m", method="drop", export_class="qwen2_moe"), tmp_path / "out", progress=False)
    recwarn.clear()
    stock = stock_logits_match(tmp_path / "out", result.model).train()
    assert not [w for w in recwarn if "zero-element" in str(w.message)]
    assert all(p.numel() > 0 for p in stock.parameters())
    stock(input_ids=IDS, labels=IDS).loss.backward()
    shared = [(n, p) for n, p in stock.named_parameters() if "shared_expert" in n]
    assert len(shared) == 4 * 4                          # gate, up, down, and the sigmoid gate of 4 blocks
    for name, p in shared:
        value = SHARED_GATE if name.endswith("shared_expert_gate.weight") else 0.0
        assert torch.equal(p, torch.full_like(p, value)) and torch.count_nonzero(p.grad) == 0, name


@pytest.mark.parametrize("export", ["hf", "upcycle"])
def test_tokenizer_is_written_with_a_class_every_transformers_loads(tmp_path, export):
    """transformers 5 saves its fast tokenizer as "TokenizersBackend", unknown to 4.x: the export writes
    PreTrainedTokenizerFast (tests/commands/test_export_transformers4.py loads it there); here it loads the same."""
    from conftest import write_tiny_lm

    dense, _, held = write_tiny_lm(tmp_path / "lm")
    result = convert(cfg(dense, check={"tokens": 16, "text": str(held)}, export=export), tmp_path / "out",
                     progress=False)
    assert json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())["tokenizer_class"] == \
        "PreTrainedTokenizerFast"
    tokenizer = T.AutoTokenizer.from_pretrained(tmp_path / "out")
    text = "the cat sat on the mat."
    assert tokenizer(text)["input_ids"] == T.AutoTokenizer.from_pretrained(dense)(text)["input_ids"]
    assert tokenizer(text)["input_ids"] == result.tokenizer(text)["input_ids"]
    if export == "hf":
        generator = T.pipeline("text-generation", model=str(tmp_path / "out"))
        out = generator("the cat", max_new_tokens=3, do_sample=False)[0]["generated_text"]
        assert out.startswith("the cat")


@pytest.mark.parametrize("streaming", [False, True])
def test_a_tied_source_exports_to_qwen2_moe_with_its_own_head(tmp_path, streaming):
    """llama.cpp's converter leaves a tied head out and its qwen2moe graph requires one, so a tied source (as
    SmolLM2 is) is exported to Qwen2-MoE untied: the head a copy of the embeddings, config.json saying so, the
    same logits in transformers. Mixtral keeps the tie (llama.cpp's llama arch falls back to the embeddings)."""
    from safetensors import safe_open

    from conftest import make_tiny

    model = make_tiny("llama")
    model.config.tie_word_embeddings = True
    model.tie_weights()
    model.save_pretrained(tmp_path / "dense")
    result = convert(cfg(tmp_path / "dense", export_class="qwen2_moe", **({"streaming": True} if streaming else {})),
                     tmp_path / "out", progress=False)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("lm_head.weight"), f.get_tensor("model.embed_tokens.weight"))
    stock = stock_logits_match(tmp_path / "out", result.model)
    assert stock.lm_head.weight.data_ptr() != stock.model.embed_tokens.weight.data_ptr()
    convert(cfg(tmp_path / "dense", export_class="mixtral"), tmp_path / "mixtral", progress=False)
    assert json.loads((tmp_path / "mixtral" / "config.json").read_text())["tie_word_embeddings"] is True


def test_auto_picks_a_class_llama_cpp_reads_as_transformers_does_and_a_named_one_says_where_it_does_not(tmp_path,
                                                                                                           capsys):
    """Renormalized top-k (the default) on every block: Qwen2-MoE computes it in transformers, but llama.cpp's
    qwen2moe (through its own convert_hf_to_gguf.py too) never renormalizes, so `auto` writes Mixtral, which
    llama.cpp's llama arch reads the same way. Named, or where Mixtral cannot express the model (dense blocks
    between), Qwen2-MoE is written and the report and stderr say what llama.cpp computes and the route that works;
    raw top-k is Qwen2-MoE's own reading, with no note."""
    make_tiny("llama").save_pretrained(tmp_path / "m")
    every = convert(cfg(tmp_path / "m"), tmp_path / "every", progress=False).report.to_dict()["export"]
    assert every["class"] == "MixtralForCausalLM" and "runtimes_note" not in every
    for name, extra in (("named", {"export_class": "qwen2_moe"}), ("half", {"placement": {"every": 2}})):
        capsys.readouterr()
        entry = convert(cfg(tmp_path / "m", **extra), tmp_path / name, progress=False).report.to_dict()["export"]
        assert entry["class"] == "Qwen2MoeForCausalLM", name
        note = entry["runtimes_note"]
        assert "llama.cpp's qwen2moe uses top-k weights raw where this model renormalizes them" in note
        assert "--export-class mixtral" in note and "--set moe.normalize_topk=false" in note
        assert f"[upcycle] note: {note}" in capsys.readouterr().err
    raw = convert(cfg(tmp_path / "m", moe={"num_experts": 4, "top_k": 2, "normalize_topk": False}), tmp_path / "raw",
                  progress=False).report.to_dict()["export"]
    assert raw["class"] == "Qwen2MoeForCausalLM" and "runtimes_note" not in raw

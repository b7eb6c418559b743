"""An upcycle folder cannot be misread by transformers: the Auto classes load it as `upcycle.load` does or refuse it,
`upcycle.save` and `save_pretrained` round-trip to identical logits, and peft's all-linear LoRA leaves routing alone."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file

import upcycle
from conftest import make_tiny
from upcycle.config import ConvertConfig
from upcycle.config_reader import build
from upcycle.core.moe import moe_layers

ROOT = Path(__file__).resolve().parents[2]


def upcycled(kind: str, *, experts: int = 4, seed: int = 0):
    model = make_tiny(kind, seed=seed)
    cfg = build(ConvertConfig, {"model": kind, "method": "noise", "seed": seed,
                                "moe": {"num_experts": experts, "top_k": 2}})
    upcycle.upcycle_model(model, cfg, progress=False)
    return model.eval()


def ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(seed))


def logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=input_ids)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2"])
def test_save_load_and_every_auto_path_give_identical_logits(tmp_path, kind):
    model, x = upcycled(kind), ids()
    reference = logits(model, x)
    upcycle.save(model, tmp_path / "a")
    loaded = upcycle.load(tmp_path / "a")
    assert torch.equal(logits(loaded, x), reference)
    auto = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    assert type(auto).__name__ == type(model).__name__ and len(moe_layers(auto)) == len(moe_layers(model))
    assert torch.equal(logits(auto, x), reference)
    auto.save_pretrained(tmp_path / "b")                 # transformers' own verb on the loaded model
    assert torch.equal(logits(upcycle.load(tmp_path / "b"), x), reference)
    # the folder says what it is, and transformers reads the base config from it
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["model_type"] == "upcycle" and config["base_config"]["model_type"] == model.config.model_type
    # AutoModel gives base classes (BertModel); an LM head's folder is refused, never half-loaded
    with pytest.raises(upcycle.UpcycleError, match="upcycle.load"):
        transformers.AutoModel.from_pretrained(tmp_path / "a")


def test_an_encoder_folder_loads_through_auto_model(tmp_path):
    model, x = upcycled("bert"), ids()
    upcycle.save(model, tmp_path / "bert")
    auto = transformers.AutoModel.from_pretrained(tmp_path / "bert")
    assert type(auto).__name__ == "BertModel" and torch.equal(logits(auto, x), logits(model, x))
    with pytest.raises(upcycle.UpcycleError, match="AutoModelForCausalLM does not give"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bert")


def test_dtype_and_loading_info_arguments_are_honoured(tmp_path):
    upcycle.save(upcycled("llama"), tmp_path / "m")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.bfloat16,
                                                                     output_loading_info=True)
    assert model.dtype == torch.bfloat16 and not any(info.values())
    with pytest.raises(upcycle.UpcycleError, match="quantization_config"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m", quantization_config={"x": 1})


def test_the_arguments_lm_eval_passes_load_the_folder_and_only_what_cannot_be_honoured_is_refused(tmp_path):
    """lm-eval's `hf` model (0.4.13, HFLM._create_model) calls from_pretrained with revision, dtype,
    trust_remote_code, gguf_file=None, quantization_config=None, subfolder="", device_map={"": device},
    max_memory=None and offload_folder: the folder loads, the same model; a value upcycle cannot honour (a GGUF
    file, a quantization, a model split over devices) is refused naming it, and an unknown argument too."""
    model, x = upcycled("llama"), ids()
    upcycle.save(model, tmp_path / "m")
    lm_eval_arguments = dict(revision="main", dtype=torch.float32, trust_remote_code=False, gguf_file=None,
                             quantization_config=None, subfolder="", device_map={"": "cpu"}, max_memory=None,
                             offload_folder="./offload")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m", **lm_eval_arguments)
    assert torch.equal(logits(loaded, x), logits(model, x))
    from upcycle.checkpoint.auto_classes import UpcycleForCausalLM

    # transformers reads a gguf_file's config itself before it reaches upcycle's class: asked of the class
    with pytest.raises(upcycle.UpcycleError, match=re.escape("cannot honour gguf_file='model.gguf'")):
        UpcycleForCausalLM.from_pretrained(tmp_path / "m", **{**lm_eval_arguments, "gguf_file": "model.gguf"})
    for change, said in (({"max_memory": {0: "10GB"}}, "cannot honour max_memory="),
                         ({"load_in_8bit": True}, "cannot honour load_in_8bit=True"),
                         ({"device_map": {"model.embed_tokens": "cpu", "lm_head": "cpu"}}, "several devices"),
                         ({"bogus": 1}, "takes transformers' arguments; not bogus")):
        with pytest.raises(upcycle.UpcycleError, match=re.escape(said)):
            transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m", **{**lm_eval_arguments, **change})


CHECK = """
import sys, torch, transformers
from safetensors.torch import load_file
{imports}
folder, expected = sys.argv[1], load_file(sys.argv[2])
try:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
except Exception as e:
    print("refused:", type(e).__name__, " ".join(str(e).split())[:200])
else:
    with torch.no_grad():
        out = model(input_ids=expected["ids"]).logits
    print("loaded, max abs logit difference", (out - expected["logits"]).abs().max().item())
"""


@pytest.mark.parametrize("imports, expected", [
    ("", "refused: ValueError"),                                     # transformers alone: an unknown model type
    ("import upcycle", "loaded"),             # registered when transformers' Auto module is imported after it
])
def test_transformers_loads_the_same_model_or_refuses_in_a_fresh_interpreter(tmp_path, imports, expected):
    model, x = upcycled("llama"), ids()
    upcycle.save(model, tmp_path / "m")
    save_file({"ids": x, "logits": logits(model, x)}, tmp_path / "expected.safetensors")
    run = subprocess.run([sys.executable, "-c", CHECK.format(imports=imports), str(tmp_path / "m"),
                          str(tmp_path / "expected.safetensors")], capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().startswith(expected), run.stdout
    if expected == "loaded":
        # the same weights and ids in another process, whose thread count may differ (summation order): float32
        # logits of O(1) agree to ~1e-6; a model with random MLPs differs by ~0.4 (the trap this format removes)
        assert float(run.stdout.split()[-1]) < 1e-4, run.stdout
    if not imports:
        assert "`upcycle`" in run.stdout        # the message names the model type a user can search for


def test_save_refuses_what_it_did_not_write_and_save_pretrained_keeps_other_files(tmp_path):
    model = upcycled("llama")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.txt").write_text("precious")
    with pytest.raises(upcycle.UpcycleError):
        upcycle.save(model, tmp_path / "mine", overwrite=True)
    assert (tmp_path / "mine" / "thesis.txt").read_text() == "precious"
    upcycle.save(model, tmp_path / "out")
    with pytest.raises(upcycle.UpcycleError, match="exists"):
        upcycle.save(model, tmp_path / "out")
    upcycle.save(model, tmp_path / "out", overwrite=True)
    # save_pretrained writes into a folder that holds other files (a Trainer checkpoint's), keeping them, and
    # replaces an earlier save's shards (three shards, then one file: the stale shards and index go)
    ckpt = tmp_path / "checkpoint-10"
    ckpt.mkdir()
    (ckpt / "trainer_state.json").write_text("{}")
    model.save_pretrained(ckpt, max_shard_size=20_000)
    assert len(list(ckpt.glob("model-*-of-*.safetensors"))) > 1 and (ckpt / "model.safetensors.index.json").exists()
    model.save_pretrained(ckpt)
    assert sorted(p.name for p in ckpt.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                       "trainer_state.json", "upcycle_config.json"]
    x = ids()
    assert torch.equal(logits(upcycle.load(ckpt), x), logits(model, x))
    # a folder holding a transformers model upcycle did not write is refused, not overwritten
    dense = make_tiny("llama")
    dense.save_pretrained(tmp_path / "dense")
    before = (tmp_path / "dense" / "model.safetensors").read_bytes()
    with pytest.raises(upcycle.UpcycleError, match="did not write"):
        model.save_pretrained(tmp_path / "dense")
    assert (tmp_path / "dense" / "model.safetensors").read_bytes() == before
    with pytest.raises(upcycle.UpcycleError, match="no upcycle MoE layers"):
        upcycle.save(dense, tmp_path / "dense2")


def test_peft_all_linear_lora_trains_without_touching_the_routing():
    peft = pytest.importorskip("peft", reason="peft is not installed (pip install peft)")
    model, x = upcycled("llama", experts=4), ids()
    reference = logits(model, x)
    routes = [layer.last_record.topk_ids_TK.clone() for layer in moe_layers(model).values()]
    lora = peft.get_peft_model(model, peft.LoraConfig(target_modules="all-linear", r=4, lora_alpha=8))
    wrapped = {name.rsplit(".", 1)[-1] for name, module in lora.named_modules() if hasattr(module, "lora_A")}
    assert {"q_proj", "v_proj"} <= wrapped and "router" not in wrapped      # attention adapted, routers left alone
    layers = list(moe_layers(lora).values())
    assert len(layers) == len(routes)
    out = lora(input_ids=x, labels=x)
    assert torch.equal(out.logits.detach(), reference)           # LoRA's B starts at zero: the same function
    for layer, before in zip(layers, routes, strict=True):
        assert torch.equal(layer.last_record.topk_ids_TK, before)
    out.loss.backward()
    grads = [p.grad for n, p in lora.named_parameters() if "lora_B" in n]
    assert grads and all(g is not None for g in grads) and any(g.abs().sum() > 0 for g in grads)
    assert all(p.grad is None for n, p in lora.named_parameters() if "router" in n or "experts" in n)


def test_a_format_1_folder_loads_and_saves_as_a_folder_transformers_cannot_misread(tmp_path):
    """Format 1 (config.json the dense model's own) is the trap this format removes: it still loads here, and
    saving it again writes format 2, which transformers loads to the same logits."""
    old = Path(__file__).parents[1] / "fixtures" / "pre_layout" / "moe"
    assert json.loads((old / "upcycle_config.json").read_text())["format_version"] == 1
    model, x = upcycle.load(old), ids()
    upcycle.save(model, tmp_path / "new")
    assert json.loads((tmp_path / "new" / "upcycle_config.json").read_text())["format_version"] == 2
    auto = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "new")
    assert torch.equal(logits(auto, x), logits(model, x))


def test_an_upcycle_folders_tokenizer_serves_generate_with_the_models_length(tmp_path):
    """The tokenizer of an upcycle folder, whose config.json nests the model's: causal-LM inputs only (no
    token_type_ids for generate to refuse) and, for a tokenizer without a length, the model's positions."""
    from test_export_tokenizer import toy_tokenizer

    model = upcycled("llama")
    upcycle.save(model, tmp_path / "m", tokenizer=toy_tokenizer(max_length=None))
    written = json.loads((tmp_path / "m" / "tokenizer_config.json").read_text())
    assert written["model_input_names"] == ["input_ids", "attention_mask"]
    assert written["model_max_length"] == model.config.max_position_embeddings == 64
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "m")
    auto = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    out = auto.generate(**tokenizer("the cat sat", return_tensors="pt"), max_new_tokens=3, do_sample=False)
    assert out.shape[1] == tokenizer("the cat sat", return_tensors="pt")["input_ids"].shape[1] + 3

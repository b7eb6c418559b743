"""Exported tokenizers serve `model.generate(**tok(prompt, return_tensors="pt"))` on every stock class.

transformers 4.57's PreTrainedTokenizerFast returns token_type_ids unless tokenizer_config.json names the model's
inputs, and generate() refuses them; a source tokenizer without a length (int(1e30)) must get the model's. The
same calls run under transformers 4.57 in tests/commands/test_export_transformers4.py; here under the installed 5.x.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers as T

from conftest import TOY_WORDS, make_tiny
from upcycle.checkpoint.upcycle_format import save_tokenizer
from upcycle.config import ConvertConfig
from upcycle.config_reader import build
from upcycle.conversion.pipeline import upcycle_model
from upcycle.data.clip_pairs import caption_tokenizer
from upcycle.export.stock_folder import export_hf

IDS = torch.randint(4, 26, (1, 6), generator=torch.Generator().manual_seed(0))
STOCK_EXPORTS = {  # stock class: (source, placement every n-th block, export class)
    "Qwen2MoeForCausalLM": ("llama", 2, "auto"),
    "Qwen3MoeForCausalLM": ("qwen3", 2, "auto"),
    "MixtralForCausalLM": ("mistral", 1, "mixtral"),
}


def toy_tokenizer(max_length: int | None = 64):
    """The word-level tokenizer of conftest.write_tiny_lm (ids < 128, the tiny models' vocabulary); `None`:
    without a length, as transformers gives int(1e30) to a tokenizer whose files name none (SmolLM2's)."""
    tokenizer = caption_tokenizer([" ".join(TOY_WORDS) + "."], max_length=max_length or 64)
    if max_length is None:
        tokenizer.model_max_length = int(1e30)
    return tokenizer


def exported(kind: str, every: int, export_class: str, folder, tokenizer) -> torch.nn.Module:
    """A tiny `kind` model copy-upcycled (4 experts, top-2, every `every`-th block) and exported to `folder`."""
    model = make_tiny(kind)
    upcycle_model(model, build(ConvertConfig, {"method": "drop", "moe": {"num_experts": 4, "top_k": 2},
                                               "placement": {"every": every}, "check": {"tokens": 16}}),
                  progress=False)
    folder.mkdir()
    export_hf(model.eval(), folder, input_ids=IDS, tolerance=1e-5, export_class=export_class, tokenizer=tokenizer)
    return model


@pytest.mark.parametrize("cls", STOCK_EXPORTS)
def test_generate_from_the_tokenizer_output_on_every_stock_export(tmp_path, cls):
    kind, every, export_class = STOCK_EXPORTS[cls]
    model = exported(kind, every, export_class, tmp_path / "out", toy_tokenizer())
    config = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert config["model_input_names"] == ["input_ids", "attention_mask"] and config["model_max_length"] == 64
    assert "is_local" not in config and "local_files_only" not in config
    tok = T.AutoTokenizer.from_pretrained(tmp_path / "out")
    stock = T.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(stock).__name__ == cls
    inputs = tok("the cat sat on the", return_tensors="pt")
    assert sorted(inputs) == ["attention_mask", "input_ids"]
    out = stock.generate(**inputs, max_new_tokens=4, do_sample=False)
    # greedy continuation = the upcycled model's own argmax, token by token
    ids = inputs["input_ids"]
    with torch.no_grad():
        for _ in range(4):
            ids = torch.cat([ids, model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, ids)


def test_model_max_length_falls_back_to_the_model_positions(tmp_path):
    """A source tokenizer with no length (1e30, SmolLM2's) gets the model's max_position_embeddings."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen2MoeForCausalLM"],
                                                      "max_position_embeddings": 48}))
    save_tokenizer(toy_tokenizer(None), tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["model_max_length"] == 48 and config["model_input_names"] == ["input_ids", "attention_mask"]
    assert T.AutoTokenizer.from_pretrained(tmp_path).model_max_length == 48


def test_an_encoder_keeps_its_token_type_ids(tmp_path):
    """Only causal LMs lose token_type_ids: a BERT folder's tokenizer keeps the inputs it names."""
    tokenizer = T.PreTrainedTokenizerFast(tokenizer_object=toy_tokenizer().backend_tokenizer, model_max_length=64,
                                          model_input_names=["input_ids", "token_type_ids", "attention_mask"])
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "max_position_embeddings": 32}))
    save_tokenizer(tokenizer, tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["model_max_length"] == 64                       # the tokenizer's own length wins
    assert T.AutoTokenizer.from_pretrained(tmp_path).model_input_names == \
        ["input_ids", "token_type_ids", "attention_mask"]

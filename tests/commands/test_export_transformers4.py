"""The exported folders also load and match under transformers 4.57 (its own virtual environment).

The environment is built once (torch 2.13.0 + transformers 4.57.6, about a minute) under the upcycle cache
and reused; the check script runs there without upcycle, on folders and expected logits written here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import make_tiny
from upcycle.config import ConvertConfig
from upcycle.config_reader import build
from upcycle.conversion.pipeline import upcycle_model
from upcycle.core.ffn import FFNWeights
from upcycle.core.moe import MoELayer, moe_layers
from upcycle.data.text import cache_dir
from upcycle.export.stock_folder import export_hf

pytestmark = pytest.mark.slow
TRANSFORMERS_4 = "4.57.6"


@pytest.fixture(scope="module")
def hf4_python() -> Path:
    venv = cache_dir() / f"venv-transformers-{TRANSFORMERS_4}"
    python = venv / "bin" / "python"
    if not python.exists():
        tmp = venv.with_name(venv.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(tmp)], check=True)
        subprocess.run([str(tmp / "bin" / "python"), "-m", "pip", "install", "-q", "torch==2.13.0",
                        f"transformers=={TRANSFORMERS_4}"], check=True, timeout=900)
        os.replace(tmp, venv)
    return python


def upcycled(kind: str, method: str, every: int, shared: bool = False) -> torch.nn.Module:
    model = make_tiny(kind)
    upcycle_model(model, build(ConvertConfig, {"method": method, "moe": {"num_experts": 4, "top_k": 2},
                                               "placement": {"every": every}, "check": {"tokens": 16}}),
                  progress=False)
    if shared:      # one shared expert per layer, exported with its 0.5 gate folded into down_proj
        g = torch.Generator().manual_seed(2)
        for name, layer in moe_layers(model).items():
            s = FFNWeights(w_up=torch.randn(1, 48, 32, generator=g) * 0.1, w_gate=torch.randn(1, 48, 32, generator=g)
                           * 0.1, w_down=torch.randn(1, 32, 48, generator=g) * 0.1, activation="silu")
            model.get_submodule(name.rsplit(".", 1)[0]).mlp = MoELayer.from_init(
                layer.experts.weights(), layer.router.weight.detach(), top_k=2, shared=s)
    return model.eval()


def tokenizer_folder(tmp_path: Path):
    """A tiny Llama with a word-level tokenizer (saved by transformers 5), converted to Qwen2-MoE by the
    command's own path (convert), so its folder holds the tokenizer as users get it."""
    from conftest import write_tiny_lm
    from upcycle.conversion.pipeline import convert

    dense, _, held = write_tiny_lm(tmp_path / "lm")
    result = convert(build(ConvertConfig, {"model": str(dense), "method": "copy", "export": "hf",
                                           "moe": {"num_experts": 4, "top_k": 2}, "placement": {"every": 2},
                                           "check": {"tokens": 16, "text": str(held)}}),
                     tmp_path / "with-tokenizer", progress=False)
    return result.model.eval(), result.tokenizer, tmp_path / "with-tokenizer"


CASES = {  # name: (source, method, every, export class, shared expert)
    "llama-copy-qwen2moe": ("llama", "copy", 2, "auto", False),
    "llama-shared-qwen2moe": ("llama", "noise", 1, "auto", True),
    "mistral-drop-mixtral": ("mistral", "drop", 1, "mixtral", False),
    "qwen2-noise-qwen2moe": ("qwen2", "noise", 2, "auto", False),
    "qwen3-drop-qwen3moe": ("qwen3", "drop", 2, "auto", False),
}


def greedy(model: torch.nn.Module, ids: torch.Tensor, steps: int) -> list[int]:
    """The upcycled model's own greedy continuation: what generate(do_sample=False) must return."""
    with torch.no_grad():
        for _ in range(steps):
            ids = torch.cat([ids, model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0].tolist()


def test_exports_load_and_match_under_transformers_4(hf4_python, tmp_path):
    from test_export_tokenizer import toy_tokenizer

    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(0))
    text = "the cat sat on the"
    folders = []
    for name, (kind, method, every, cls, shared) in CASES.items():
        model = upcycled(kind, method, every, shared)
        folder = tmp_path / name
        folder.mkdir()
        tokenizer = toy_tokenizer(None if kind == "qwen2" else 64)    # qwen2: the length comes from the config
        export_hf(model, folder, input_ids=ids, tolerance=1e-5, export_class=cls, tokenizer=tokenizer)
        text_ids = tokenizer(text, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            torch.save({"input_ids": ids, "logits": model(input_ids=ids).logits, "text": text,
                        "text_ids": text_ids[0].tolist(), "greedy": greedy(model, text_ids, 3)},
                       folder / "expected_logits.pt")
        folders.append(str(folder))
    model, tokenizer, folder = tokenizer_folder(tmp_path)
    text_ids = tokenizer(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        torch.save({"input_ids": ids, "logits": model(input_ids=ids).logits, "text": text,
                    "text_ids": text_ids[0].tolist(), "greedy": greedy(model, text_ids, 3)},
                   folder / "expected_logits.pt")
    folders.append(str(folder))
    script = Path(__file__).parents[1] / "hf4_check.py"
    run = subprocess.run([str(hf4_python), str(script), *folders], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    results = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(CASES) + 1
    for r in results:
        assert r["transformers"] == TRANSFORMERS_4
        assert not r["loading_problems"], r
        assert not r["load_warnings"], r        # e.g. no "Initializing zero-element tensors is a no-op"
        # same weights; 4.57 sums the experts in its own order: measured at most 6e-8 on these logits of order 1
        assert r["max_abs_diff"] <= 1e-5, r
        assert r["generated_shape"] == [2, 7]
        # generate(**tok(prompt, return_tensors="pt")): no token_type_ids, the upcycled model's greedy tokens
        assert r["tokenizer_class"] == "PreTrainedTokenizerFast" and r["ids_match"], r
        assert r["tokenizer_outputs"] == ["attention_mask", "input_ids"], r
        assert r["generate_from_tokenizer_matches"], r
        assert r["model_max_length"] == 64, r
        assert r["pipeline_text"].startswith("the cat sat on the"), r
    assert {r["class"] for r in results} == {"Qwen2MoeForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM"}

"""`upcycle export --format gguf`: a GGUF file for llama.cpp, checked by reading it back with gguf.GGUFReader.

No llama.cpp binary runs here, so the file is read back and run by `llama_cpp_forward`, a numpy transcription
of llama.cpp's graphs for the three archs (src/models/llama.cpp, qwen2moe.cpp, qwen3moe.cpp: RMS norms, rotary
"norm" (interleaved pairs) for llama and "neox" (halves) for the Qwen archs, softmax top-k with the arch's own
renormalization, qwen2moe's sigmoid-gated shared expert); its logits must equal transformers' on the stock
export (the upcycled model). That checks the tensor names, shapes, the q/k permutation and the hyperparameters
llama.cpp reads.
"""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
import torch
import transformers as T

import upcycle
from conftest import TOY_WORDS, make_tiny
from upcycle.cli import main
from upcycle.config import ConvertConfig, build
from upcycle.conversion.pipeline import upcycle_model
from upcycle.errors import UpcycleError
from upcycle.export.gguf import REQUIRED_KEYS, gguf_plan, write_gguf
from upcycle.export.layout import export_target

gguf = pytest.importorskip("gguf", reason="the gguf package writes and reads GGUF files")
VOCAB = 264        # the byte-level alphabet (256) and the toy merges and specials fit
CASES = {  # llama.cpp arch: (source, export class, normalize_topk as the arch computes it)
    "llama": ("mistral", "mixtral", True),
    "qwen2moe": ("llama", "qwen2_moe", False),
    "qwen3moe": ("qwen3", "qwen3_moe", True),
}


def byte_level_tokenizer(digits: bool = False) -> T.PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on the toy words (GPT-2's pre-tokenizer; SmolLM's with `digits`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]) \
        if digits else byte_level
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([" ".join(TOY_WORDS)] * 4, trainers.BpeTrainer(
        vocab_size=VOCAB - 4, special_tokens=["<pad>", "<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return T.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


@pytest.fixture(autouse=True, scope="module")
def release_models():
    """The cached models go with this module: tests elsewhere count the tensors alive (test_merge_sources.py)."""
    yield
    upcycled.cache_clear()


@functools.cache          # the tests only read these models: each is built once (about a second)
def upcycled(kind: str, normalize_topk: bool = True, every: int = 1) -> torch.nn.Module:
    model = make_tiny(kind)
    model.resize_token_embeddings(VOCAB, mean_resizing=False)
    moe = {"num_experts": 4, "top_k": 2, "normalize_topk": normalize_topk}
    upcycle_model(model, build(ConvertConfig, {"method": "drop", "placement": {"every": every}, "moe": moe,
                                               "check": {"tokens": 16}}), progress=False)
    return model.eval()


def rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rope(x, base, interleaved):
    """x: [T, H, hd]; llama.cpp's rotary embedding, "norm" mode (pairs 2i, 2i+1) or "neox" mode (i, i+hd/2)."""
    n, hd = x.shape[0], x.shape[-1]
    angle = np.arange(n)[:, None] * base ** (-np.arange(0, hd, 2) / hd)[None]      # [T, hd/2]
    cos, sin = np.cos(angle)[:, None], np.sin(angle)[:, None]
    a, b = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., :hd // 2], x[..., hd // 2:])
    ra, rb = a * cos - b * sin, a * sin + b * cos
    return np.stack([ra, rb], -1).reshape(x.shape) if interleaved else np.concatenate([ra, rb], -1)


def llama_cpp_forward(path, ids: list[int]) -> np.ndarray:
    """Logits of llama.cpp's graph for the file's arch, in float64 numpy, from what GGUFReader reads back."""
    reader = gguf.GGUFReader(str(path))
    t = {x.name: np.asarray(x.data, dtype=np.float64) for x in reader.tensors}
    f = {k: v.contents() for k, v in reader.fields.items() if not k.startswith("tokenizer.")}
    arch = f["general.architecture"]
    heads, kv, eps = f[f"{arch}.attention.head_count"], f[f"{arch}.attention.head_count_kv"], \
        f[f"{arch}.attention.layer_norm_rms_epsilon"]
    hd, k_used, base = f[f"{arch}.attention.key_length"], f[f"{arch}.expert_used_count"], f[f"{arch}.rope.freq_base"]
    x = t["token_embd.weight"][ids]
    n = len(ids)
    for i in range(f[f"{arch}.block_count"]):
        def b(name, i=i):
            return t.get(f"blk.{i}.{name}")
        h = rms(x, b("attn_norm.weight"), eps)
        q, k, v = (h @ b(f"attn_{p}.weight").T + (b(f"attn_{p}.bias") if b(f"attn_{p}.bias") is not None else 0)
                   for p in "qkv")
        q, k, v = q.reshape(n, heads, hd), k.reshape(n, kv, hd), v.reshape(n, kv, hd)
        if arch == "qwen3moe":
            q, k = rms(q, b("attn_q_norm.weight"), eps), rms(k, b("attn_k_norm.weight"), eps)
        q, k = rope(q, base, arch == "llama"), rope(k, base, arch == "llama")
        k, v = np.repeat(k, heads // kv, 1), np.repeat(v, heads // kv, 1)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd) + np.triu(np.full((n, n), -np.inf), 1)
        att = np.exp(scores - scores.max(-1, keepdims=True))
        att = np.einsum("hqk,khd->qhd", att / att.sum(-1, keepdims=True), v).reshape(n, heads * hd)
        x = x + att @ b("attn_output.weight").T
        h = rms(x, b("ffn_norm.weight"), eps)
        logits = h @ b("ffn_gate_inp.weight").T
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out = np.zeros_like(h)
        for tok in range(n):
            top = np.argsort(-p[tok])[:k_used]
            w = p[tok, top] / (p[tok, top].sum() if arch != "qwen2moe" else 1.0)   # qwen2moe: raw weights
            for e, we in zip(top, w, strict=True):
                g, u = b("ffn_gate_exps.weight")[e] @ h[tok], b("ffn_up_exps.weight")[e] @ h[tok]
                out[tok] += we * (b("ffn_down_exps.weight")[e] @ (g / (1 + np.exp(-g)) * u))
        if arch == "qwen2moe":
            g, u = h @ b("ffn_gate_shexp.weight").T, h @ b("ffn_up_shexp.weight").T
            gate = 1 / (1 + np.exp(-(h @ b("ffn_gate_inp_shexp.weight"))))
            out += gate[:, None] * ((g / (1 + np.exp(-g)) * u) @ b("ffn_down_shexp.weight").T)
        x = x + out
    return rms(x, t["output_norm.weight"], eps) @ t["output.weight"].T


@pytest.mark.parametrize("arch", CASES)
def test_gguf_reads_back_and_computes_the_stock_export(tmp_path, arch):
    kind, cls, norm = CASES[arch]
    model, tokenizer = upcycled(kind, norm), byte_level_tokenizer()
    info = write_gguf(model, export_target(model, cls), tmp_path / "m.gguf", tokenizer, out_type="f32")
    assert info["arch"] == arch and info["tokenizer_pre"] == "gpt2"
    reader = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    for key in REQUIRED_KEYS:
        assert key.format(arch=arch) in reader.fields, key
    fields = {k: v.contents() for k, v in reader.fields.items()}
    assert fields[f"{arch}.expert_count"] == 4 and fields[f"{arch}.expert_used_count"] == 2
    assert fields["tokenizer.ggml.tokens"][:3] == ["<pad>", "<s>", "</s>"] and len(fields["tokenizer.ggml.tokens"]) \
        == VOCAB and fields["tokenizer.ggml.bos_token_id"] == 1 and fields["tokenizer.ggml.token_type"][1] == 3
    names = {t.name for t in reader.tensors}
    assert {f"blk.{i}.ffn_{p}_exps.weight" for i in range(4) for p in ("gate", "up", "down")} <= names
    # the upcycled model (whose stock export computes it within 1e-5, tests/test_export.py) and the GGUF file,
    # run as llama.cpp's graph: the same logits
    ids = tokenizer("the cat sat on the mat")["input_ids"]
    with torch.no_grad():
        expected = model(input_ids=torch.tensor([ids])).logits[0].double().numpy()
    assert np.abs(llama_cpp_forward(tmp_path / "m.gguf", ids) - expected).max() < 1e-4


def test_gguf_weight_types_read_back_bit_for_bit(tmp_path):
    model, tokenizer = upcycled("mistral"), byte_level_tokenizer(digits=True)
    target = export_target(model, "mixtral")
    up = model.model.layers[0].mlp.experts.weights().w_up        # [E, F, D]
    for out_type, dtype in (("f16", torch.float16), ("bf16", torch.bfloat16)):
        info = write_gguf(model, target, tmp_path / f"{out_type}.gguf", tokenizer, out_type=out_type)
        assert info["tokenizer_pre"] == "smollm"
        tensor = {t.name: t for t in gguf.GGUFReader(str(tmp_path / f"{out_type}.gguf")).tensors}
        stored = tensor["blk.0.ffn_up_exps.weight"]
        assert stored.tensor_type.name == out_type.upper()
        assert np.asarray(stored.data).tobytes() == up.to(dtype).contiguous().view(torch.int16).numpy().tobytes()
        assert tensor["blk.0.ffn_gate_inp.weight"].tensor_type.name == "F32"      # routers stay float32


def test_gguf_command_and_refusals(tmp_path, capsys):
    tokenizer = byte_level_tokenizer()
    upcycle.save(upcycled("qwen3"), tmp_path / "up", tokenizer=tokenizer)
    assert main(["export", str(tmp_path / "up"), str(tmp_path / "out"), "--format", "gguf", "--gguf-type", "bf16"]) == 0
    assert "llama-cli" in capsys.readouterr().out
    assert {"model.gguf", "upcycle_report.json"} <= {p.name for p in (tmp_path / "out").iterdir()}
    report = json.loads((tmp_path / "out" / "upcycle_report.json").read_text())
    assert report["export"]["arch"] == "qwen3moe" and report["export"]["weight_type"] == "bf16"
    # what llama.cpp computes differently is refused before OUT exists: dense blocks, qwen2moe's raw top-k
    upcycle.save(upcycled("qwen3", every=2), tmp_path / "dense", tokenizer=tokenizer)
    assert main(["export", str(tmp_path / "dense"), str(tmp_path / "x"), "--format", "gguf"]) == 2
    assert "dense blocks [0, 2]" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    model = upcycled("mistral")          # renormalized top-k: Mixtral's llama arch, but not qwen2moe
    with pytest.raises(UpcycleError, match="qwen2moe always uses them raw.*--export-class mixtral"):
        gguf_plan(model, export_target(model, "qwen2_moe"), tokenizer)
    assert gguf_plan(model, export_target(model, "mixtral"), tokenizer)[0] == "llama"


def test_gguf_refuses_a_tokenizer_llama_cpp_would_split_differently(tmp_path):
    from test_export_tokenizer import toy_tokenizer

    model = upcycled("mistral")
    with pytest.raises(UpcycleError, match="byte-level BPE tokenizers only.*convert_hf_to_gguf"):
        write_gguf(model, export_target(model, "mixtral"), tmp_path / "m.gguf", toy_tokenizer())
    tokenizer = byte_level_tokenizer()
    tokenizer.backend_tokenizer.pre_tokenizer = __import__("tokenizers").pre_tokenizers.Whitespace()
    with pytest.raises(UpcycleError, match="pre-tokenizer \\['Whitespace'\\] has no llama.cpp counterpart"):
        write_gguf(model, export_target(model, "mixtral"), tmp_path / "m.gguf", tokenizer)
    assert not (tmp_path / "m.gguf").exists()

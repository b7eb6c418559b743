"""`upcycle export --format gguf`: a GGUF file for llama.cpp, checked by reading it back with gguf.GGUFReader.

This is the fast guard; the proof is llama.cpp itself, which benchmarks/interop/runtimes_check.py builds and runs on
every arch and type (benchmarks/results/runtimes/). Here no llama.cpp binary runs: the file is read back and run by
`llama_cpp_forward`, a numpy transcription of llama.cpp's graphs for the three archs (src/models/llama.cpp,
qwen2moe.cpp, qwen3moe.cpp: RMS norms, rotary "norm" (interleaved pairs) for llama and "neox" (halves) for the
Qwen archs, softmax top-k with the arch's own renormalization, qwen2moe's shared expert gated by silu(z)/z); its
logits must equal transformers' on the stock export (the upcycled model). The names and values llama.cpp checks
(pre-tokenizer names, archs, renormalization, the shared gate's formula) are compared with LLAMA_CPP, read from
llama.cpp's source by benchmarks/interop/llama_cpp_facts.py.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers as T

import upcycle
from conftest import TOY_WORDS, make_tiny
from upcycle.cli import main
from upcycle.config import ConvertConfig
from upcycle.config_reader import build
from upcycle.conversion.pipeline import upcycle_model
from upcycle.errors import UpcycleError
from upcycle.export.gguf import ARCHS, RENORMALIZES, REQUIRED_KEYS, gguf_plan, write_gguf
from upcycle.export.gguf_vocab import PRE_TOKENIZERS
from upcycle.export.layout import export_target

gguf = pytest.importorskip("gguf", reason="the gguf package writes and reads GGUF files")
VOCAB = 264        # the byte-level alphabet (256) and the toy merges and specials fit
CASES = {  # case: (source, export class, normalize_topk as the arch computes it, method)
    "llama": ("mistral", "mixtral", True, "drop"),
    "llama-delta": ("mistral", "mixtral", True, "drop-delta"),     # delta experts, written as full ones
    "qwen2moe": ("llama", "qwen2_moe", False, "drop"),               # the stand-in shared expert (width 1, zero)
    "qwen2moe-shared": ("llama", "qwen2_moe", False, "spri"),        # SPRI's real shared expert
    "qwen3moe": ("qwen3", "qwen3_moe", True, "drop"),
}
# llama.cpp's own names and formulas, from its source (benchmarks/interop/llama_cpp_facts.py; its "source" says which)
LLAMA_CPP = json.loads((Path(__file__).parents[1] / "fixtures" / "llama_cpp_facts.json").read_text())
GPT2_REGEX = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"


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
def upcycled(kind: str, normalize_topk: bool = True, every: int = 1, method: str = "drop") -> torch.nn.Module:
    model = make_tiny(kind)
    model.resize_token_embeddings(VOCAB, mean_resizing=False)
    moe = {"num_experts": 4, "top_k": 2, "normalize_topk": normalize_topk}
    if method.endswith("-delta"):       # the dense FFN plus rank-4 changes (`moe.experts: delta`)
        method, moe = method.removesuffix("-delta"), {**moe, "experts": "delta", "delta_rank": 4}
    upcycle_model(model, build(ConvertConfig, {"method": method, "placement": {"every": every}, "moe": moe,
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
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(path))
    t = {x.name: dequantize(np.asarray(x.data), x.tensor_type).astype(np.float64).reshape(
        [int(n) for n in reversed(x.shape)]) for x in reader.tensors}
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
            z = h @ b("ffn_gate_inp_shexp.weight")
            gate = z / (1 + np.exp(-z)) / z         # llama.cpp's sigmoid: silu(z) / z (LLAMA_CPP's formula)
            out += gate[:, None] * ((g / (1 + np.exp(-g)) * u) @ b("ffn_down_shexp.weight").T)
        x = x + out
    return rms(x, t["output_norm.weight"], eps) @ t["output.weight"].T


@pytest.mark.parametrize("arch", CASES)
def test_gguf_reads_back_and_computes_the_stock_export(tmp_path, arch):
    kind, cls, norm, method = CASES[arch]
    model, tokenizer = upcycled(kind, norm, method=method), byte_level_tokenizer()
    info = write_gguf(model, export_target(model, cls), tmp_path / "m.gguf", tokenizer, out_type="f32")
    arch = arch.split("-")[0]
    assert info["arch"] == arch and info["tokenizer_pre"] == "gpt-2"
    reader = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    for key in REQUIRED_KEYS:
        assert key.format(arch=arch) in reader.fields, key
    fields = {k: v.contents() for k, v in reader.fields.items()}
    assert fields[f"{arch}.expert_count"] == 4 and fields[f"{arch}.expert_used_count"] == 2
    assert fields["tokenizer.ggml.tokens"][:3] == ["<pad>", "<s>", "</s>"] and len(fields["tokenizer.ggml.tokens"]) \
        == VOCAB and fields["tokenizer.ggml.bos_token_id"] == 1 and fields["tokenizer.ggml.token_type"][1] == 3
    names = {t.name for t in reader.tensors}
    assert {f"blk.{i}.ffn_{p}_exps.weight" for i in range(4) for p in ("gate", "up", "down")} <= names
    # the upcycled model (whose stock export computes it within 1e-5, tests/commands/test_export.py) and the GGUF file,
    # run as llama.cpp's graph: the same logits
    ids = tokenizer("the cat sat on the mat")["input_ids"]
    with torch.no_grad():
        expected = model(input_ids=torch.tensor([ids])).logits[0].double().numpy()
    assert np.abs(llama_cpp_forward(tmp_path / "m.gguf", ids) - expected).max() < 1e-4


def test_gguf_names_and_formulas_are_llama_cpps_own():
    """What llama.cpp refuses or computes its own way, against its source: the pre-tokenizer names upcycle writes
    exist there with the regexes upcycle assumes, the archs exist and renormalize as gguf.RENORMALIZES says, and
    qwen2moe's shared gate is the silu(z)/z that `llama_cpp_forward` computes (a zero gate weight is NaN there)."""
    regexes = {"gpt-2": [GPT2_REGEX], "smollm": ["\\p{N}", GPT2_REGEX]}
    assert set(PRE_TOKENIZERS.values()) == set(regexes)
    for name, expected in regexes.items():
        assert LLAMA_CPP["pre_type_regexes"][LLAMA_CPP["pre_tokenizers"][name]] == expected, name
    assert set(ARCHS.values()) <= set(LLAMA_CPP["archs"])
    assert RENORMALIZES == LLAMA_CPP["moe_renormalizes"]
    assert LLAMA_CPP["shared_expert_gate"] == {"qwen2moe": "silu(z)/z"}
    assert LLAMA_CPP["source"]["llama_cpp_commit"] and len(LLAMA_CPP["source"]["sdist_sha256"]) == 64


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_qwen2moe_shared_gate_is_never_zero(tmp_path, dtype):
    """The stand-in shared expert's gate (and a real one's) reaches llama.cpp nonzero, so silu(z)/z is 0.5, not
    0/0, even from a float16 model in which qwen2_moe.SHARED_GATE rounds to zero."""
    model, tokenizer = upcycled("llama", False), byte_level_tokenizer()
    write_gguf(model.to(dtype), export_target(model, "qwen2_moe"), tmp_path / "m.gguf", tokenizer, out_type="f16")
    model.float()
    gates = [t for t in gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors if t.name.endswith("gate_inp_shexp.weight")]
    assert len(gates) == 4 and all(t.tensor_type.name == "F32" and np.all(np.asarray(t.data) > 0) for t in gates)
    assert np.isfinite(llama_cpp_forward(tmp_path / "m.gguf", [1, 5, 9, 2])).all()


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


@pytest.mark.parametrize("out_type", ["q8_0", "q4_0"])
def test_gguf_quantized_types(tmp_path, out_type):
    """Q8_0 and Q4_0 from the gguf package's quantizers: the expert weights in the type (rows whose length is not
    a multiple of 32 fall back to F16), routers F32, and llama.cpp's graph on the dequantized file within the
    quantization's drift of the model. The bounds are 2.5x and 4.5x the drift measured here (0.0038 and 0.044, on
    logits up to 0.43): the quantizers are deterministic numpy, and the margin covers another CPU's summation
    order."""
    model, tokenizer = upcycled("mistral"), byte_level_tokenizer()
    write_gguf(model, export_target(model, "mixtral"), tmp_path / "m.gguf", tokenizer, out_type=out_type)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors}
    assert types["blk.0.ffn_up_exps.weight"] == out_type.upper() and types["blk.0.ffn_gate_inp.weight"] == "F32"
    assert types["output.weight"] == types["token_embd.weight"] == "Q8_0"            # kept at 8 bits in Q4_0 too
    ids = tokenizer("the cat sat on the mat")["input_ids"]
    with torch.no_grad():
        expected = model(input_ids=torch.tensor([ids])).logits[0].double().numpy()
    drift = np.abs(llama_cpp_forward(tmp_path / "m.gguf", ids) - expected).max()
    assert 0 < drift < {"q8_0": 0.01, "q4_0": 0.2}[out_type]


@pytest.mark.parametrize(("out_type", "largest"), [("f16", 1e5), ("q8_0", 1e7), ("q4_0", 1e6)])
def test_gguf_refuses_finite_weights_its_type_would_write_as_inf(tmp_path, out_type, largest):
    """float16 holds at most 65,504, and a quantized block keeps its scale (|max| / 127 for Q8_0, / 8 for Q4_0)
    in float16: a finite weight beyond that would be read back by llama.cpp as inf. Refused with the tensor
    named and nothing written; bf16 (float32's range) writes the same model."""
    model, tokenizer = upcycled("mistral"), byte_level_tokenizer()
    target = export_target(model, "mixtral")
    experts = model.model.layers[0].mlp.experts
    up_rows = experts.weights().w_up.shape[1]        # the fused gate-and-up tensor holds up after gate's rows
    with torch.no_grad():
        getattr(experts, experts.in_name)[0, up_rows if experts.gated else 0, 0] = largest
    with pytest.raises(UpcycleError, match=rf"GGUF {out_type}: tensor blk.0.ffn_up_exps.weight does not fit "
                                           rf"{out_type.upper() if out_type != 'f16' else 'F16'} .*nothing was "
                                           rf"written: write --gguf-type bf16 or f32"):
        write_gguf(model, target, tmp_path / "m.gguf", tokenizer, out_type=out_type)
    assert not (tmp_path / "m.gguf").exists()
    write_gguf(model, target, tmp_path / "bf16.gguf", tokenizer, out_type="bf16")
    stored = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "bf16.gguf")).tensors}["blk.0.ffn_up_exps.weight"]
    assert np.isfinite(torch.from_numpy(np.asarray(stored.data).copy()).view(torch.bfloat16).float().numpy()).all()


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
    # a GGUF weight type with the safetensors format would be ignored: refused, nothing written
    assert main(["export", str(tmp_path / "up"), str(tmp_path / "x"), "--gguf-type", "q8_0"]) == 2
    assert "--gguf-type q8_0 is the weight type of a GGUF file: give --format gguf" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    model = upcycled("mistral")          # renormalized top-k: Mixtral's llama arch, but not qwen2moe
    with pytest.raises(UpcycleError, match="qwen2moe always uses them raw.*changes the function.*"
                                           "--export-class mixtral, llama.cpp's llama arch, which keeps it"):
        gguf_plan(model, export_target(model, "qwen2_moe"), tokenizer)
    assert gguf_plan(model, export_target(model, "mixtral"), tokenizer)[0] == "llama"
    # a qwen2moe file is written from a model converted with raw top-k weights, and the command says what that cost
    upcycle.save(upcycled("llama", False), tmp_path / "raw", tokenizer=tokenizer)
    assert main(["export", str(tmp_path / "raw"), str(tmp_path / "q2"), "--format", "gguf",
                 "--export-class", "qwen2_moe"]) == 0
    assert "note: llama.cpp's qwen2moe uses raw top-k weights" in capsys.readouterr().out


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

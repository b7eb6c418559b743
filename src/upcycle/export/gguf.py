"""An upcycled decoder as a GGUF file for llama.cpp (`upcycle export IN OUT --format gguf`).

Built on the `gguf` package (llama.cpp's own writer and tensor-name tables), from the stock export's tensors
(`layout.py`): the Mixtral export is llama.cpp's "llama" arch with experts, Qwen2-MoE "qwen2moe", Qwen3-MoE
"qwen3moe". Each expert projection is stacked into one [E, out, in] tensor (`ffn_gate_exps`, ...), as llama.cpp's
convert_hf_to_gguf.py does; the "llama" arch gets its q/k rows permuted to llama.cpp's rotary layout (the same
permutation as that converter's). Weights are written as F32, F16, BF16, or quantized as Q8_0 or Q4_0 with the
`gguf` package's own quantizers (which write no K-quant: llama.cpp's llama-quantize makes Q4_K and the rest from an
F16 file); norms, routers and the shared expert's gate are always F32. Qwen2-MoE's shared-expert gate is never
all zero (llama.cpp's silu(z)/z, qwen2_moe.py).

What llama.cpp computes differently for these archs is refused before anything is written (docs/design.md
principle 4), read from its model code: qwen2moe and qwen3moe have an MoE FFN in every block (no
`mlp_only_layers`); qwen2moe never renormalizes the top-k weights, qwen3moe and llama always do; rope scaling and
a sliding window shorter than the context are not written. After writing, the file is read back with
`gguf.GGUFReader` and every tensor compared with what was meant (`check_gguf`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..checkpoint.reader import is_finite
from ..errors import UpcycleError
from .gguf_vocab import gguf_vocab
from .layout import export_config, export_state_dict
from .protocol import StockClass
from .qwen2_moe import SHARED_GATE
from .registry import STOCK_CLASSES

# stock class -> llama.cpp arch
ARCHS = {c.name: c.llama_cpp_arch for c in STOCK_CLASSES.values()}
# whether llama.cpp's graph for the arch renormalizes the top-k weights (qwen2moe.cpp passes norm_w = false)
RENORMALIZES = {c.llama_cpp_arch: c.llama_cpp_renormalizes for c in STOCK_CLASSES.values()}
# what a conversion for qwen2moe gives up: with raw top-k weights the selected experts' weights sum to less than 1,
# so a function-preserving method (copy; cluster, drop and spri at their preserving settings) no longer is
RAW_TOPK = ("which changes the function: the raw top-k weights sum to less than 1, so no method preserves the dense "
            "model then, copy included")
# --gguf-type -> the llama.cpp file type it names
FILE_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0",
              "q4_0": "MOSTLY_Q4_0"}
QUANTIZED = ("q8_0", "q4_0")
FLOAT_TYPES = ("F32", "F16", "BF16")      # GGML types whose numpy array holds one value per element
# the keys llama.cpp reads for every one of these archs (tokenizer keys: gguf_vocab)
REQUIRED_KEYS = ("general.architecture", "{arch}.context_length", "{arch}.embedding_length", "{arch}.block_count",
                 "{arch}.feed_forward_length", "{arch}.attention.head_count", "{arch}.attention.head_count_kv",
                 "{arch}.rope.freq_base", "{arch}.attention.layer_norm_rms_epsilon", "{arch}.expert_count",
                 "{arch}.expert_used_count", "tokenizer.ggml.model", "tokenizer.ggml.tokens",
                 "tokenizer.ggml.token_type")


def gguf_problems(config: dict, arch: str) -> list[str]:
    """What llama.cpp's `arch` would compute differently from the stock config `config` (module docstring)."""
    problems = []
    if config.get("mlp_only_layers"):
        problems.append(f"dense blocks {config['mlp_only_layers']} (llama.cpp's {arch} has an MoE FFN in every "
                        "block: convert with every block MoE)")
    renorm = config.get("norm_topk_prob", True)
    if renorm != RENORMALIZES[arch]:
        fix = (f"--set moe.normalize_topk=false ({RAW_TOPK})" if renorm else "moe.normalize_topk=true")
        extra = "; or --export-class mixtral, llama.cpp's llama arch, which keeps it" if arch == "qwen2moe" else ""
        problems.append(f"top-k weights {'renormalized' if renorm else 'raw'} (llama.cpp's {arch} always "
                        f"{'renormalizes' if RENORMALIZES[arch] else 'uses them raw'}: convert with {fix}{extra})")
    if config.get("rope_scaling"):
        problems.append(f"rope scaling {config['rope_scaling']} (not written by upcycle's GGUF export)")
    window = config.get("sliding_window")
    if window is not None and window < config["max_position_embeddings"]:
        problems.append(f"a sliding window of {window} < {config['max_position_embeddings']} positions "
                        f"(llama.cpp's {arch} attends to the whole context)")
    return problems


def _permute_rotary(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF's rotate-half q/k rows -> llama.cpp's interleaved pairs (LlamaModel.permute of convert_hf_to_gguf.py)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(model: nn.Module, target: StockClass, config: dict) -> dict[str, torch.Tensor]:
    """Every tensor of the GGUF file by its llama.cpp name, in the model's values and the order they are written
    (`encode` gives each its type in the file)."""
    import gguf

    arch = ARCHS[target.name]
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config["num_hidden_layers"])
    hf, _ = export_state_dict(model, target)
    if "lm_head.weight" not in hf:          # tied: qwen2moe needs `output` (llama.cpp loads it as required)
        hf["lm_head.weight"] = hf["model.embed_tokens.weight"]
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for key in list(hf):                     # experts.{e}.gate_proj.weight -> one stacked experts.gate_proj.weight
        parts = key.split(".")
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            i = parts.index("experts")
            stacked = ".".join(parts[:i + 1] + parts[i + 2:])
            experts.setdefault(stacked, {})[int(parts[i + 1])] = hf.pop(key)
    for stacked, by_index in experts.items():
        hf[stacked] = torch.stack([by_index[e] for e in range(len(by_index))])
    out = {}
    for key, tensor in hf.items():
        name = name_map.get_name(key, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise UpcycleError(f"no llama.cpp {arch} tensor for {key}; nothing was written")
        if arch == "llama" and key.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads"] if "q_proj" in key else config["num_key_value_heads"]
            tensor = _permute_rotary(tensor, heads)
        if name.endswith("ffn_gate_inp_shexp.weight"):
            # llama.cpp reads the shared expert's sigmoid gate as a vector, and computes it as silu(z)/z: a gate
            # that rounded to zero in float16 would be NaN there (qwen2_moe.SHARED_GATE keeps sigmoid at 0.5)
            tensor = tensor.reshape(-1).float()
            if not tensor.any():
                tensor = torch.full_like(tensor, SHARED_GATE)
        out[name] = tensor.detach().contiguous()
    return out


def encode(name: str, tensor: torch.Tensor, out_type: str) -> tuple[np.ndarray, str]:
    """`tensor` as the numpy array the GGUF file holds and its GGML type name, refused when a finite weight is not
    finite as written (`_check_written`). Norms, biases, routers and the shared expert's gate stay F32, as
    llama.cpp's converter keeps 1-D tensors and routers; a row whose length is not a multiple of the quantization
    block is written F16, as that converter falls back; a Q4_0 file keeps its embeddings and output matrix at
    Q8_0."""
    array, ggml_type = _encode(name, tensor, out_type)
    _check_written(name, tensor, array, ggml_type, out_type)
    return array, ggml_type


def _check_written(name: str, tensor: torch.Tensor, array: np.ndarray, ggml_type: str, out_type: str) -> None:
    """Every writer checks that what it writes is finite in the written type: float16 holds at most 65,504, and
    a quantized block keeps its scale (its largest |value| / 127 for Q8_0) in float16 too, so a large finite
    weight would be read back by llama.cpp as inf."""
    if ggml_type == "F32":
        return
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    if ggml_type == "BF16":
        written = torch.from_numpy(array).view(torch.bfloat16)
    elif ggml_type == "F16":
        written = torch.from_numpy(array)
    else:
        written = torch.from_numpy(dequantize(array, GGMLQuantizationType[ggml_type]))
    if not is_finite(written):
        largest = float(tensor.detach().abs().max())
        raise UpcycleError(f"GGUF {out_type}: tensor {name} does not fit {ggml_type} (its largest |weight| is "
                           f"{largest:.6g}; float16 holds at most 65,504, also as a quantized block's scale), so "
                           f"llama.cpp would read inf; nothing was written: write --gguf-type bf16 or f32")


def _encode(name: str, tensor: torch.Tensor, out_type: str) -> tuple[np.ndarray, str]:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quantize

    if tensor.ndim == 1 or name.endswith(("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")) or out_type == "f32":
        return tensor.float().numpy(), "F32"
    if out_type in QUANTIZED:
        # the embeddings and output matrix lose the most to 4 bits: llama-quantize keeps them at a higher type
        # for its 4-bit files, and so does this writer (Q8_0)
        low = out_type == "q4_0" and name in ("token_embd.weight", "output.weight")
        qtype = GGMLQuantizationType["Q8_0" if low else out_type.upper()]
        if tensor.shape[-1] % GGML_QUANT_SIZES[qtype][0] == 0:
            return quantize(tensor.float().numpy(), qtype), qtype.name
        return tensor.half().numpy(), "F16"
    if out_type == "f16":
        return tensor.half().numpy(), "F16"
    return tensor.bfloat16().view(torch.int16).numpy(), "BF16"    # numpy has no bfloat16: its bits, raw


def gguf_plan(model: nn.Module, target: StockClass, tokenizer, out_type: str = "f16") -> tuple[str, dict, dict]:
    """(llama.cpp arch, stock config, tokenizer values) of the GGUF file `write_gguf` would write, or the
    UpcycleError that says why llama.cpp cannot run it; reads no weight, so it runs before any output exists."""
    arch = ARCHS.get(target.name)
    if arch is None:
        raise UpcycleError(f"no llama.cpp arch for {target.architecture}")
    if out_type not in FILE_TYPES:
        raise UpcycleError(f"GGUF weight type must be one of {sorted(FILE_TYPES)}, got {out_type!r}")
    config = export_config(model, target)
    problems = gguf_problems(config, arch)
    if problems:
        raise UpcycleError(f"llama.cpp's {arch} cannot compute this model: {'; '.join(problems)}")
    if tokenizer is None:
        raise UpcycleError("GGUF export needs the model's tokenizer (llama.cpp loads none without one)")
    return arch, config, gguf_vocab(tokenizer, config["vocab_size"])


def write_gguf(model: nn.Module, target: StockClass, path: Path, tokenizer, *, out_type: str = "f16",
               name: str = "upcycled") -> dict:
    """Write `model` (upcycled, exportable as `target`) as a GGUF file at `path` and check it by reading it
    back; returns what was written. Refuses (UpcycleError, `gguf_plan`) before writing what llama.cpp would
    compute differently, and a tokenizer it cannot describe (gguf_vocab)."""
    import gguf

    arch, config, vocab = gguf_plan(model, target, tokenizer, out_type)
    tensors = {name: encode(name, t, out_type) for name, t in gguf_tensors(model, target, config).items()}
    head_dim = config["head_dim"]
    # Mixtral's intermediate_size is its experts' width (mixtral.py); the Qwen classes name it apart
    expert_width = config.get("moe_intermediate_size", config["intermediate_size"])

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name)
    writer.add_file_type(gguf.LlamaFileType[FILE_TYPES[out_type]])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    # llama's experts take their width from feed_forward_length; the Qwen archs from expert_feed_forward_length
    writer.add_feed_forward_length(expert_width if arch == "llama" else config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(config["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_expert_count(config["num_local_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    if arch != "llama":
        writer.add_expert_feed_forward_length(expert_width)
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    writer.add_tokenizer_model(vocab["model"])
    writer.add_tokenizer_pre(vocab["pre"])
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types(vocab["token_type"])
    writer.add_token_merges(vocab["merges"])
    for key, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                     ("unknown_token_id", writer.add_unk_token_id), ("padding_token_id", writer.add_pad_token_id)):
        if vocab[key] is not None:
            add(vocab[key])
    writer.add_add_bos_token(vocab["add_bos_token"])
    writer.add_add_eos_token(vocab["add_eos_token"])
    if vocab["chat_template"]:
        writer.add_chat_template(vocab["chat_template"])
    for tensor_name, (array, ggml_type) in tensors.items():
        # F32 and F16 are named by the numpy dtype; BF16 (raw int16 bits) and the quantized types by their type
        raw = gguf.GGMLQuantizationType[ggml_type] if ggml_type not in ("F32", "F16") else None
        writer.add_tensor(tensor_name, array, raw_dtype=raw)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    check_gguf(path, arch, tensors, vocab)
    info = {"format": "gguf", "arch": arch, "file": path.name, "weight_type": out_type, "tensors": len(tensors),
            "tokenizer_pre": vocab["pre"], "via": target.architecture}
    if not RENORMALIZES[arch]:
        info["note"] = (f"llama.cpp's {arch} uses raw top-k weights: this model was converted with "
                        f"moe.normalize_topk=false, {RAW_TOPK} (its report's check says by how much); "
                        "--export-class mixtral writes llama.cpp's llama arch, which renormalizes")
    return info


def check_gguf(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, str]], vocab: dict) -> None:
    """Read the file back with gguf.GGUFReader: every tensor there with its type, shape and bytes, nothing else,
    and the keys llama.cpp requires; an UpcycleError otherwise."""
    import gguf
    from gguf.quants import quant_shape_from_byte_shape

    reader = gguf.GGUFReader(str(path))
    found = {t.name: t for t in reader.tensors}
    if set(found) != set(tensors):
        raise UpcycleError(f"{path}: tensors read back differ (missing {sorted(set(tensors) - set(found))[:5]}, "
                           f"extra {sorted(set(found) - set(tensors))[:5]})")
    for tensor_name, (array, ggml_type) in tensors.items():
        t = found[tensor_name]
        # ggml lists dimensions innermost first, in elements: reversed, they are the numpy shape written (a
        # quantized tensor's numpy rows are its blocks' bytes)
        shape = tuple(int(n) for n in reversed(t.shape))
        written = array.shape if ggml_type in FLOAT_TYPES else \
            quant_shape_from_byte_shape(array.shape, gguf.GGMLQuantizationType[ggml_type])
        if t.tensor_type.name != ggml_type or shape != written or \
                np.asarray(t.data).tobytes() != np.ascontiguousarray(array).tobytes():
            raise UpcycleError(f"{path}: tensor {tensor_name} reads back different")
    keys = [k.format(arch=arch) for k in REQUIRED_KEYS]
    missing = [k for k in keys if k not in reader.fields]
    if missing:
        raise UpcycleError(f"{path}: llama.cpp's keys {missing} are missing")
    if len(reader.fields["tokenizer.ggml.tokens"].data) != len(vocab["tokens"]):
        raise UpcycleError(f"{path}: the vocabulary reads back with another length")

"""An upcycled decoder in a stock transformers MoE class's layout: which class, its config, its tensors.

Targets (`registry.py`): Llama, Mistral and Qwen2 sources -> Qwen2MoeForCausalLM; Qwen3 -> Qwen3MoeForCausalLM;
Llama and Mistral with every block MoE and no shared expert -> MixtralForCausalLM, when asked. Everything else
(GPT-2, BERT, CLIP, Gemma 3, Phi-3) has no stock class that computes the same function; the upcycle format stays
the output and `export_target` says why.

What no stock class can express is refused rather than silently changed: expert capacity (they are dropless), a
non-zero selection bias, expert or router biases, sigmoid routing, a route scale, a source attention output bias or
dense MLP biases. Every scale is folded into weights, never left in a config key a stock class might ignore
(docs/methods.md §2.8). Weights are written in the per-expert key layout (`experts.{e}.gate_proj.weight`), which
transformers 4.x reads as is and 5.x converts on load. `config.json` is written as `save_pretrained` of a fresh
stock model writes it (only the values that differ from the class's defaults), plus the keys the class needs
whatever their value (ALWAYS_WRITTEN), among them the ones 4.x and 5.x read under different names (`num_experts` and
`num_local_experts`; `rope_theta`/`rope_scaling` and `rope_parameters`; `torch_dtype` and `dtype`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn

from ..checkpoint.upcycle_format import moe_spec, save_configs, save_tokenizer
from ..core.moe import moe_layers
from ..errors import UpcycleError
from .protocol import StockClass
from .qwen2_moe import head_dim
from .registry import STOCK_CLASSES

# Written whatever their value: the shape of the model and the keys 4.x and 5.x read under different names, so
# that neither major falls back to a default of its own (a default may change between versions).
ALWAYS_WRITTEN = frozenset({
    "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings",
    "rms_norm_eps", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "num_experts",
    "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
    "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "rope_theta", "rope_scaling", "rope_parameters",
    "use_sliding_window", "sliding_window", "max_window_layers", "qkv_bias", "attention_bias",
    "router_aux_loss_coef", "output_router_logits", "torch_dtype", "dtype", "transformers_version"})


def export_target(model: nn.Module, export_class: str = "auto") -> StockClass:
    """The stock class this upcycled model exports to, or an UpcycleError that says why none fits. `auto`: of the
    registered classes for its type that can express it, the first that llama.cpp reads as transformers does
    (`runtimes_note` is None), else the first (its note then says which route works)."""
    source = model.config.model_type
    allowed = [c for c in STOCK_CLASSES.values() if source in c.sources]
    if export_class != "auto" and export_class not in STOCK_CLASSES:
        raise UpcycleError(f"export class must be auto or one of {sorted(STOCK_CLASSES)}, got {export_class!r}")
    if not allowed:
        raise UpcycleError(f"no stock transformers MoE class computes a {source!r} model's function "
                           "(stock MoE classes are Llama-style decoders); the upcycle format is the output")
    if export_class != "auto":
        wanted = STOCK_CLASSES[export_class]
        if wanted not in allowed:
            raise UpcycleError(f"a {source} source exports to {sorted(c.name for c in allowed)}, not {wanted.name}")
        _check_fits(model, wanted)
        return wanted
    fitting, first_error = [], None
    for candidate in allowed:
        try:
            _check_fits(model, candidate)
        except UpcycleError as e:
            first_error = first_error or e
            continue
        fitting.append(candidate)
    if not fitting:
        raise first_error
    return next((c for c in fitting if runtimes_note(model, c) is None), fitting[0])


def runtimes_note(model: nn.Module, target: StockClass) -> str | None:
    """What llama.cpp (a recommended runtime, through its own convert_hf_to_gguf.py or upcycle's GGUF writer)
    computes otherwise than transformers for `model` written as `target`, and the route that works; None when it
    reads the class as transformers does. Today: whether the top-k weights are renormalized (llama.cpp's qwen2moe
    never renormalizes, whatever norm_topk_prob says; its llama and qwen3moe always do)."""
    layers = moe_layers(model)
    if not layers or not target.llama_cpp_arch:
        return None
    renormalized = next(iter(layers.values())).normalize_topk
    if renormalized == target.llama_cpp_renormalizes:
        return None
    others = [c.name for c in STOCK_CLASSES.values() if model.config.model_type in c.sources
              and c.llama_cpp_renormalizes == renormalized and c is not target]
    route = (f"export with --export-class {' or '.join(others)} (which needs every block MoE)" if others else
             "no stock class of this source is read that way by llama.cpp")
    fix = "--set moe.normalize_topk=false" if renormalized else "--set moe.normalize_topk=true"
    return (f"{target.architecture} computes this model in transformers, but llama.cpp's {target.llama_cpp_arch} "
            f"{'uses top-k weights raw' if target.llama_cpp_renormalizes is False else 'renormalizes top-k weights'}"
            f" where this model {'renormalizes them' if renormalized else 'uses them raw'}, so a GGUF file made of "
            f"it (convert_hf_to_gguf.py or upcycle export --format gguf) computes another function. For llama.cpp: "
            f"{route}, or convert with {fix}")


def _check_fits(model: nn.Module, wanted: StockClass) -> None:
    """An UpcycleError saying why `wanted` cannot express the upcycled model; nothing when it can."""
    source = model.config.model_type
    layers = moe_layers(model)
    if not layers:
        raise UpcycleError("the model has no MoE layer to export")
    for name, layer in layers.items():
        problems = []
        if layer.capacity_factor_train is not None or layer.capacity_factor_eval is not None:
            problems.append("expert capacity (stock MoE classes are dropless)")
        if not layer.selection_bias.is_meta and torch.any(layer.selection_bias != 0):   # meta: a plan
            problems.append("a non-zero selection bias (aux-free balancing)")
        e = layer.experts
        if e.bias_in or e.bias_down or layer.router.bias is not None:
            problems.append("expert or router biases")
        if layer.router.score != "softmax":
            problems.append(f"{layer.router.score} routing (the stock classes route by softmax)")
        if layer.router.route_scale != 1.0:
            problems.append("a route scale (the stock classes have none)")
        problems += wanted.layer_problems(layer)
        if problems:
            raise UpcycleError(f"layer {name} cannot be written as {wanted.architecture}: {'; '.join(problems)}")
    n_blocks = model.config.num_hidden_layers
    if wanted.every_block and len(layers) != n_blocks:
        raise UpcycleError(f"{wanted.architecture.removesuffix('ForCausalLM')} needs every block to be MoE "
                           f"({len(layers)} of {n_blocks} are)")
    if getattr(model.config, "attention_bias", False) and source == "llama":
        raise UpcycleError("the source's attention has output biases, which the stock MoE classes lack")
    if getattr(model.config, "mlp_bias", False):
        raise UpcycleError("the source's dense MLPs have biases, which the stock MoE classes lack")


def _block_index(name: str) -> int:
    """'model.layers.7.mlp' -> 7."""
    parts = name.split(".")
    return int(parts[parts.index("layers") + 1])


def export_config(model: nn.Module, target: StockClass) -> dict:
    """The stock config as a fresh stock model would save it: the values that differ from the class's
    defaults, plus ALWAYS_WRITTEN (see the module docstring)."""
    import transformers

    full = _full_config(model, target)
    defaults = getattr(transformers, target.config_class)().to_dict()
    full.setdefault("router_aux_loss_coef", defaults.get("router_aux_loss_coef", 0.001))
    full["transformers_version"] = transformers.__version__
    return {k: v for k, v in full.items() if k in ALWAYS_WRITTEN or k not in defaults or defaults[k] != v}


def _full_config(model: nn.Module, target: StockClass) -> dict:
    """Every key of the source config, changed to the stock class's meaning."""
    src = model.config.to_dict()
    blocks = {_block_index(n): layer for n, layer in moe_layers(model).items()}
    first = next(iter(blocks.values()))
    config = {k: v for k, v in src.items() if k not in ("architectures", "model_type", "transformers_version",
                                                      "_name_or_path", "mlp_bias", "pretraining_tp")}
    rope = src.get("rope_parameters") or {}
    rope_theta = rope.get("rope_theta", src.get("rope_theta", 10000.0))
    rope_scaling = {k: v for k, v in rope.items() if k != "rope_theta"} or src.get("rope_scaling")
    if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
        rope_scaling = None
    config.update({
        "architectures": [target.architecture], "model_type": target.model_type,
        "num_experts": first.num_experts, "num_local_experts": first.num_experts,
        "num_experts_per_tok": first.top_k, "rope_theta": rope_theta, "rope_scaling": rope_scaling,
        "rope_parameters": {"rope_theta": rope_theta, **(rope_scaling or {"rope_type": "default"})},
        "head_dim": head_dim(model.config),
        "output_router_logits": False,
        "torch_dtype": str(model.dtype).removeprefix("torch."), "dtype": str(model.dtype).removeprefix("torch."),
    })
    config.update(target.config_keys(model, blocks, src))
    if target.untied_head:
        config["tie_word_embeddings"] = False
    return config


def export_state_dict(model: nn.Module, target: StockClass, prefix: str = "", *, copy: bool = True
                      ) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """Stock-layout tensors, and the scales folded into them; with `prefix` (a block's path and a dot), only
    the tensors of that part of the model (the streaming conversion writes a block at a time). `copy=False`
    returns views of the model's tensors where the layout allows (the streaming writer copies the bytes itself;
    a state dict handed to safetensors' save must own its memory)."""
    def own(t: torch.Tensor) -> torch.Tensor:
        t = t.detach().contiguous()
        return t.clone() if copy else t

    moe = {name: layer for name, layer in moe_layers(model).items() if name.startswith(prefix)}
    out, folded = {}, []
    for key, tensor in model.state_dict().items():
        if key.startswith(prefix) and not any(key.startswith(name + ".") for name in moe):
            out[key] = own(tensor)
    for key, tensor in target.model_tensors(model, prefix).items():
        out.setdefault(key, tensor)          # only where the source has none (Qwen2-MoE's attention biases)
    gate_key, up_key, down_key = target.expert_keys
    for name, layer in moe.items():
        w = layer.experts.weights()
        block = target.block_prefix(name)
        out[f"{block}.gate.weight"] = own(layer.router.weight.to(model.dtype))
        for e in range(layer.num_experts):
            for part, tensor in ((gate_key, w.w_gate[e]), (up_key, w.w_up[e]), (down_key, w.w_down[e])):
                out[f"{block}.experts.{e}.{part}.weight"] = own(tensor)
        extra, scales = target.block_tensors(model, name, layer)
        out.update(extra)
        folded += scales
    if getattr(model.config, "tie_word_embeddings", False) and not target.untied_head:
        out.pop("lm_head.weight", None)       # tied: stored once, as both versions expect
    return out, folded


def export_specs(model: nn.Module, target: StockClass) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of every tensor the stock checkpoint holds, from a model on the meta device."""
    return [(k, tuple(t.shape), t.dtype) for k, t in export_state_dict(model, target)[0].items()]


def folded_scales(model: nn.Module, target: StockClass) -> list[dict]:
    """The scales an export folds into weights (Qwen2-MoE's shared expert x2), from the model's layers alone."""
    return [scale for name, layer in moe_layers(model).items()
            for scale in target.block_tensors(model, name, layer)[1]] if target.shared_experts else []


def write_configs(planned: nn.Module, stock: StockClass | None, directory: Path, tokenizer=None) -> None:
    """The configs of an output whose weights were written block by block (streamed or merged): ours
    (`upcycle_format.save_configs`), or the stock class's when `stock` is chosen."""
    if stock is None:
        save_configs(planned, directory, moe_spec(planned), tokenizer)
    else:
        write_stock_configs(planned, stock, directory, tokenizer)


def write_stock_configs(model: nn.Module, target: StockClass, directory: Path, tokenizer=None) -> dict:
    """config.json (both majors' keys), the generation config and the tokenizer of a stock checkpoint."""
    config = export_config(model, target)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(directory)
    if tokenizer is not None:
        save_tokenizer(tokenizer, directory)
    return config


def choose_export(model: nn.Module, export: str, export_class: str) -> tuple[StockClass | None, str | None]:
    """The stock class a conversion writes (`export: hf`), decided once for every conversion path: (the class,
    None), or (None, why) when `export_class: auto` finds none that computes the model (the upcycle format is
    written instead, and the report says why). A class the user named that does not fit is an error.
    `model`: the upcycled model, or the weightless planned one (`planned.planned_model`)."""
    if export != "hf":
        return None, None
    try:
        return export_target(model, export_class), None
    except UpcycleError as e:
        if export_class != "auto":
            raise
        from tqdm.auto import tqdm

        tqdm.write(f"[upcycle] not exported to a stock class: {e}", file=sys.stderr)
        return None, str(e)

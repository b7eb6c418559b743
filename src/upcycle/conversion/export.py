"""Export an upcycled decoder to a stock transformers MoE class that loads with no custom code.

DESIGN principle 7 and METHODS §2.8. Targets:
  llama, mistral, qwen2 sources -> Qwen2MoeForCausalLM (`qwen2_moe`)
  qwen3 sources                 -> Qwen3MoeForCausalLM (`qwen3_moe`)
  llama, mistral with every block MoE and no shared expert -> MixtralForCausalLM, when asked
Everything else (GPT-2, BERT, CLIP, ...) has no stock class that computes the same function; the upcycle
format stays the output and `export_target` says why.

What the stock classes cannot express is refused rather than silently changed: expert capacity (they are
dropless), a non-zero selection bias, expert biases, a source attention output bias. Every scale is folded
into weights, never left in a config key a stock class might ignore:
  - Qwen2-MoE gates its shared expert by sigmoid(shared_expert_gate x); a zero gate weight gives 0.5, so the
    shared expert's down projection is written x2 (with several shared experts, their concatenation).
  - With no shared expert, Qwen2-MoE (whose blocks always have one) gets a shared expert of width 1 with all
    weights zero: its output is exactly zero, and so is every gradient of it and of its gate (h = act(0) * 0,
    a fixed point of training), so it stays a no-op. Width 0 would be the same function, but every load in
    transformers 5 then warns "Initializing zero-element tensors is a no-op" and peft wraps empty tensors.
    peft 0.21's LoRA, targeted by projection name, still wraps the width-1 projections; their adapters' gradients
    are exactly zero too (checked by hand). The cost is 4 x hidden_size parameters per MoE block.
Weights are written in the per-expert key layout (`experts.{e}.gate_proj.weight`, Mixtral's
`block_sparse_moe.experts.{e}.w1.weight`), which transformers 4.x reads as is and 5.x converts on load.
`config.json` is written as `save_pretrained` of a fresh stock model writes it (only the values that differ
from the class's defaults), plus the keys the class needs whatever their value, among them the ones 4.x and
5.x read under different names (`num_experts` and `num_local_experts`; `rope_theta`/`rope_scaling` and
`rope_parameters`; `torch_dtype` and `dtype`), `router_aux_loss_coef` and `transformers_version`.
The tokenizer is saved with a `tokenizer_class` both majors know (`upcycle.conversion.io.save_tokenizer`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from ..config import EXPORT_CLASS_NAMES
from ..core.architectures import family_of
from ..core.modes import eval_mode
from ..core.moe import moe_layers
from ..errors import UpcycleError
from .io import save_tokenizer
from .preservation import input_device

EXPORT_CLASSES = {"qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                  "mixtral": "MixtralForCausalLM"}
assert tuple(EXPORT_CLASSES) == EXPORT_CLASS_NAMES, "the config's export_class choices are these classes"
CONFIG_CLASSES = {"qwen2_moe": "Qwen2MoeConfig", "qwen3_moe": "Qwen3MoeConfig", "mixtral": "MixtralConfig"}
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


@dataclass(frozen=True)
class Target:
    model_type: str
    architecture: str


def export_target(model: nn.Module, export_class: str = "auto") -> Target:
    """The stock class this upcycled model exports to, or an UpcycleError that says why none fits."""
    source = model.config.model_type
    allowed = (family_of(model.config).stock_exports or {}).get(source)
    if not allowed:
        raise UpcycleError(f"no stock transformers MoE class computes a {source!r} model's function "
                           "(stock MoE classes are Llama-style decoders); the upcycle format is the output")
    if export_class not in ("auto", *EXPORT_CLASSES):
        raise UpcycleError(f"export class must be auto or one of {sorted(EXPORT_CLASSES)}, got {export_class!r}")
    wanted = export_class if export_class != "auto" else allowed[0]
    if wanted not in allowed:
        raise UpcycleError(f"a {source} source exports to {sorted(allowed)}, not {wanted}")
    layers = moe_layers(model)
    if not layers:
        raise UpcycleError("the model has no MoE layer to export")
    for name, layer in layers.items():
        e = layer.experts
        problems = []
        if layer.capacity_factor_train is not None or layer.capacity_factor_eval is not None:
            problems.append("expert capacity (stock MoE classes are dropless)")
        if not layer.selection_bias.is_meta and torch.any(layer.selection_bias != 0):   # meta: a plan
            problems.append("a non-zero selection bias (aux-free balancing)")
        if e.b_in is not None or e.b_down is not None or layer.router.bias is not None:
            problems.append("expert or router biases")
        if wanted != "qwen2_moe" and layer.shared_experts is not None:
            problems.append(f"shared experts ({wanted} has none)")
        if layer.router.score != "softmax":
            problems.append(f"{layer.router.score} routing (the stock classes route by softmax)")
        if layer.router.route_scale != 1.0:
            problems.append("a route scale (the stock classes have none)")
        if wanted == "mixtral" and not layer.normalize_topk:
            problems.append("raw top-k weights (Mixtral always renormalizes)")
        if problems:
            raise UpcycleError(f"layer {name} cannot be written as {EXPORT_CLASSES[wanted]}: {'; '.join(problems)}")
    n_blocks = model.config.num_hidden_layers
    if wanted == "mixtral" and len(layers) != n_blocks:
        raise UpcycleError(f"Mixtral needs every block to be MoE ({len(layers)} of {n_blocks} are)")
    if getattr(model.config, "attention_bias", False) and source == "llama":
        raise UpcycleError("the source's attention has output biases, which the stock MoE classes lack")
    if getattr(model.config, "mlp_bias", False):
        raise UpcycleError("the source's dense MLPs have biases, which the stock MoE classes lack")
    return Target(wanted, EXPORT_CLASSES[wanted])


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _block_index(name: str) -> int:
    """'model.layers.7.mlp' -> 7."""
    parts = name.split(".")
    return int(parts[parts.index("layers") + 1])


def export_config(model: nn.Module, target: Target) -> dict:
    """The stock config as a fresh stock model would save it: the values that differ from the class's
    defaults, plus ALWAYS_WRITTEN (see the module docstring)."""
    import transformers

    full = _full_config(model, target)
    defaults = getattr(transformers, CONFIG_CLASSES[target.model_type])().to_dict()
    full.setdefault("router_aux_loss_coef", defaults.get("router_aux_loss_coef", 0.001))
    full["transformers_version"] = transformers.__version__
    return {k: v for k, v in full.items() if k in ALWAYS_WRITTEN or k not in defaults or defaults[k] != v}


def _full_config(model: nn.Module, target: Target) -> dict:
    """Every key of the source config, changed to the stock class's meaning."""
    src = model.config.to_dict()
    layers = {_block_index(n): layer for n, layer in moe_layers(model).items()}
    first = next(iter(layers.values()))
    n_blocks = model.config.num_hidden_layers
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
        "head_dim": _head_dim(model.config),
        "output_router_logits": False,
        "torch_dtype": str(model.dtype).removeprefix("torch."), "dtype": str(model.dtype).removeprefix("torch."),
    })
    if target.model_type == "mixtral":
        config.update({"intermediate_size": first.experts.intermediate_size, "router_jitter_noise": 0.0,
                       "sliding_window": src.get("sliding_window")})
        return config
    shared = first.shared_experts
    config.update({
        "moe_intermediate_size": first.experts.intermediate_size, "norm_topk_prob": first.normalize_topk,
        "decoder_sparse_step": 1, "mlp_only_layers": [i for i in range(n_blocks) if i not in layers],
        "use_sliding_window": False, "sliding_window": None, "max_window_layers": n_blocks,
    })
    if target.model_type == "qwen2_moe":
        config.update({"qkv_bias": True, "shared_expert_intermediate_size":
                       shared.num_experts * shared.intermediate_size if shared is not None else 1})
    else:
        config["attention_bias"] = bool(src.get("attention_bias", False))
    return config


def export_state_dict(model: nn.Module, target: Target, prefix: str = "", *, copy: bool = True
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
    if target.model_type == "qwen2_moe":      # Qwen2-MoE's q/k/v always carry biases: zeros when the source has none
        width = {"q_proj": model.config.num_attention_heads, "k_proj": model.config.num_key_value_heads,
                 "v_proj": model.config.num_key_value_heads}
        head_dim = _head_dim(model.config)
        for i in range(model.config.num_hidden_layers):
            for proj, heads in width.items():
                key = f"model.layers.{i}.self_attn.{proj}.bias"
                if key.startswith(prefix):
                    out.setdefault(key, torch.zeros(heads * head_dim, dtype=model.dtype))
    for name, layer in moe.items():
        w = layer.experts.weights()
        prefix = name.replace(".mlp", ".block_sparse_moe") if target.model_type == "mixtral" else name
        out[f"{prefix}.gate.weight"] = own(layer.router.weight.to(model.dtype))
        for e in range(layer.num_experts):
            if target.model_type == "mixtral":
                parts = {"w1": w.w_gate[e], "w3": w.w_up[e], "w2": w.w_down[e]}
            else:
                parts = {"gate_proj": w.w_gate[e], "up_proj": w.w_up[e], "down_proj": w.w_down[e]}
            for part, tensor in parts.items():
                out[f"{prefix}.experts.{e}.{part}.weight"] = own(tensor)
        if target.model_type == "qwen2_moe":
            s = layer.shared_experts.weights() if layer.shared_experts is not None else None
            D = layer.experts.w_down.shape[1]
            # several shared experts = one wider shared expert (their outputs add up); none = width 1, all zero
            gate = torch.cat(list(s.w_gate)) if s is not None else torch.zeros(1, D, dtype=model.dtype)
            up = torch.cat(list(s.w_up)) if s is not None else torch.zeros(1, D, dtype=model.dtype)
            down = torch.cat(list(s.w_down), dim=1) * 2 if s is not None else torch.zeros(D, 1, dtype=model.dtype)
            out[f"{name}.shared_expert.gate_proj.weight"] = gate.contiguous()
            out[f"{name}.shared_expert.up_proj.weight"] = up.contiguous()
            out[f"{name}.shared_expert.down_proj.weight"] = down.contiguous()
            out[f"{name}.shared_expert_gate.weight"] = torch.zeros(1, D, dtype=model.dtype)
            if s is not None:
                folded.append({"layer": name, "scale": 2.0, "into": "shared_expert.down_proj",
                               "why": "sigmoid(shared_expert_gate x) = 0.5 for the zero gate weight"})
    if getattr(model.config, "tie_word_embeddings", False):
        out.pop("lm_head.weight", None)       # tied: stored once, as both versions expect
    return out, folded


def export_specs(model: nn.Module, target: Target) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of every tensor the stock checkpoint holds, from a model on the meta device."""
    return [(k, tuple(t.shape), t.dtype) for k, t in export_state_dict(model, target)[0].items()]


def write_stock_configs(model: nn.Module, target: Target, directory: Path, tokenizer=None) -> dict:
    """config.json (both majors' keys), the generation config and the tokenizer of a stock checkpoint."""
    import json

    config = export_config(model, target)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(directory)
    if tokenizer is not None:
        save_tokenizer(tokenizer, directory)
    return config


def folded_scales(model: nn.Module, target: Target) -> list[dict]:
    """The scales an export folds into weights (Qwen2-MoE's shared expert x2), from the model's layers."""
    if target.model_type != "qwen2_moe":
        return []
    return [{"layer": name, "scale": 2.0, "into": "shared_expert.down_proj",
             "why": "sigmoid(shared_expert_gate x) = 0.5 for the zero gate weight"}
            for name, layer in moe_layers(model).items() if layer.shared_experts is not None]


def export_hf(model: nn.Module, directory: str | Path, *, input_ids: torch.Tensor, tolerance: float,
              export_class: str = "auto", tokenizer=None) -> dict:
    """Write the stock checkpoint into an existing (temporary) directory, load it back with plain
    transformers and compare its logits with `model`'s on `input_ids`; return what was done."""

    directory = Path(directory)
    target = export_target(model, export_class)
    config = write_stock_configs(model, target, directory, tokenizer)
    tensors, folded = export_state_dict(model, target)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    diff = compare_with_stock(model, directory, input_ids)
    if diff > tolerance:
        raise UpcycleError(f"the exported {target.architecture} differs from the upcycled model by {diff:.3g} "
                           f"> tolerance {tolerance:g}; nothing was written")
    return {"format": "hf", "class": target.architecture, "model_type": target.model_type,
            "folded_scales": folded, "dense_layers": config.get("mlp_only_layers", []),
            "max_abs_logit_diff_vs_upcycle": diff}


@torch.no_grad()
def compare_with_stock(model: nn.Module, directory: str | Path, input_ids: torch.Tensor) -> float:
    """Load the written folder with plain AutoModelForCausalLM and return max |logit difference| vs `model`."""
    from transformers import AutoModelForCausalLM

    device = input_device(model)          # the GPU with --device cuda: both run there
    stock = AutoModelForCausalLM.from_pretrained(directory, dtype=model.dtype, trust_remote_code=False)
    stock = stock.to(device).eval()
    input_ids = input_ids.to(device)
    with eval_mode(model):
        ours = model(input_ids=input_ids).logits.float()
    return (stock(input_ids=input_ids).logits.float() - ours).abs().max().item()


def export_folder(src: str | Path, out: str | Path, *, export_class: str = "auto", overwrite: bool = False,
                  tolerance: float = 1e-5) -> dict:
    """`upcycle export IN OUT`: an upcycle-format folder -> a stock checkpoint, checked against the original."""
    import json

    from ..config import CheckConfig
    from ..files import json_text
    from ..outputs import claim_output, inputs
    from .io import load
    from .loading import load_tokenizer
    from .preservation import make_probe

    src, out = Path(src), Path(out)
    with claim_output(out, kind="export", given=inputs(("upcycle folder", src)), overwrite=overwrite) as claim:
        if not src.is_dir():
            raise UpcycleError(f"{src} is not a folder; export takes a folder written by `upcycle convert`")
        model = load(src)
        export_target(model, export_class)          # refuse before writing anything
        tokenizer = load_tokenizer(src)
        probe_ids = make_probe(model, None, None, CheckConfig(), seed=0).inputs["input_ids"]
        report_file = src / "upcycle_report.json"
        try:
            report = json.loads(report_file.read_text()) if report_file.is_file() else {}
        except (OSError, ValueError, UnicodeDecodeError) as e:
            raise UpcycleError(f"{report_file} cannot be read ({type(e).__name__}: {e})") from None
        if not isinstance(report, dict):
            raise UpcycleError(f"{report_file} is not a conversion report (a JSON object)")
        with claim.directory() as tmp:
            info = export_hf(model, tmp, input_ids=probe_ids, tolerance=tolerance, export_class=export_class,
                             tokenizer=tokenizer)
            report["export"] = {**info, "source_folder": str(src.resolve())}
            (tmp / "upcycle_report.json").write_text(json_text(report, indent=2, where="upcycle_report.json"))
    return report["export"]

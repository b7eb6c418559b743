"""Architecture adapters: where each model family keeps its FFNs, and how to read and replace them.

DESIGN principle 1: methods never see model classes. An adapter maps a family's FFN module to the canonical
`FFNWeights` and installs an `MoELayer` in its place. Adding an architecture means adding one `Family` row.

  gated decoders (llama, mistral, qwen2, qwen3): block.mlp = {gate,up,down}_proj  -> block.mlp = MoE
  gemma3_text: the same layout, GeGLU (the activation is `hidden_activation`)
  phi3: block.mlp = {gate_up_proj (gate rows first), down_proj}, fused -> split into gate and up
  gpt2: block.mlp = {c_fc, c_proj} as Conv1D ([in, out] weights, transposed here) -> block.mlp = MoE
  bert: the FFN is split: block.intermediate (dense + act) and block.output (dense, dropout, residual,
        LayerNorm) -> block.intermediate = MoE (whole FFN), block.output.dense = Identity, so BertOutput
        still applies dropout, the residual and its LayerNorm to the MoE output
  clip: vision and text towers, block.mlp = {fc1, fc2} -> block.mlp = MoE
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from ..errors import UpcycleError
from .ffn import FFNWeights


@dataclass(frozen=True)
class Tower:
    layers: str            # qualified-name suffix of the tower's nn.ModuleList of blocks
    mask_root_up: int | None  # levels above the list of the module whose forward takes the 2-D padding mask
    config_attr: str | None = None  # sub-config holding this tower's hyper-parameters (CLIP)


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    towers: dict[str, Tower]
    extract: Callable[[nn.Module, object], FFNWeights]     # (block, tower config) -> dense FFN
    install: Callable[[nn.Module, nn.Module], None]          # (block, MoE layer) -> None
    output_dropout: Callable[[object], float] = lambda cfg: 0.0
    # model types whose modules are laid out differently from `towers` (single-tower CLIP models)
    towers_by_type: dict[str, dict[str, Tower]] | None = None
    # the module of a block whose first input is the FFN's input (calibration captures it there)
    ffn_input: Callable[[nn.Module], nn.Module] = lambda block: block.mlp
    # stock transformers MoE classes that compute an upcycled model of each source model type (`--export hf`),
    # the first being `auto`'s choice; a type not listed has none (the upcycle format is its output)
    stock_exports: dict[str, tuple[str, ...]] | None = None
    # the transformers Auto class a dense checkpoint without a known architecture class loads with
    auto_class: str = "AutoModelForCausalLM"

    def towers_of(self, config) -> dict[str, Tower]:
        return (self.towers_by_type or {}).get(config.model_type, self.towers)


def _linear_parts(up: nn.Linear, down: nn.Linear, activation: str, gate: nn.Linear | None = None) -> FFNWeights:
    def t(x):
        return None if x is None else x.detach()

    return FFNWeights(w_up=t(up.weight), b_up=t(up.bias), w_down=t(down.weight), b_down=t(down.bias),
                      w_gate=None if gate is None else t(gate.weight), b_gate=None if gate is None else t(gate.bias),
                      activation=activation)


def _activation(cfg, attr: str = "hidden_act") -> str:
    act = getattr(cfg, attr)
    if not isinstance(act, str):
        raise UpcycleError(f"activation {act!r} is not a named activation; upcycle needs a name from ACT2FN")
    return act


def _gated_extract(block, cfg) -> FFNWeights:
    mlp = block.mlp
    return _linear_parts(mlp.up_proj, mlp.down_proj, _activation(cfg), gate=mlp.gate_proj)


def _gemma_extract(block, cfg) -> FFNWeights:
    mlp = block.mlp
    return _linear_parts(mlp.up_proj, mlp.down_proj, _activation(cfg, "hidden_activation"), gate=mlp.gate_proj)


def _phi3_extract(block, cfg) -> FFNWeights:
    """Phi-3's fused gate_up_proj [2F, D] holds gate rows first (its forward chunks gate, up in that order)."""
    fused = block.mlp.gate_up_proj.weight.detach()
    gate, up = fused.chunk(2, dim=0)
    return FFNWeights(w_gate=gate, w_up=up, w_down=block.mlp.down_proj.weight.detach(), activation=_activation(cfg))


def _gpt2_extract(block, cfg) -> FFNWeights:
    mlp = block.mlp  # Conv1D stores weight as [in, out]: transpose to nn.Linear layout
    return FFNWeights(w_up=mlp.c_fc.weight.detach().t(), b_up=mlp.c_fc.bias.detach(),
                      w_down=mlp.c_proj.weight.detach().t(), b_down=mlp.c_proj.bias.detach(),
                      activation=_activation(cfg, "activation_function"))


def _bert_extract(block, cfg) -> FFNWeights:
    return _linear_parts(block.intermediate.dense, block.output.dense, _activation(cfg))


def _bert_install(block, moe) -> None:
    block.intermediate = moe
    block.output.dense = nn.Identity()


def _clip_extract(block, cfg) -> FFNWeights:
    return _linear_parts(block.mlp.fc1, block.mlp.fc2, _activation(cfg))


def _set_mlp(block, moe) -> None:
    block.mlp = moe


FAMILIES = (
    Family("gated-decoder", ("llama", "mistral", "qwen2", "qwen3"), {"text": Tower("layers", 1)},
           _gated_extract, _set_mlp,
           stock_exports={"llama": ("qwen2_moe", "mixtral"), "mistral": ("qwen2_moe", "mixtral"),
                          "qwen2": ("qwen2_moe",), "qwen3": ("qwen3_moe",)}),
    # Gemma 3: norms around the FFN and a scaled embedding that no stock MoE class has, so no export
    Family("gemma", ("gemma3_text",), {"text": Tower("layers", 1)}, _gemma_extract, _set_mlp),
    # Phi-3: fused qkv attention, which the stock MoE classes lack, so no export
    Family("phi3", ("phi3",), {"text": Tower("layers", 1)}, _phi3_extract, _set_mlp),
    Family("gpt2", ("gpt2",), {"text": Tower("h", 1)}, _gpt2_extract, _set_mlp,
           output_dropout=lambda cfg: cfg.resid_pdrop),
    Family("bert", ("bert",), {"text": Tower("encoder.layer", 2)}, _bert_extract, _bert_install,
           ffn_input=lambda block: block.intermediate, auto_class="AutoModel"),
    Family("clip", ("clip", "clip_text_model", "clip_vision_model"),
           {"text": Tower("text_model.encoder.layers", 2, "text_config"),
            "vision": Tower("vision_model.encoder.layers", None, "vision_config")},
           _clip_extract, _set_mlp, auto_class="AutoModel",
           # transformers 5's CLIPTextModel / CLIPVisionModel hold their encoder at the top level
           towers_by_type={"clip_text_model": {"text": Tower("encoder.layers", 2)},
                           "clip_vision_model": {"vision": Tower("encoder.layers", None)}}),
)

SUPPORTED_MODEL_TYPES = tuple(t for f in FAMILIES for t in f.model_types)


def family_of(config) -> Family:
    """The adapter for a transformers config, or an error listing what is supported."""
    model_type = getattr(config, "model_type", None)
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    raise UpcycleError(f"unsupported architecture {model_type!r}; supported model types: "
                       f"{', '.join(SUPPORTED_MODEL_TYPES)}")


def tower_config(config, tower: Tower):
    """CLIPModel keeps per-tower configs; CLIPTextModel and single-tower models keep one."""
    return getattr(config, tower.config_attr, config) if tower.config_attr else config


def find_tower_layers(model: nn.Module, tower: Tower) -> tuple[str, nn.ModuleList] | None:
    """The tower's block list, found by qualified-name suffix so head models and base models both work."""
    hits = [(name, m) for name, m in model.named_modules()
            if isinstance(m, nn.ModuleList) and (name == tower.layers or name.endswith("." + tower.layers))]
    if len(hits) > 1:
        raise UpcycleError(f"ambiguous: several module lists end with {tower.layers!r}: {[n for n, _ in hits]}")
    return hits[0] if hits else None


def mask_root(model: nn.Module, layers_path: str, tower: Tower) -> nn.Module | None:
    """The module whose forward receives this tower's [B, S] attention mask (None: the tower has none)."""
    if tower.mask_root_up is None:
        return None
    parts = layers_path.split(".")
    root_path = ".".join(parts[: len(parts) - tower.mask_root_up])
    return model.get_submodule(root_path) if root_path else model

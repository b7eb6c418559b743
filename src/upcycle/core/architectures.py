"""Architecture adapters: where each model family keeps its FFNs, how to read and replace them, and what else the
pipeline must know about the family.

docs/design.md principle 1: methods never see model classes. An adapter maps a family's FFN module to the canonical
`FFNWeights` and installs an `MoELayer` in its place. Adding an architecture means adding one `Family` row: the
rest of the package reads what it needs about a family from its row (tests/package/test_architectures.py adds two
families at test time that way). A row states
  - its model types, and per tower: the block list, the model input it reads (token ids or pixels, so the probe
    and the input checks know what to feed), whether it has a padding mask (and which module receives it), and
    the sub-config holding its sizes;
  - how to extract the dense FFN of a block, how to install the MoE layer, where the FFN's input is, and the
    FFN output's dropout;
  - which model output the preservation check compares, the training task of types that do not predict the
    next token, whether it attends both ways, its learned position tables, and its stock MoE exports and Auto
    class.

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

# The model inputs a tower can read (the forward's argument names). A probe draws token ids below the tower config's
# `vocab_size` (or tokenizes held-out text); pixels as [N, num_channels, image_size, image_size] standard normals.
TOKEN_IDS, PIXELS = "input_ids", "pixel_values"
MODEL_INPUTS = (TOKEN_IDS, PIXELS)


@dataclass(frozen=True)
class Tower:
    layers: str            # qualified-name suffix of the tower's nn.ModuleList of blocks
    # levels above the list of the module whose forward takes the [B, S] padding mask; None: the tower's batches
    # have none (image patches are never padding), so calibration keeps every position
    mask_root_up: int | None
    config_attr: str | None = None  # sub-config holding this tower's hyper-parameters (CLIP)
    input: str = TOKEN_IDS          # the model input this tower reads (MODEL_INPUTS)

    def __post_init__(self) -> None:
        if self.input not in MODEL_INPUTS:
            raise ValueError(f"tower input must be one of {MODEL_INPUTS}, got {self.input!r}")

    @property
    def padding_mask(self) -> bool:
        """Whether the tower's batches carry a padding mask that marks the real tokens."""
        return self.mask_root_up is not None


# What the preservation check compares, the first output the model returns: (output name, whether a softmax over
# its last dimension is a distribution, so that KL(dense || MoE) is defined). Causal and masked LMs return
# `logits`; bare encoders their hidden states.
LM_OUTPUTS = (("logits", True), ("last_hidden_state", False), ("pooler_output", False))


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
    # the module of a block whose output is the FFN's output (the per-layer check compares the MoE layer with it,
    # so an extraction that does not compute the model's own MLP is caught)
    ffn_output: Callable[[nn.Module], nn.Module] = lambda block: block.mlp
    # the transformers Auto class a dense checkpoint without a known architecture class loads with
    auto_class: str = "AutoModelForCausalLM"
    # the outputs the preservation check compares, in order of preference: the first one the model returns counts
    outputs: tuple[tuple[str, bool], ...] = LM_OUTPUTS
    # model types that train on another task than next-token prediction (`upcycle.tasks.kind`)
    tasks_by_type: dict[str, str] | None = None
    # attends both ways: a language-model head of it predicts the next token only when configured as a decoder
    bidirectional: bool = False
    # names of its learned position tables (nn.Embedding), whose size caps a training row; rotary models have none
    position_tables: tuple[str, ...] = ()
    title: str = ""        # how messages name the family (default: its name)

    def towers_of(self, config) -> dict[str, Tower]:
        return (self.towers_by_type or {}).get(config.model_type, self.towers)

    def task_of(self, config) -> str | None:
        """The training task of a model of this family when it is not next-token prediction (None)."""
        return (self.tasks_by_type or {}).get(config.model_type)

    @property
    def display_name(self) -> str:
        return self.title or self.name


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
           _gated_extract, _set_mlp),
    # Gemma 3: norms around the FFN and a scaled embedding that no stock MoE class has, so no export
    Family("gemma", ("gemma3_text",), {"text": Tower("layers", 1)}, _gemma_extract, _set_mlp),
    # Phi-3: fused qkv attention, which the stock MoE classes lack, so no export
    Family("phi3", ("phi3",), {"text": Tower("layers", 1)}, _phi3_extract, _set_mlp),
    Family("gpt2", ("gpt2",), {"text": Tower("h", 1)}, _gpt2_extract, _set_mlp,
           output_dropout=lambda cfg: cfg.resid_pdrop, position_tables=("wpe",)),
    Family("bert", ("bert",), {"text": Tower("encoder.layer", 2)}, _bert_extract, _bert_install,
           ffn_input=lambda block: block.intermediate, ffn_output=lambda block: block.output.dense,
           auto_class="AutoModel", bidirectional=True,
           position_tables=("position_embeddings",)),
    # CLIPModel compares its image-text similarities, so both towers count; it trains contrastively. Its text
    # tower's position table is not listed: the CLIP task caps captions by `text_config` itself.
    Family("clip", ("clip", "clip_text_model", "clip_vision_model"),
           {"text": Tower("text_model.encoder.layers", 2, "text_config"),
            "vision": Tower("vision_model.encoder.layers", None, "vision_config", input=PIXELS)},
           _clip_extract, _set_mlp, auto_class="AutoModel", title="CLIP",
           outputs=(("logits_per_text", True), *LM_OUTPUTS), tasks_by_type={"clip": "clip"},
           # transformers 5's CLIPTextModel / CLIPVisionModel hold their encoder at the top level
           towers_by_type={"clip_text_model": {"text": Tower("encoder.layers", 2)},
                           "clip_vision_model": {"vision": Tower("encoder.layers", None, input=PIXELS)}}),
)


def supported_model_types() -> tuple[str, ...]:
    """Every model type of the table, in its order (read at call time, so the list is the table's)."""
    return tuple(t for f in FAMILIES for t in f.model_types)


def find_family(config) -> Family | None:
    """The adapter for a transformers config, or None (stock MoE checkpoints, unsupported types)."""
    model_type = getattr(config, "model_type", None)
    return next((family for family in FAMILIES if model_type in family.model_types), None)


def family_of(config) -> Family:
    """The adapter for a transformers config, or an error listing what is supported."""
    family = find_family(config)
    if family is None:
        raise UpcycleError(f"unsupported architecture {getattr(config, 'model_type', None)!r}; supported model "
                           f"types: {', '.join(supported_model_types())}")
    return family


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

"""The upcycle checkpoint format: save a converted model of any architecture, load it back.

An upcycle folder holds (DESIGN principle 7, for any architecture):
  config.json            the dense base model's transformers config (unchanged)
  upcycle_config.json    the MoE config: model class, and per MoE layer its block path and constructor spec
  model.safetensors      all weights (tied tensors stored once)
  run_config.yaml        the resolved run configuration        upcycle_report.json   what the run measured
  tokenizer / generation config files, when the source had them (tokenizer_class readable by 4.x and 5.x)

`load(path)` rebuilds the base model from its config, installs empty MoE layers where the spec says, and loads
the weights strictly: a missing or unexpected tensor is an error, not a silent re-initialization.
Callers write into a temporary folder from `upcycle.files.atomic_directory` (principle 4), so an interrupted
or failed run leaves no partial output.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_model, save_model
from torch import nn

from ..core.moe import MoELayer, moe_layers
from ..core.stock_moe import STOCK_MOE_TYPES
from ..core.surgery import install, track_padding_masks
from ..errors import UpcycleError

FORMAT_VERSION = 1
MOE_CONFIG = "upcycle_config.json"
WEIGHTS = "model.safetensors"


def moe_spec(model: nn.Module) -> dict:
    """Everything `load` needs to rebuild the model's MoE layers."""
    return {"format": "upcycle", "format_version": FORMAT_VERSION, "model_class": type(model).__name__,
            # the block that holds each layer (install() takes the block; the layer sits at block.mlp etc.)
            "layers": [{"block": path.rsplit(".", 1)[0], **layer.spec()} for path, layer in moe_layers(model).items()]}


def save(model: nn.Module, directory: str | os.PathLike, *, tokenizer=None) -> None:
    """Write the upcycle format into an existing (temporary) directory."""
    directory = Path(directory)
    model.config.save_pretrained(directory)
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(directory)
    (directory / MOE_CONFIG).write_text(json.dumps(moe_spec(model), indent=2))
    save_model(model, str(directory / WEIGHTS))
    if tokenizer is not None:
        save_tokenizer(tokenizer, directory)


# transformers 5 names its generic fast tokenizer "TokenizersBackend", a class transformers 4.x does not have;
# both majors load the same tokenizer.json as PreTrainedTokenizerFast (5.x keeps that name as an alias)
PORTABLE_TOKENIZER_CLASSES = {"TokenizersBackend": "PreTrainedTokenizerFast"}


def save_tokenizer(tokenizer, directory: str | os.PathLike) -> None:
    """`tokenizer.save_pretrained`, with a `tokenizer_class` that transformers 4.x and 5.x both load."""
    tokenizer.save_pretrained(directory)
    path = Path(directory) / "tokenizer_config.json"
    if not path.exists():
        return
    config = json.loads(path.read_text())
    if config.get("tokenizer_class") in PORTABLE_TOKENIZER_CLASSES:
        config["tokenizer_class"] = PORTABLE_TOKENIZER_CLASSES[config["tokenizer_class"]]
        path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def _saved_dtype(weights: Path) -> torch.dtype:
    """The dtype most of the saved parameters have (the float32 routers of a bf16 model are the exception)."""
    sizes: dict[str, int] = {}
    with safe_open(str(weights), "pt") as f:
        for key in f.keys():
            tensor = f.get_slice(key)
            sizes[tensor.get_dtype()] = sizes.get(tensor.get_dtype(), 0) + math.prod(tensor.get_shape())
    name = max(sizes, key=sizes.get) if sizes else "F32"
    return {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}.get(
        name, torch.float32)


def load(path: str | os.PathLike, *, dtype: torch.dtype | None = None) -> nn.Module:
    """Rebuild an upcycled model written by `upcycle convert` (eval mode, padding masks tracked), in the dtype
    its weights were saved in unless `dtype` asks for another."""
    path = Path(path)
    spec_file = path / MOE_CONFIG
    if not spec_file.exists():
        model_type = json.loads((path / "config.json").read_text()).get("model_type") \
            if (path / "config.json").exists() else None
        if model_type in STOCK_MOE_TYPES:
            raise UpcycleError(f"{path} is a stock transformers {model_type} checkpoint (upcycle --export hf): "
                               "load it with transformers.AutoModelForCausalLM.from_pretrained")
        raise UpcycleError(f"{path} is not an upcycle checkpoint (no {MOE_CONFIG})")
    spec = json.loads(spec_file.read_text())
    if spec.get("format_version") != FORMAT_VERSION:
        raise UpcycleError(f"{path}: format version {spec.get('format_version')} is not {FORMAT_VERSION}")
    config = transformers.AutoConfig.from_pretrained(path)
    cls = getattr(transformers, spec["model_class"], None)
    if cls is None:
        raise UpcycleError(f"{path}: transformers has no class {spec['model_class']}")
    # built in the dtype it was saved in (or the one asked for), so a bf16 checkpoint stays bf16 and no weight
    # is rounded twice; routers stay float32 in any dtype (MoELayer)
    model = cls._from_config(config, dtype=dtype or _saved_dtype(path / WEIGHTS))
    for layer_spec in spec["layers"]:
        layer_spec = dict(layer_spec)
        block = layer_spec.pop("block")
        install(model, block, MoELayer(**layer_spec, dtype=model.dtype))
    missing, unexpected = load_model(model, str(path / WEIGHTS), strict=False)
    if missing or unexpected:
        raise UpcycleError(f"{path}: weights do not match the model (missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]})")
    model.tie_weights()
    track_padding_masks(model)
    return model.eval()

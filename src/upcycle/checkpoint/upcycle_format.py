"""The upcycle checkpoint format: save a converted model of any architecture, load it back.

An upcycle folder holds (docs/design.md principle 7, for any architecture):
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
from torch import nn

from ..core.moe import MoELayer, moe_layers
from ..core.stock_moe import is_stock_moe
from ..core.surgery import install, track_padding_masks
from ..errors import UpcycleError
from .reader import CheckpointReader
from .skeleton import tensor_specs
from .writer import DEFAULT_MAX_SHARD_BYTES, ShardedWriter

FORMAT_VERSION = 1
MOE_CONFIG = "upcycle_config.json"
WEIGHTS = "model.safetensors"


def moe_spec(model: nn.Module) -> dict:
    """Everything `load` needs to rebuild the model's MoE layers."""
    return {"format": "upcycle", "format_version": FORMAT_VERSION, "model_class": type(model).__name__,
            # the block that holds each layer (install() takes the block; the layer sits at block.mlp etc.)
            "layers": [{"block": path.rsplit(".", 1)[0], **layer.spec()} for path, layer in moe_layers(model).items()]}


def save(model: nn.Module, directory: str | os.PathLike, *, tokenizer=None,
         max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
    """Write the upcycle format into an existing (temporary) directory: configs, the MoE spec, the weights as
    safetensors shards of at most `max_shard_bytes` (one file when they fit) and the tokenizer."""
    directory = Path(directory)
    save_configs(model, directory, moe_spec(model), tokenizer)
    writer = ShardedWriter(directory, tensor_specs(model), max_shard_bytes=max_shard_bytes)
    try:
        for name, tensor in model.state_dict().items():
            if name in writer.slots:            # a tied tensor is written once, under its first name
                writer.write(name, tensor)
        writer.close()
    except BaseException:
        writer.abort()
        raise


def save_configs(model: nn.Module, directory: Path, spec: dict, tokenizer=None) -> None:
    """Everything of an upcycle folder but the weights (the streaming conversion writes those itself)."""
    model.config.save_pretrained(directory)
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(directory)
    (directory / MOE_CONFIG).write_text(json.dumps(spec, indent=2))
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


def _saved_dtype(reader: CheckpointReader) -> torch.dtype:
    """The dtype most of the saved parameters have (the float32 routers of a bf16 model are the exception)."""
    sizes: dict[torch.dtype, int] = {}
    for name in reader.names():
        dtype = reader.dtype(name)
        sizes[dtype] = sizes.get(dtype, 0) + math.prod(reader.shape(name))
    return max(sizes, key=sizes.get) if sizes else torch.float32


def _load_weights(model: nn.Module, reader: CheckpointReader) -> tuple[list[str], list[str], list[str]]:
    """Load every shard into the model, one file at a time; (missing, unexpected, mis-shaped) names over all of
    them. A tensor tied to a stored one is not missing."""
    stored = set(reader.names())
    expected = model.state_dict(keep_vars=True)
    mismatched = sorted(n for n in stored & set(expected) if tuple(expected[n].shape) != reader.shape(n))
    if mismatched:
        return [], [], mismatched
    for file in sorted(set(reader.file_of.values())):
        tensors = {n: reader.get(n) for n, f in reader.file_of.items() if f == file and n in expected}
        model.load_state_dict(tensors, strict=False)
    stored_ids = {id(expected[n]) for n in stored if n in expected}
    missing = [n for n, t in expected.items() if n not in stored and id(t) not in stored_ids]
    return missing, sorted(stored - set(expected)), []


def _read_json(path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise UpcycleError(f"{path}: the {what} cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict):
        raise UpcycleError(f"{path}: the {what} must be a JSON object")
    return data


def load(path: str | os.PathLike, *, dtype: torch.dtype | None = None) -> nn.Module:
    """Rebuild an upcycled model written by `upcycle convert` (eval mode, padding masks tracked), in the dtype
    its weights were saved in unless `dtype` asks for another. A folder that does not rebuild exactly (a spec
    or config that does not build, weights missing, extra, mis-shaped, unreadable or non-finite) is an
    UpcycleError naming what is wrong."""
    path = Path(path)
    spec_file = path / MOE_CONFIG
    if not spec_file.exists():
        config = _read_json(path / "config.json", "config") if (path / "config.json").is_file() else {}
        if is_stock_moe(config):
            raise UpcycleError(f"{path} is a stock transformers {config.get('model_type')} checkpoint (upcycle "
                               "--export hf): load it with transformers.AutoModelForCausalLM.from_pretrained")
        raise UpcycleError(f"{path} is not an upcycle checkpoint (no {MOE_CONFIG})")
    spec = _read_json(spec_file, "MoE spec")
    if spec.get("format_version") != FORMAT_VERSION:
        raise UpcycleError(f"{path}: format version {spec.get('format_version')} is not {FORMAT_VERSION}")
    layers = spec.get("layers")
    if not isinstance(spec.get("model_class"), str) or not isinstance(layers, list) or \
            not all(isinstance(entry, dict) and isinstance(entry.get("block"), str) for entry in layers):
        raise UpcycleError(f"{spec_file}: model_class must name a class and layers must list blocks with their specs")
    try:
        config = transformers.AutoConfig.from_pretrained(str(path), trust_remote_code=False)
    except Exception as e:
        raise UpcycleError(f"{path}: config.json does not load ({type(e).__name__}: {e})") from None
    cls = getattr(transformers, spec["model_class"], None)
    if not isinstance(cls, type) or not issubclass(cls, transformers.PreTrainedModel):
        raise UpcycleError(f"{path}: transformers has no model class {spec['model_class']}")
    reader = CheckpointReader(path)          # a damaged or escaping weights file is named before any building
    try:
        # built in the dtype it was saved in (or the one asked for), so a bf16 checkpoint stays bf16 and no
        # weight is rounded twice; routers stay float32 in any dtype (MoELayer)
        model = cls._from_config(config, dtype=dtype or _saved_dtype(reader))
        for layer_spec in layers:
            layer_spec = dict(layer_spec)
            block = layer_spec.pop("block")
            install(model, block, MoELayer(**layer_spec, dtype=model.dtype))
    except UpcycleError as e:   # a layer spec out of range
        raise UpcycleError(f"{path}: a layer of {MOE_CONFIG} is not valid ({e})") from None
    except Exception as e:      # a spec or config that does not build (a bad size, an unknown argument)
        raise UpcycleError(f"{path}: the model does not build from its config and {MOE_CONFIG} "
                           f"({type(e).__name__}: {' '.join(str(e).split())[:300]})") from None
    missing, unexpected, mismatched = _load_weights(model, reader)
    if missing or unexpected or mismatched:
        raise UpcycleError(f"{path}: weights do not match the model (missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}, wrong shape {mismatched[:5]})")
    model.tie_weights()
    track_padding_masks(model)
    return model.eval()

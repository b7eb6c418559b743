"""The upcycle checkpoint format: save a converted model of any architecture, load it back.

An upcycle folder holds (docs/design.md principle 7, for any architecture):
  config.json            model type "upcycle", with the dense base model's transformers config under `base_config`
  upcycle_config.json    the MoE config: model class, and per MoE layer its block path and constructor spec
  model.safetensors      all weights (tied tensors stored once)
  run_config.yaml        the resolved run configuration        upcycle_report.json   what the run measured
  tokenizer / generation config files, when the source had them (tokenizer_class readable by 4.x and 5.x)

`load(path)` rebuilds the base model from its config, installs empty MoE layers where the spec says, and loads
the weights strictly: a missing or unexpected tensor is an error, not a silent re-initialization.

Why config.json is not the base model's own (format version 2): transformers would read such a folder as the dense
model, find no tensors for its MLPs, initialise them at random and carry on. With model type "upcycle" it either
refuses the folder (the type is unknown to it) or, once `import upcycle` has registered the type
(`checkpoint/auto_classes.py`), loads it through `load`. Folders of format version 1 (config.json the base config
itself) still load here.
Callers write into a staging folder from `upcycle.outputs.staging` (principle 4), so an interrupted
or failed run leaves no partial output.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path

import torch
import transformers
from torch import nn

from ..core.moe import MoELayer, moe_layers
from ..core.stock_moe import is_stock_moe
from ..core.surgery import install, track_padding_masks
from ..errors import UpcycleError
from ..files import parse_json, read_json_file
from .agreement import check_checkpoint
from .config_sizes import check_config_sizes
from .folder_type import FOLDER_MODEL_TYPE
from .reader import CheckpointReader
from .sentence_modules import write_sentence_modules
from .skeleton import tensor_specs
from .writer import DEFAULT_MAX_SHARD_BYTES, ShardedWriter

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
HOW_TO_LOAD = ("an upcycle MoE checkpoint: load it with upcycle.load(folder) or, after `import upcycle`, with "
               "transformers' AutoModelForCausalLM / AutoModel (pip install upcycle)")
MOE_CONFIG = "upcycle_config.json"
WEIGHTS = "model.safetensors"


def moe_spec(model: nn.Module) -> dict:
    """Everything `load` needs to rebuild the model's MoE layers."""
    return {"format": "upcycle", "format_version": FORMAT_VERSION, "model_class": type(model).__name__,
            # the block that holds each layer (install() takes the block; the layer sits at block.mlp etc.)
            "layers": [{"block": path.rsplit(".", 1)[0], **layer.spec()} for path, layer in moe_layers(model).items()]}


def save_folder_files(model: nn.Module, directory: str | os.PathLike, *, tokenizer=None, state_dict: dict | None = None,
                      max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
    """Write the upcycle format into an existing (temporary) directory: configs, the MoE spec, the weights (the
    model's own, or `state_dict` when given, as transformers' save_pretrained takes it) as safetensors shards of at
    most `max_shard_bytes` (one file when they fit) and the tokenizer."""
    directory = Path(directory)
    save_configs(model, directory, moe_spec(model), tokenizer)
    writer = ShardedWriter(directory, tensor_specs(model), max_shard_bytes=max_shard_bytes)
    try:
        for name, tensor in (model.state_dict() if state_dict is None else state_dict).items():
            if name in writer.slots:            # a tied tensor is written once, under its first name
                writer.write(name, tensor)
        writer.close()
    except BaseException:
        writer.abort()
        raise


def folder_config(model: nn.Module) -> dict:
    """config.json of an upcycle folder: model type "upcycle", the base config as `save_pretrained` writes it."""
    base = parse_json(model.config.to_json_string(use_diff=True), "the model's config")
    return {"model_type": FOLDER_MODEL_TYPE, "upcycle_format_version": FORMAT_VERSION, "base_config": base,
            "architectures": [type(model).__name__], "how_to_load": HOW_TO_LOAD}


def base_config(path: str | os.PathLike):
    """The dense base model's transformers config of an upcycle folder (either format version); never code of
    the folder's own: the base type must be one transformers ships."""
    path = Path(path)
    data = _read_json(path / "config.json", "config")
    check_config_sizes(data, str(path))         # base_config's too: before transformers divides by them
    if data.get("model_type") != FOLDER_MODEL_TYPE:              # format version 1: config.json is the base
        try:
            return transformers.AutoConfig.from_pretrained(str(path), trust_remote_code=False)
        except Exception as e:
            raise UpcycleError(f"{path}: config.json does not load ({type(e).__name__}: {e})") from None
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    base = data.get("base_config")
    model_type = base.get("model_type") if isinstance(base, dict) else None
    if not isinstance(model_type, str) or model_type == FOLDER_MODEL_TYPE or model_type not in CONFIG_MAPPING \
            or base.get("auto_map"):
        raise UpcycleError(f"{path}: config.json's base_config must be a transformers config of a model type "
                           f"transformers ships (got model type {model_type!r})")
    try:
        return CONFIG_MAPPING[model_type].from_dict(dict(base))
    except Exception as e:
        raise UpcycleError(f"{path}: config.json's base_config does not load ({type(e).__name__}: {e})") from None


def save_configs(model: nn.Module, directory: Path, spec: dict, tokenizer=None) -> None:
    """Everything of an upcycle folder but the weights (the streaming conversion writes those itself)."""
    (directory / "config.json").write_text(json.dumps(folder_config(model), indent=2, sort_keys=True) + "\n")
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(directory)
    (directory / MOE_CONFIG).write_text(json.dumps(spec, indent=2))
    if tokenizer is not None:
        save_tokenizer(tokenizer, directory)


# transformers 5 names its generic fast tokenizer "TokenizersBackend", a class transformers 4.x does not have;
# both majors load the same tokenizer.json as PreTrainedTokenizerFast (5.x keeps that name as an alias)
PORTABLE_TOKENIZER_CLASSES = {"TokenizersBackend": "PreTrainedTokenizerFast"}
# what a causal LM's forward takes from a tokenizer: 4.x's PreTrainedTokenizerFast also returns token_type_ids
# unless told otherwise, and generate(**tok(prompt)) then refuses them ("model_kwargs are not used by the model")
CAUSAL_LM_INPUTS = ["input_ids", "attention_mask"]
# transformers' placeholder for "no limit" (VERY_LARGE_INTEGER = int(1e30)); anything this big is not a length
NO_LENGTH = 10**20
# loading arguments transformers 5 stores in tokenizer_config.json: they describe one load, not the tokenizer
LOAD_ONLY_KEYS = ("is_local", "local_files_only")


def save_tokenizer(tokenizer, directory: str | os.PathLike, model_config: dict | None = None) -> None:
    """`tokenizer.save_pretrained` and the source's sentence-transformers modules (`sentence_modules.py`), with a
    tokenizer_config.json that serves transformers 4.x and 5.x alike:
    a `tokenizer_class` both load; for a causal LM, `model_input_names` ["input_ids", "attention_mask"]; and a
    real `model_max_length`: the tokenizer's own when it has one, else the model's max_position_embeddings.
    `model_config`: the model's config as a dict; by default the config.json already written in `directory`
    (every caller writes it first)."""
    tokenizer.save_pretrained(directory)
    if getattr(tokenizer, "sentence_modules", None):         # read by loading.load_tokenizer
        write_sentence_modules(tokenizer.sentence_modules, directory)
    path = Path(directory) / "tokenizer_config.json"
    if not path.exists():
        return
    if model_config is None:
        config_file = Path(directory) / "config.json"
        model_config = read_json_file(config_file, "model's config") if config_file.is_file() else {}
    if model_config.get("model_type") == FOLDER_MODEL_TYPE:        # an upcycle folder's: the base config inside
        model_config = {**model_config.get("base_config", {}), "architectures": model_config.get("architectures")}
    config = read_json_file(path, "tokenizer config")
    if config.get("tokenizer_class") in PORTABLE_TOKENIZER_CLASSES:
        config["tokenizer_class"] = PORTABLE_TOKENIZER_CLASSES[config["tokenizer_class"]]
    for key in LOAD_ONLY_KEYS:
        config.pop(key, None)
    if any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in model_config.get("architectures") or []):
        config["model_input_names"] = CAUSAL_LM_INPUTS
    length = getattr(tokenizer, "model_max_length", None)
    positions = model_config.get("max_position_embeddings")
    if isinstance(length, int) and 0 < length < NO_LENGTH:
        config["model_max_length"] = length
    elif isinstance(positions, int) and positions > 0:
        config["model_max_length"] = positions
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
    data = read_json_file(path, what)
    if not isinstance(data, dict):
        raise UpcycleError(f"{path}: the {what} must be a JSON object")
    return data


def read_spec(path: str | os.PathLike) -> tuple[dict, object]:
    """(the MoE spec, the base config) of an upcycle folder, checked; no weight is read."""
    path = Path(path)
    spec_file = path / MOE_CONFIG
    if not spec_file.exists():
        config = _read_json(path / "config.json", "config") if (path / "config.json").is_file() else {}
        if is_stock_moe(config):
            raise UpcycleError(f"{path} is a stock transformers {config.get('model_type')} checkpoint (upcycle "
                               "--export hf): load it with transformers.AutoModelForCausalLM.from_pretrained")
        raise UpcycleError(f"{path} is not an upcycle checkpoint (no {MOE_CONFIG})")
    spec = _read_json(spec_file, "MoE spec")
    if spec.get("format_version") not in READABLE_VERSIONS:
        raise UpcycleError(f"{path}: format version {spec.get('format_version')!r} is not one this upcycle reads "
                           f"{READABLE_VERSIONS}")
    layers = spec.get("layers")
    if not isinstance(spec.get("model_class"), str) or not isinstance(layers, list) or \
            not all(isinstance(entry, dict) and isinstance(entry.get("block"), str) for entry in layers):
        raise UpcycleError(f"{spec_file}: model_class must name a class and layers must list blocks with their specs")
    return spec, base_config(path)


def build(path: str | os.PathLike, spec: dict, config, dtype: torch.dtype) -> nn.Module:
    """The model an upcycle folder describes, with fresh weights (where tensors are made: `load` fills them, the
    memory plan builds it of fake tensors)."""
    cls = getattr(transformers, spec["model_class"], None)
    if not isinstance(cls, type) or not issubclass(cls, transformers.PreTrainedModel):
        raise UpcycleError(f"{path}: transformers has no model class {spec['model_class']}")
    with one_line_errors(path):
        model = cls._from_config(config, dtype=dtype)
        for layer_spec in spec["layers"]:
            layer_spec = dict(layer_spec)
            block = layer_spec.pop("block")
            install(model, block, MoELayer.from_spec(layer_spec, dtype=model.dtype))
    return model


@contextlib.contextmanager
def one_line_errors(path: str | os.PathLike) -> Iterator[None]:
    """Building a folder's model from its config and MoE spec: whatever a bad spec or config raises (a count
    written as a string, an unknown argument) said in one line naming the folder."""
    try:
        yield
    except UpcycleError as e:   # a layer spec out of range
        raise UpcycleError(f"{path}: a layer of {MOE_CONFIG} is not valid ({e})") from None
    except Exception as e:      # a spec or config that does not build (a bad size, an unknown argument)
        raise UpcycleError(f"{path}: the model does not build from its config and {MOE_CONFIG} "
                           f"({type(e).__name__}: {' '.join(str(e).split())[:300]})") from None


def saved_dtype(path: str | os.PathLike) -> torch.dtype:
    """The dtype an upcycle folder's weights load in (`load`'s default): most of its saved parameters'."""
    return _saved_dtype(CheckpointReader(Path(path)))


def load(path: str | os.PathLike, *, dtype: torch.dtype | None = None) -> nn.Module:
    """Rebuild an upcycled model written by `upcycle convert` (eval mode, padding masks tracked), in the dtype
    its weights were saved in unless `dtype` asks for another. A folder that does not rebuild exactly (a spec
    or config that does not build, weights missing, extra, mis-shaped, unreadable or non-finite) is an
    UpcycleError naming what is wrong."""
    path = Path(path)
    spec, config = read_spec(path)
    reader = CheckpointReader(path)          # a damaged or escaping weights file is named before any building
    # built in the dtype it was saved in (or the one asked for), so a bf16 checkpoint stays bf16 and no weight is
    # rounded twice; routers stay float32 in any dtype (MoELayer)
    model = build(path, spec, config, dtype or _saved_dtype(reader))
    check_checkpoint(model, reader, str(path))     # before loading: loading two tied names into one tensor keeps one
    missing, unexpected, mismatched = _load_weights(model, reader)
    if missing or unexpected or mismatched:
        raise UpcycleError(f"{path}: weights do not match the model (missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}, wrong shape {mismatched[:5]})")
    model.tie_weights()
    track_padding_masks(model)
    return model.eval()

"""The fine-tuned source models of a multi-source merge, opened and checked against the base before any weight is
read.

A merge takes attention, embeddings and norms from one model and FFNs from others, so every source must be the
base's architecture with the base's shapes. Two checks, both on metadata only:
  1. config.json: the same model type and class, FFN activation and the sizes that shape the tensors
     (`ARCHITECTURE_KEYS`), each difference named with both values;
  2. the safetensors headers (`CheckpointReader.shape`, which reads the header, never the data): the same tensor
     names and, tensor by tensor, the same shape; the first tensor that differs is named.
A source stored in another dtype is accepted (a bf16 fine-tune of a float32 base): its tensors are cast to the
output's dtype like the base's.

`held_out_split` is the one rule for a source's held-out documents when the recipe gives no `eval_data`: the
merge measures router-source agreement on them and records the rule in its report, so `upcycle analyze` reads
the same documents.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoint.loading import dense_config
from ..checkpoint.reader import CheckpointReader
from ..config import ConvertConfig
from ..data.model_names import resolve_model_name
from ..errors import UpcycleError

# config keys that decide the tensors' shapes or the FFN's function (the experts compute with the source's FFN)
ARCHITECTURE_KEYS = ("model_type", "architectures", "hidden_act", "hidden_activation", "activation_function",
                     "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings", "mlp_bias",
                     "attention_bias")


@dataclass
class Source:
    name: str                   # as the recipe gives it
    path: str
    config: object
    reader: CheckpointReader


def open_checkpoint(name: str) -> Source:
    """A model folder opened for reading tensor by tensor (its config read, no weight)."""
    path, config = dense_config(name)
    if not Path(path).is_dir():
        raise UpcycleError(f"source {name!r}: several-source merges read local folders of safetensors, tensor by "
                           f"tensor; {name!r} is not a local folder")
    try:
        reader = CheckpointReader(path)
    except UpcycleError as e:
        raise UpcycleError(f"source {name!r}: {e}") from None
    return Source(name, path, config, reader)


def architecture_difference(base, other) -> str | None:
    """The first config key of ARCHITECTURE_KEYS whose value differs, described; None when they agree."""
    a, b = base.to_dict(), other.to_dict()
    for key in ARCHITECTURE_KEYS:
        if a.get(key) != b.get(key):
            return f"config.json {key}: base {a.get(key)!r}, source {b.get(key)!r}"
    return None


def shape_difference(base: CheckpointReader, other: CheckpointReader) -> str | None:
    """The first tensor whose name or shape differs between two checkpoints (headers only), described."""
    names, theirs = set(base.names()), set(other.names())
    if names - theirs:
        return f"tensor {sorted(names - theirs)[0]} is in the base but not in the source"
    if theirs - names:
        return f"tensor {sorted(theirs - names)[0]} is in the source but not in the base"
    for name in base.names():
        if base.shape(name) != other.shape(name):
            return f"tensor {name}: base shape {list(base.shape(name))}, source shape {list(other.shape(name))}"
    return None


def open_sources(cfg: ConvertConfig) -> tuple[Source, list[Source]]:
    """(base, one Source per expert entry), every source checked against the base (module docstring); refused
    with the source and the first difference, before a weight is read."""
    base = open_checkpoint(cfg.model)
    sources = []
    for i, entry in enumerate(cfg.sources.experts):
        where = f"sources.experts[{i}] ({entry.model})"
        if resolve_model_name(entry.model) == base.path:
            source = base
        else:
            source = open_checkpoint(entry.model)
        why = architecture_difference(base.config, source.config) or shape_difference(base.reader, source.reader)
        if why is not None:
            raise UpcycleError(f"{where} does not have the base's architecture and shapes ({cfg.model}): {why}")
        sources.append(source)
    return base, sources


def held_out_split(docs: list[str], share: float, seed: int) -> tuple[list[str], list[str]]:
    """(calibration documents, held-out documents): a seeded random `share` of `docs` held out (at least one;
    none when `share` is 0 or there is a single document)."""
    if share <= 0 or len(docs) < 2:
        return list(docs), []
    order = torch.randperm(len(docs), generator=torch.Generator().manual_seed(seed)).tolist()
    n_held = max(1, round(share * len(docs)))
    return [docs[i] for i in order[n_held:]], [docs[i] for i in order[:n_held]]


def source_name(model: str, index: int) -> str:
    """A short name for source `index`: its folder's name (the parent's when the folder is called `model`, as a
    training run's output is), prefixed by the index so that names stay distinct."""
    path = Path(model)
    name = path.parent.name if path.name == "model" and path.parent.name else path.name
    return f"{index}-{name or model}"

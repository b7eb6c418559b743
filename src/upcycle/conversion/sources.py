"""The fine-tuned source models of a multi-source merge, opened and checked against the base before any weight is
read.

A merge takes attention, embeddings and norms from one model and FFNs from others (or, with `non_ffn: average`,
the mean of everyone's), and reads every source's text with the base's tokenizer, so every source must be the
base's model in all that the merged model shares. Three checks, all on metadata only:
  1. config.json: every key that shapes the tensors or the function (the model type and class, the FFN
     activation, sizes, and the rest: rope_theta, norm epsilons, position and attention settings), each
     difference named with both values; only keys that say nothing about the computed function are left out
     (`checkpoint.differences.UNSHARED_CONFIG_KEYS`: names, versions, dtype, caching, dropout and init settings);
  2. the tokenizer: the same files present, the same vocabulary (the first token whose id differs, or that one
     side lacks, is named) and the same normalization, splitting and templates;
  3. the safetensors headers (`CheckpointReader.shape`, which reads the header, never the data): the same tensor
     names and, tensor by tensor, the same shape; the first tensor that differs is named.
A source stored in another dtype is accepted (a bf16 fine-tune of a float32 base): its tensors are cast to the
output's dtype like the base's.

A source's held-out documents, when its recipe gives no `eval_data`, follow `data.held_out.held_out_split`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..checkpoint.differences import architecture_difference, shape_difference, tokenizer_difference
from ..checkpoint.loading import dense_config
from ..checkpoint.reader import CheckpointReader
from ..config import SourcesConfig
from ..core.architectures import TOKEN_IDS, family_of
from ..data.model_names import resolve_model_name
from ..errors import UpcycleError


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


def open_sources(model: str, experts: SourcesConfig) -> tuple[Source, list[Source]]:
    """(base `model`, one Source per expert entry), every source checked against the base (module docstring);
    refused with the source and the first difference, before a weight is read. Merges take text models."""
    base = open_checkpoint(model)
    if any(t.input != TOKEN_IDS for t in family_of(base.config).towers_of(base.config).values()):
        raise UpcycleError(f"several-source merges take text models; {model} ({base.config.model_type}) "
                           f"has an image tower")
    sources = []
    for i, entry in enumerate(experts.experts):
        where = f"sources.experts[{i}] ({entry.model})"
        if resolve_model_name(entry.model) == base.path:
            source = base
        else:
            source = open_checkpoint(entry.model)
        why = architecture_difference(base.config, source.config) or shape_difference(base.reader, source.reader)
        if why is not None:
            raise UpcycleError(f"{where} does not have the base's architecture and shapes ({model}): {why}")
        why = tokenizer_difference(base.path, source.path) if source is not base else None
        if why is not None:
            raise UpcycleError(f"{where} does not share the base's tokenizer ({model}): {why}")
        sources.append(source)
    return base, sources


def source_name(model: str, index: int) -> str:
    """A short name for source `index`: its folder's name (the parent's when the folder is called `model`, as a
    training run's output is), prefixed by the index so that names stay distinct."""
    path = Path(model)
    name = path.parent.name if path.name == "model" and path.parent.name else path.name
    return f"{index}-{name or model}"

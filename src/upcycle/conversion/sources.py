"""The fine-tuned source models of a multi-source merge, opened and checked against the base before any weight is
read.

A merge takes attention, embeddings and norms from one model and FFNs from others (or, with `non_ffn: average`,
the mean of everyone's), and reads every source's text with the base's tokenizer, so every source must be the
base's model in all that the merged model shares. Three checks, all on metadata only:
  1. config.json: every key that shapes the tensors or the function (the model type and class, the FFN
     activation, sizes, and the rest: rope_theta, norm epsilons, position and attention settings), each
     difference named with both values; only keys that say nothing about the computed function are left out
     (`UNSHARED_CONFIG_KEYS`: names, versions, dtype, caching, dropout and init settings);
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

from ..checkpoint.loading import dense_config
from ..checkpoint.reader import CheckpointReader
from ..config import SourcesConfig
from ..core.architectures import TOKEN_IDS, family_of
from ..data.model_names import resolve_model_name
from ..errors import UpcycleError

# config keys that decide the tensors' shapes or the FFN's function (the experts compute with the source's FFN),
# compared first so that the message names the most telling difference
ARCHITECTURE_KEYS = ("model_type", "architectures", "hidden_act", "hidden_activation", "activation_function",
                     "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings", "mlp_bias",
                     "attention_bias")
# config keys that say nothing about the function the weights compute: fine-tunes of one base differ in them
UNSHARED_CONFIG_KEYS = frozenset({
    "_name_or_path", "name_or_path", "transformers_version", "torch_dtype", "dtype", "use_cache", "_commit_hash",
    "_attn_implementation", "_attn_implementation_autoset", "attn_implementation", "output_attentions",
    "output_hidden_states", "return_dict", "initializer_range", "initializer_factor", "attention_dropout",
    "hidden_dropout", "hidden_dropout_prob", "attention_probs_dropout_prob", "dropout", "embd_pdrop",
    "resid_pdrop", "attn_pdrop", "classifier_dropout", "summary_first_dropout", "id2label", "label2id",
    "problem_type", "finetuning_task", "tokenizer_class", "task_specific_params", "use_bfloat16"})


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
    """The first config key whose value differs, ARCHITECTURE_KEYS first, then every other key but
    UNSHARED_CONFIG_KEYS (nested configs compared whole), described; None when they agree."""
    a, b = base.to_dict(), other.to_dict()
    rest = sorted((set(a) | set(b)) - set(ARCHITECTURE_KEYS) - UNSHARED_CONFIG_KEYS)
    for key in (*ARCHITECTURE_KEYS, *rest):
        if a.get(key) != b.get(key):
            return f"config.json {key}: base {a.get(key)!r}, source {b.get(key)!r}"
    return None


def tokenizer_difference(base_path: str, source_path: str) -> str | None:
    """How the source's tokenizer differs from the base's, or None: the base's reads every source's text, so a
    source fine-tuned with another token map would train its experts on other tokens than the merged model's."""
    from ..checkpoint.loading import load_tokenizer

    base, source = load_tokenizer(base_path), load_tokenizer(source_path)
    if base is None:
        return None         # the merged model has no tokenizer: no text is read with one
    if source is None:
        return ("the base has a tokenizer and the source has none, so its token map cannot be checked (if it was "
                "fine-tuned from the base, copy the base's tokenizer files into it)")
    ours, theirs = base.get_vocab(), source.get_vocab()
    for token, i in sorted(ours.items(), key=lambda item: item[1]):
        if token not in theirs:
            return f"token {token!r} (id {i} in the base) is not in the source's vocabulary"
        if theirs[token] != i:
            return f"token {token!r} is id {i} in the base and id {theirs[token]} in the source"
    for token, i in sorted(theirs.items(), key=lambda item: item[1]):
        if token not in ours:
            return f"token {token!r} (id {i} in the source) is not in the base's vocabulary"
    return _backend_difference(base, source)


def _backend_difference(base, source) -> str | None:
    """The first part of the fast tokenizers' definitions (tokenizer.json) that differs with equal vocabularies:
    the normalizer, the pre-tokenizer, the merges, the templates."""
    from ..files import parse_json

    try:
        a, b = (parse_json(t.backend_tokenizer.to_str(), "a tokenizer's definition") for t in (base, source))
    except (AttributeError, ValueError):
        return None if type(base) is type(source) else \
            f"the tokenizer classes differ: base {type(base).__name__}, source {type(source).__name__}"
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key), b.get(key)
        if key == "model" and isinstance(x, dict) and isinstance(y, dict):
            part = next((k for k in sorted(set(x) | set(y)) if k != "vocab" and x.get(k) != y.get(k)), None)
            if part is not None:
                return f"the tokenizers' model {part} differs (tokenizer.json)"
        elif key != "added_tokens" and x != y:
            return f"the tokenizers' {key} differs (tokenizer.json)"
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

"""How a model differs from another it must match, from metadata alone (config.json, the tokenizer files, the
safetensors headers; never a weight): a merge's sources against their base (`conversion.sources`) and a fine-tune
added as an expert against the upcycled model's base (`resize.add_expert`). Each function names the first
difference, or returns None.
"""

from __future__ import annotations

from .reader import CheckpointReader

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
    from .loading import load_tokenizer

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

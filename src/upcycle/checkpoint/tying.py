"""A config that ties tensors (`tie_word_embeddings`: the output head is the input embedding) must agree with the
checkpoint: when both tied names are stored with different values, transformers unties them (with a warning),
while a model built from the config and given the file's tensors one by one ties them, silently dropping one.
Neither reading is safe to guess, so every loader of upcycle refuses such a checkpoint and says how to fix it:
a dense model to convert, train or evaluate, and an upcycle folder (`upcycle.load`, hence every `AutoModel`
load of one).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..errors import UpcycleError
from .reader import CheckpointReader, NoWeights


def tied_names(model: nn.Module) -> list[list[str]]:
    """Groups of state-dict names that are one tensor in `model` (built from its config, weights tied)."""
    groups: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _stored_as(model: nn.Module, name: str, reader: CheckpointReader) -> str | None:
    prefix = getattr(model, "base_model_prefix", "") or ""
    candidates = [name] + ([name.removeprefix(prefix + "."), f"{prefix}.{name}"] if prefix else [])
    return next((c for c in candidates if c in reader), None)


def check_tying(model: nn.Module, reader: CheckpointReader, what: str) -> None:
    """Refuse a checkpoint that stores two tensors `model`'s config ties with different values."""
    for names in tied_names(model):
        stored = list(dict.fromkeys(s for n in names if (s := _stored_as(model, n, reader)) is not None))
        if len(stored) < 2:
            continue
        first = reader.get(stored[0])
        for other in stored[1:]:
            value = reader.get(other)
            if value.shape != first.shape or not torch.equal(value, first):
                raise UpcycleError(
                    f"{what}: config.json ties {stored[0]} and {other} (tie_word_embeddings), but the checkpoint "
                    f"stores them with different values; transformers would untie them and upcycle would keep "
                    f"one, so the model is refused rather than guessed: set \"tie_word_embeddings\": false in "
                    f"config.json if the two differ on purpose, or remove {other} from the checkpoint if they are "
                    f"meant to be one tensor")


def check_dense_tying(path: str, config, what: str) -> None:
    """`check_tying` for a dense model's local folder (a hub id is read by transformers, as it reads it)."""
    if not getattr(config, "tie_word_embeddings", False) or not Path(path).is_dir():
        return
    from .skeleton import empty_model

    try:
        reader = CheckpointReader(path, check_values=False)
    except NoWeights:
        return                  # no safetensors here: the loader says what is missing
    try:
        check_tying(empty_model(config, torch.float32), reader, what)
    finally:
        reader.close()

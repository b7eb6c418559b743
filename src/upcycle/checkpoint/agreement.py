"""A checkpoint must agree with the model its config builds, or be refused with a message, the same way on every
path (a conversion in memory or streamed, training, evaluation, `upcycle.load`):

- **Tying.** A config that ties tensors (`tie_word_embeddings`: the output head is the input embedding) while the
  checkpoint stores both with different values: transformers unties them (with a warning), while a model built
  from the config and given the file's tensors one by one ties them, silently dropping one. Neither reading is
  safe to guess.
- **Kinds.** An integer tensor where the model has a floating-point parameter (a quantized checkpoint without its
  quantization config): transformers would cast the integers to floats, a model of garbage. Floating-point
  tensors of any width (float64 down to float8) are read and cast to the compute dtype on both paths.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from torch import nn

from ..errors import UpcycleError
from .lazy import checkpoint_names
from .reader import CheckpointReader, NoWeights


def tied_names(model: nn.Module) -> list[list[str]]:
    """Groups of state-dict names that are one tensor in `model` (built from its config, weights tied)."""
    groups: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def check_checkpoint(model: nn.Module, reader: CheckpointReader, what: str, *, values: bool = True) -> None:
    """Refuse a checkpoint whose tensors disagree with `model` (built from its config): integer tensors for
    floating-point parameters (headers only), and, when the config ties tensors and `values`, two tied names
    stored with different values (the two tensors read: a dry run leaves that to its run)."""
    stored, _ = checkpoint_names(model, reader)      # model name -> the checkpoint's name for it
    tensors = model.state_dict(keep_vars=True)
    wrong = [f"{stored[n]} ({str(reader.dtype(stored[n])).removeprefix('torch.')})" for n, t in tensors.items()
             if n in stored and t.is_floating_point() and not reader.dtype(stored[n]).is_floating_point]
    if wrong:
        raise UpcycleError(f"{what}: the checkpoint stores {', '.join(wrong[:3])}{' ...' if len(wrong) > 3 else ''} "
                           f"as integers where the model has floating-point weights: a quantized checkpoint, which "
                           f"upcycle does not read (give it the model's floating-point weights)")
    for names in tied_names(model) if values else ():
        both = list(dict.fromkeys(stored[n] for n in names if n in stored))
        if len(both) < 2:
            continue
        first = reader.get(both[0])
        for other in both[1:]:
            value = reader.get(other)
            if value.shape != first.shape or not torch.equal(value, first):
                raise UpcycleError(
                    f"{what}: config.json ties {both[0]} and {other} (tie_word_embeddings), but the checkpoint "
                    f"stores them with different values; transformers would untie them and upcycle would keep "
                    f"one, so the model is refused rather than guessed: set \"tie_word_embeddings\": false in "
                    f"config.json if the two differ on purpose, or remove {other} from the checkpoint if they are "
                    f"meant to be one tensor")


_SKELETONS: dict[str, nn.Module] = {}


def _skeleton(config) -> nn.Module:
    """The weightless model of a config, built once for every checkpoint with that config (a merge's sources
    share the base's) and only read (`check_checkpoint`); the last two are kept. Built from a copy: building a
    model sets the config's dtype, and the caller's config must still say the checkpoint's (the conversion's
    default dtype follows it)."""
    from .skeleton import empty_model

    key = json.dumps({k: v for k, v in config.to_dict().items() if k != "_name_or_path"}, sort_keys=True,
                     default=str)       # every folder's config names its folder: the model does not depend on it
    if key not in _SKELETONS:
        while len(_SKELETONS) >= 2:
            _SKELETONS.pop(next(iter(_SKELETONS)))
        _SKELETONS[key] = empty_model(copy.deepcopy(config), torch.float32)
    return _SKELETONS[key]


def check_dense_checkpoint(path: str, config, what: str, *, values: bool = True) -> None:
    """`check_checkpoint` for a dense model's local folder (a hub id is read by transformers, as it reads it)."""
    if not Path(path).is_dir():
        return

    try:
        reader = CheckpointReader(path, check_values=False)
    except NoWeights:
        return                  # no safetensors here: the loader says what is missing
    try:
        try:
            model = _skeleton(config)
        except Exception:       # a config that does not build (an unknown activation...): its loader says why
            return
        check_checkpoint(model, reader, what, values=values)
    finally:
        reader.close()

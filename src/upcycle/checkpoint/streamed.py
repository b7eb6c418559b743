"""A checkpoint on disk opened to be read a block at a time: its reader, the weightless model it fills and the
map from the model's tensor names to the checkpoint's, checked against the model before any tensor is read
(names that match, shapes that fit, nothing the model has no place for)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..errors import UpcycleError
from .lazy import checkpoint_names
from .reader import CheckpointReader, NoWeights
from .skeleton import empty_model


class NotStreamable(UpcycleError):
    """The checkpoint cannot be read tensor by tensor (no safetensors, or names the model does not have)."""


def check_shapes(model: nn.Module, reader: CheckpointReader, names: dict[str, str], path) -> None:
    """Refuse a checkpoint whose tensors do not fit the model its config.json describes (a wrong intermediate
    size, a hidden size that does not match), or that holds tensors the model has no place for (more blocks than
    the config says), before any tensor is read."""
    shapes = {name: tuple(t.shape) for name, t in model.state_dict(keep_vars=True).items()}
    wrong = [f"{key} is {list(reader.shape(key))} in the checkpoint, {list(shapes[name])} in the model"
             for name, key in names.items() if reader.shape(key) != shapes[name]]
    if wrong:
        raise UpcycleError(f"{path}: the checkpoint does not fit its config.json ({len(wrong)} tensor(s): "
                           f"{'; '.join(wrong[:3])})")
    # not extra: what transformers itself drops on load, and buffers the model computes rather than stores (BERT's
    # position_ids and rotary frequencies, which older checkpoints stored)
    ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]
    computed = {name.rsplit(".", 1)[-1] for name, _ in model.named_buffers()}
    extra = sorted(n for n in set(reader.names()) - set(names.values())
                   if not any(p.search(n) for p in ignored) and n.rsplit(".", 1)[-1] not in computed)
    if extra:
        raise UpcycleError(f"{path}: the checkpoint holds {len(extra)} tensor(s) its config.json has no place for "
                           f"(e.g. {', '.join(extra[:3])}); the weights and config.json must describe one model")


@dataclass
class StreamSource:
    """A dense checkpoint opened for streaming: its reader, the weightless model and the name map."""

    reader: CheckpointReader
    model: nn.Module
    names: dict[str, str]
    dtype: torch.dtype                      # the compute dtype
    storage: torch.dtype | None = None      # weights are rounded to it as they are read (the output's dtype)
    device: torch.device | None = None      # where blocks are read to and computed (None: the CPU)

    @classmethod
    def open(cls, path: str | Path, config, dtype: torch.dtype, *, model: nn.Module | None = None,
             storage: torch.dtype | None = None, device: torch.device | None = None) -> StreamSource:
        """`model`: the weightless model to read into (default: the dense model of `config`)."""
        try:
            reader = CheckpointReader(path)
        except NoWeights as e:       # damaged weights are an error here; only their absence means "load whole"
            raise NotStreamable(str(e)) from None
        try:
            model = model if model is not None else empty_model(config, dtype)
        except UpcycleError:
            raise
        except Exception as e:      # a config that builds no model (an unknown activation, a bad size)
            raise UpcycleError(f"{path}: config.json does not build a {config.model_type} model "
                               f"({type(e).__name__}: {' '.join(str(e).split())[:300]})") from None
        names, missing = checkpoint_names(model, reader)
        if missing:
            raise NotStreamable(f"{path}: the checkpoint's tensor names do not match {type(model).__name__}'s "
                                f"({len(missing)} not found, e.g. {missing[:3]})")
        check_shapes(model, reader, names, path)
        return cls(reader, model, names, dtype, storage, device)

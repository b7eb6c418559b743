"""A model before any weight exists: built on the meta device, for plans, streaming and writing.

A model's parameters are created on the meta device (shapes and dtypes, no memory); its buffers are real, since
some are computed at construction and never stored in checkpoints (rotary frequencies). From it come every tensor
a checkpoint of the model stores (`tensor_specs`: name, shape, dtype) and their bytes, before a weight is read.
"""

from __future__ import annotations

import torch
import transformers
from torch import nn

from ..core.architectures import family_of


def no_init():
    """transformers' switch that skips weight initialisation: drawing random values into meta tensors goes
    through torch's reference implementations and took 10 ms a block (a 1,000-block plan: 50 s)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:             # a transformers without it: initialisation runs, only slower
        import contextlib

        return contextlib.nullcontext()
    return no_init_weights()


def architecture_class(config) -> type[nn.Module]:
    """The transformers class a dense checkpoint's config names (its `architectures`), else the family's Auto
    class's mapping for the config."""
    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    if cls is None:
        auto = getattr(transformers, family_of(config).auto_class)
        cls = auto._model_mapping[type(config)]
    return cls


def empty_model(config, dtype: torch.dtype) -> nn.Module:
    """The dense model with parameters on the meta device and real buffers, in eval mode."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False), no_init():
        model = architecture_class(config)._from_config(config, dtype=dtype)
    model.tie_weights()          # tied tensors become one object, so they are read and written once
    return model.eval()


def tensor_specs(model: nn.Module) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of every tensor the model's checkpoint stores, in state-dict order, a tensor tied to
    an earlier one stored once under the earlier name (as transformers' save_pretrained stores a tied head)."""
    seen, specs = set(), []
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        specs.append((name, tuple(tensor.shape), tensor.dtype))
    return specs


def output_bytes(specs: list[tuple[str, tuple[int, ...], torch.dtype]]) -> int:
    return sum(torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size() for _, shape, dtype in specs)


def bytes_by_block(specs: list[tuple[str, tuple[int, ...], torch.dtype]], blocks: list[str]) -> dict[str, int]:
    """Bytes of the tensors under each block path (one pass over the tensors)."""
    sizes = dict.fromkeys(blocks, 0)
    for name, shape, dtype in specs:
        parts = name.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            key = ".".join(parts[:cut])
            if key in sizes:
                sizes[key] += torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
                break
    return sizes

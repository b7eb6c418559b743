"""A model whose weights stay on disk until a block needs them (a conversion within bounded memory).

The model is built with its parameters on the meta device (`skeleton.empty_model`). `materialize` reads one
module's parameters from a checkpoint (`shards.CheckpointReader`) in the compute dtype; `release` sends them
back to the meta device, so memory holds the model's trunk (embeddings, final norm, head) and one block.
`blocks_on_demand` does both around every block's forward, so a whole forward pass (the end-to-end logit
check) runs on a model of any size with one block in memory at a time. The names of a model's tensors and of
its checkpoint's can differ by the base-model prefix (a `LlamaModel` checkpoint read into `LlamaForCausalLM`);
`checkpoint_names` maps them, and says which tensors the checkpoint lacks (tied weights are found through the
model's own tying, as transformers does).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from ..core.architectures import family_of, find_tower_layers
from ..errors import UpcycleError
from .reader import CheckpointReader


def _tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters and persistent buffers, as the state dict names them (tied tensors once)."""
    yield from module.state_dict(keep_vars=True).items()


def checkpoint_names(model: nn.Module, reader: CheckpointReader) -> tuple[dict[str, str], list[str]]:
    """(model tensor name -> checkpoint name, model tensors the checkpoint has under no name). A tensor tied
    to one the checkpoint has (an output head tied to the embeddings) is not missing."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    names, missing, seen = {}, [], {}
    tensors = dict(_tensors(model))
    for name, tensor in tensors.items():
        candidates = [name]
        if prefix:
            candidates += [name.removeprefix(prefix + "."), f"{prefix}.{name}"]
        found = next((c for c in candidates if c in reader), None)
        if found is not None:
            names[name] = found
            seen[id(tensor)] = found
        elif id(tensor) in seen:
            names[name] = seen[id(tensor)]
        else:
            missing.append(name)
    # a tied tensor met before the one the checkpoint stores
    for name in list(missing):
        tensor = tensors[name]
        if id(tensor) in seen:
            names[name] = seen[id(tensor)]
            missing.remove(name)
    return names, missing


def _cast(value: torch.Tensor, dtype: torch.dtype, round_to: torch.dtype | None,
          device: torch.device | None = None) -> torch.Tensor:
    """Floating-point tensors in `dtype`, first rounded to `round_to` (the storage dtype: the model then
    computes with the weights as they will be stored, as a model loaded in that dtype does), on `device`."""
    value = value.to(device) if device is not None else value     # moved in the file's dtype: fewer bytes
    if not value.is_floating_point():
        return value
    if round_to is not None and round_to != value.dtype:
        value = value.to(round_to)
    return value.to(dtype)


def _buffers_to(module: nn.Module, device: torch.device | None) -> None:
    """Move `module`'s own buffers that were computed at construction (not read: BERT's position_ids, rotary
    frequencies) to `device`: with --device cuda a CPU position_ids would index a GPU embedding. Found on an H100."""
    if device is None:
        return
    for name, buffer in module._buffers.items():
        if buffer is not None and not buffer.is_meta and buffer.device != device:
            module._buffers[name] = buffer.to(device)


def materialize(module: nn.Module, prefix: str, reader: CheckpointReader, names: dict[str, str],
                dtype: torch.dtype, round_to: torch.dtype | None = None, device: torch.device | None = None
                ) -> None:
    """Give `module` (at `prefix` in the model) its parameters and persistent buffers from the checkpoint,
    floating-point ones in `dtype` (rounded to `round_to` first); a no-op for tensors already real."""
    for sub in module.modules():
        _buffers_to(sub, device)
    loaded = {}
    for name, tensor in _tensors(module):
        if not tensor.is_meta:
            continue
        key = names.get(prefix + name)
        if key is None:
            raise UpcycleError(f"the checkpoint has no tensor for {prefix + name}")
        value = _cast(reader.get(key), dtype, round_to, device)
        # a buffer outlives `release` (a router's selection bias): as a view of the checkpoint's memory map it
        # would keep the whole file mapped, and every page read since in the process; buffers are small
        loaded[name] = value if isinstance(tensor, nn.Parameter) else value.clone()
    if loaded:
        module.load_state_dict(loaded, strict=False, assign=True)


def release(module: nn.Module) -> None:
    """Send the module's parameters back to the meta device (buffers stay: some are computed, not stored)."""
    for sub in module.modules():
        for name, p in sub._parameters.items():
            if p is not None and not p.is_meta:
                sub._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)


def block_paths(model: nn.Module) -> list[str]:
    """Qualified names of every block of every tower of the model's family."""
    family = family_of(model.config)
    paths = []
    for tower in family.towers_of(model.config).values():
        found = find_tower_layers(model, tower)
        if found is not None:
            paths += [f"{found[0]}.{i}" for i in range(len(found[1]))]
    return paths


def materialize_trunk(model: nn.Module, reader: CheckpointReader, names: dict[str, str],
                      dtype: torch.dtype, round_to: torch.dtype | None = None,
                      device: torch.device | None = None) -> None:
    """Everything outside the blocks (embeddings, norms, head), then the model's own tying."""
    blocks = set(block_paths(model))
    done: set[int] = set()          # a tied tensor is read once; tie_weights shares it again at the end
    for path, module in model.named_modules():
        if path in blocks or any(path.startswith(b + ".") for b in blocks):
            continue
        _buffers_to(module, device)
        for name, tensor in list(module._parameters.items()) + list(module._buffers.items()):
            if tensor is None or not tensor.is_meta or id(tensor) in done:
                continue
            done.add(id(tensor))
            full = f"{path}.{name}" if path else name
            key = names.get(full)
            if key is None:
                raise UpcycleError(f"the checkpoint has no tensor for {full}")
            value = _cast(reader.get(key), dtype, round_to, device)
            if name in module._parameters:
                module._parameters[name] = nn.Parameter(value, requires_grad=False)
            else:
                module._buffers[name] = value.clone()       # owns its memory: see `materialize`
    if hasattr(model, "tie_weights"):
        model.tie_weights()


@contextlib.contextmanager
def blocks_on_demand(model: nn.Module, reader: CheckpointReader, names: dict[str, str], dtype: torch.dtype,
                     round_to: torch.dtype | None = None, device: torch.device | None = None):
    """Within the block, each block is read from the checkpoint before its forward and released after it."""
    handles = []
    for path in block_paths(model):
        block = model.get_submodule(path)

        def load(module, args, kwargs, prefix=path + "."):
            materialize(module, prefix, reader, names, dtype, round_to, device)

        def free(module, args, kwargs, output):
            release(module)
            reader.close()          # unmaps the files: pages read for this block leave the process

        handles += [block.register_forward_pre_hook(load, with_kwargs=True),
                    block.register_forward_hook(free, with_kwargs=True)]
    try:
        yield model
    finally:
        for h in handles:
            h.remove()

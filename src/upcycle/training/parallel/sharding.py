"""Sharded training (FSDP2) for `upcycle train`: wrapping the model, and full state out of and into it.

`accelerate launch --use_fsdp --fsdp_version 2` (or an Accelerate config with `distributed_type: FSDP`) asks for
it. On GPUs Accelerate's FSDP plugin shards the model in `Accelerator.prepare` (its transformer-block policy,
mixed precision, offload). On CPU processes (gloo) Accelerate 1.15 leaves the plugin unused and would wrap the
model in DDP, so `shard_on_cpu` calls torch's `fully_shard` itself: each transformer block the model names in
`_no_split_modules` (what Accelerate's transformer policy wraps), then the root, which keeps the embeddings and
the output head (Accelerate gives those units of their own). Either way every parameter becomes a DTensor
sharded along dim 0, and the rest of the loop is the same code.

Checkpoints and the final model hold full state, in the files one process writes: `gather` all-gathers one
tensor at a time (every process takes part) and only the main process keeps it, on the CPU. A parameter's
optimizer state is gathered the same way from `Optimizer.state_dict()` (keyed by parameter index, like a
single-process checkpoint), not with torch.distributed.checkpoint's get/set_optimizer_state_dict: those take
a zero-gradient optimizer step when the optimizer has no state yet (a checkpoint before the first update), which
would start AdamW's step counter at 1. `shard_of` cuts this process's part out of a full tensor (no
communication: every process reads the files itself), so a checkpoint loads on any number of processes.
`full_parameters` lets the main process write a sharded model with the code that writes an unsharded one.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
from torch import nn

from ...errors import UpcycleError


def requested() -> bool:
    """Whether the launcher asked for FSDP (`accelerate launch --use_fsdp` sets this for every process)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def check_version() -> None:
    """FSDP1 (flat parameters, wrapper modules) is not what this module handles."""
    version = os.environ.get("FSDP_VERSION", "1")
    if version != "2":
        raise UpcycleError(f"`upcycle train` supports FSDP2 only; this launch asks for fsdp_version {version} "
                           "(pass --fsdp_version 2 to accelerate launch, or set fsdp_version: 2 in its config)")


def is_dtensor(t: torch.Tensor | None) -> bool:
    if not torch.distributed.is_available():     # a torch built without distributed support has no DTensor
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """This process's part of a sharded tensor (a view: writing to it writes the parameter), else the tensor."""
    return t.to_local() if is_dtensor(t) else t


def check_dtypes(model: nn.Module, mixed_precision: str) -> None:
    """FSDP2 reduce-scatters a block's gradients in one dtype; a model mixing them (a bfloat16 model whose upcycle
    routers stay float32) trains only with mixed precision on, where the trainable weights become float32."""
    dtypes = {p.dtype for p in model.parameters() if p.requires_grad}
    if len(dtypes) > 1 and mixed_precision == "no":
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
        raise UpcycleError(f"FSDP needs one dtype for the trained weights; this model has {names}. Set "
                           "mixed_precision: bf16 (FSDP then keeps float32 weights and computes in bfloat16)")


def shard_on_cpu(model: nn.Module, processes: int, mixed_precision: str) -> None:
    """`fully_shard` each transformer block (innermost first), then the root, on a CPU mesh of all processes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    blocks = set(getattr(model, "_no_split_modules", None) or ())
    units = [m for m in reversed(list(model.modules())) if type(m).__name__ in blocks]
    if not units:
        raise UpcycleError(f"FSDP: {type(model).__name__} names no transformer block class (_no_split_modules) "
                           "to shard by")
    if mixed_precision != "no":     # float32 master weights, as Accelerate's FSDP2 preparation does on GPUs
        for p in model.parameters():
            if p.requires_grad and p.dtype != torch.float32:
                p.data = p.data.float()
    mesh = init_device_mesh("cpu", (processes,))
    for unit in units:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)


def whole(t: torch.Tensor) -> torch.Tensor:
    """The whole of a sharded tensor on every process (an all-gather: every process must call it, in the same
    order); any other tensor as it is."""
    if not is_dtensor(t):
        return t
    from torch.distributed.tensor import DTensor

    mesh = t.device_mesh
    if t.device.type != mesh.device_type:        # offloaded to the CPU: gather on the mesh's device
        t = DTensor.from_local(t.to_local().to(mesh.device_type), mesh, t.placements, shape=t.shape,
                               stride=t.stride())
    return t.full_tensor()


def gather(t: torch.Tensor, keep: bool) -> torch.Tensor | None:
    """The whole of `t` on the CPU where `keep` (the main process), None elsewhere (see `whole`)."""
    full = whole(t.detach())
    return full.cpu() if keep else None


def shard_of(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This process's part of `full` as `like` (a DTensor) is split, a tensor of its own (a copy, never a view
    of `full`, which may be a memory-mapped file) in `like`'s dtype and on its device; `full` itself where
    `like` is not sharded. No communication: every process holds `full` and keeps its own part
    (src_data_rank=None), cut as torch.chunk cuts, which is FSDP2's split."""
    if not is_dtensor(like):
        return full
    from torch.distributed.tensor import distribute_tensor

    part = distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()
    return part.to(like.dtype, copy=True)


def sharded_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`full` split as `like` is, as a DTensor (see `shard_of`); `full` itself where `like` is not sharded."""
    if not is_dtensor(like):
        return full
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(shard_of(full, like), like.device_mesh, like.placements, run_check=False,
                              shape=like.shape, stride=like.stride())


def full_model_state(model: nn.Module, keep: bool) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer, whole, on the main process (`keep`); {} elsewhere."""
    out, done = {}, {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in done:                        # a tied parameter is gathered once, under both names
            done[id(t)] = gather(t, keep)
        if keep:
            out[name] = done[id(t)]
    return out


def full_optimizer_state(optimizer, keep: bool) -> dict:
    """`optimizer.state_dict()` with every sharded state tensor whole (the main process); {} elsewhere."""
    state = optimizer.state_dict()
    gathered = {}
    for index in sorted(state["state"]):            # the same order on every process
        entry = {k: gather(v, keep) if isinstance(v, torch.Tensor) else v for k, v in state["state"][index].items()}
        gathered[index] = entry
    return {"state": gathered, "param_groups": state["param_groups"]} if keep else {}


def load_optimizer_state(optimizer, full: dict) -> None:
    """Load a full (single-process) optimizer state into an optimizer over sharded parameters."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    sharded = {}
    for index, entry in full["state"].items():
        p = params[int(index)]
        sharded[index] = {k: sharded_like(v, p) if isinstance(v, torch.Tensor) and v.shape == p.shape else v
                          for k, v in entry.items()}
    optimizer.load_state_dict({"state": sharded, "param_groups": full["param_groups"]})


def load_model_state(model: nn.Module, read, names: set[str]) -> tuple[list[str], list[str]]:
    """Copy each tensor of a full state (`read(name)` -> the whole tensor, `names`: the ones there are) into this
    process's part of the model; a tied parameter saved once (safetensors keeps one name) loads through the
    other. Returns (missing, unexpected) names."""
    targets = model.state_dict(keep_vars=True)
    alias = {}                                       # parameter -> a name of it that the file has
    for name, t in targets.items():
        if name in names:
            alias.setdefault(id(t), name)
    missing = [name for name, t in targets.items() if id(t) not in alias]
    unexpected = sorted(names - set(targets))
    if missing or unexpected:
        return missing, unexpected
    done = set()
    with torch.no_grad():
        for t in targets.values():
            if id(t) in done:
                continue
            done.add(id(t))
            local(t).copy_(shard_of(read(alias[id(t)]), t))
    return [], []


@contextlib.contextmanager
def full_parameters(model: nn.Module, state: dict[str, torch.Tensor],
                    dtypes: dict[str, torch.dtype] | None = None) -> Iterator[nn.Module]:
    """The main process: `model` with its sharded parameters replaced by the whole tensors of `state` (cast to
    `dtypes` by name where given) and shown as its own class (FSDP2 makes the root an `FSDP<name>` subclass, a
    name the upcycle format records), so code that writes a model writes it; all is put back after. Tied
    parameters stay one tensor. Nothing may run the model meanwhile."""
    from torch.distributed.fsdp import FSDPModule

    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    whole: dict[int, nn.Parameter] = {}
    cls = type(model)
    try:
        if issubclass(cls, FSDPModule):
            model.__class__ = next(base for base in cls.__bases__ if base is not FSDPModule)
        for prefix, module in model.named_modules(remove_duplicate=False):
            for name, p in list(module._parameters.items()):
                if p is None:
                    continue
                fqn = f"{prefix}.{name}" if prefix else name
                if id(p) not in whole:
                    tensor = state[fqn]
                    if dtypes is not None and fqn in dtypes:
                        tensor = tensor.to(dtypes[fqn])
                    whole[id(p)] = nn.Parameter(tensor, requires_grad=False)
                swapped.append((module, name, p))
                module._parameters[name] = whole[id(p)]
        yield model
    finally:
        model.__class__ = cls
        for module, name, p in swapped:
            module._parameters[name] = p

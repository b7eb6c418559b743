"""Find the FFNs to convert, install MoE layers in their place, and feed padding masks to the layers.

Validation comes first (docs/design.md principle 4, after huggingface/peft): `plan_targets` resolves the placement
into concrete blocks and refuses bad input before any weight is touched; `install` then only mutates.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from torch import nn

from ..config import PlacementConfig
from ..errors import UpcycleError
from .architectures import Family, family_of, find_tower_layers, mask_root, tower_config
from .moe import MoELayer
from .routing_context import ROUTING


@dataclass(frozen=True)
class Target:
    """One block whose FFN becomes an MoE layer."""

    tower: str
    index: int
    path: str          # qualified name of the block inside the model

    @property
    def name(self) -> str:
        return f"{self.tower}.{self.index}"


def plan_targets(model: nn.Module, placement: PlacementConfig) -> list[Target]:
    """Resolve a placement to blocks; every error a user can cause is raised here, before any mutation."""
    family = family_of(model.config)
    towers = family.towers_of(model.config)
    present = {name: found for name, tower in towers.items()
               if (found := find_tower_layers(model, tower)) is not None}
    if not present:
        raise UpcycleError(f"found no transformer blocks in {type(model).__name__} "
                           f"(looked for {[t.layers for t in towers.values()]})")
    wanted = placement.towers or tuple(present)
    for tower in wanted:
        if tower not in towers:
            raise UpcycleError(f"{type(model).__name__} has towers {sorted(towers)}, not {tower!r}")
        if tower not in present:
            raise UpcycleError(f"tower {tower!r} is not in this {type(model).__name__}; it has {sorted(present)}")
    if placement.every < 1:
        raise UpcycleError(f"placement.every must be >= 1, got {placement.every}")

    targets = []
    for tower in wanted:
        path, blocks = present[tower]
        n = len(blocks)
        if placement.layers is not None:
            bad = [i for i in placement.layers if not -n <= i < n]
            if bad:
                raise UpcycleError(f"layer indices {bad} are out of range for tower {tower!r} with {n} blocks "
                                   f"(valid: 0..{n - 1}, or negative from the end)")
            indices = sorted({i % n for i in placement.layers})
        else:
            indices = [i for i in range(n) if (i + 1) % placement.every == 0]
        targets += [Target(tower, i, f"{path}.{i}") for i in indices]
    if not targets:
        raise UpcycleError(f"the placement matched zero layers (every={placement.every}, layers={placement.layers}, "
                           f"towers={list(wanted)})")
    return targets


def tower_cfg(model: nn.Module, family: Family, target: Target):
    return tower_config(model.config, family.towers_of(model.config)[target.tower])


def install(model: nn.Module, block_path: str, layer: MoELayer) -> None:
    """Put `layer` where the FFN of the block at `block_path` was."""
    family_of(model.config).install(model.get_submodule(block_path), layer)


def _mask_pre_hook(module, args, kwargs):
    try:
        bound = inspect.signature(module.forward).bind_partial(*args, **kwargs)
        mask = bound.arguments.get("attention_mask")
    except TypeError:
        mask = kwargs.get("attention_mask")
    module._upcycle_mask_token = ROUTING.set(mask=mask if mask is not None and mask.dim() == 2 else None)


def _mask_post_hook(module, args, kwargs, output):
    token = getattr(module, "_upcycle_mask_token", None)
    if token is not None:
        ROUTING.set(**token)
        module._upcycle_mask_token = None


def track_padding_masks(model: nn.Module) -> list:
    """Hook each tower's root so its MoE layers see the batch's [B, S] attention mask (no forward rewritten)."""
    family = family_of(model.config)
    handles = []
    for tower in family.towers_of(model.config).values():
        found = find_tower_layers(model, tower)
        root = mask_root(model, found[0], tower) if found else None
        if root is not None and not getattr(root, "_upcycle_mask_hooked", False):
            handles.append(root.register_forward_pre_hook(_mask_pre_hook, with_kwargs=True))
            handles.append(root.register_forward_hook(_mask_post_hook, with_kwargs=True, always_call=True))
            root._upcycle_mask_hooked = True
    return handles

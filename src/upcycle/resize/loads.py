"""Each expert's load on the probe: how many of the probe's real token-slots (top-k choices kept by capacity) each
MoE layer gave each expert, counted while the probe runs through the model before and after a prune or a grow.

A user's first question of a resized model is whether its router reaches every expert: a grown copy that no token
reaches trains no more than a dead expert, so a grow whose copies get no token says so loudly (`silent_copies`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from ..core.moe import MoELayer, moe_layers


@contextlib.contextmanager
def counted_loads(model: nn.Module) -> Iterator[dict[str, list[int]]]:
    """Inside the block, every forward of the model's upcycle MoE layers adds its token-slots per expert to the
    yielded dict (layer name -> [E] counts); a stock class's sparse blocks keep no routing record and are left
    out."""
    counts: dict[str, torch.Tensor] = {}
    found: dict[str, list[int]] = {}

    def count(name: str):
        def hook(layer: MoELayer, args, output) -> None:
            record = layer.last_record
            if record is None:
                return
            slots_TK = record.kept_TK if record.kept_TK is not None else torch.ones_like(record.topk_ids_TK,
                                                                                          dtype=torch.bool)
            if record.mask_T is not None:
                slots_TK = slots_TK & record.mask_T.to(slots_TK.device).bool()[:, None]
            add = torch.bincount(record.topk_ids_TK[slots_TK].reshape(-1).cpu(), minlength=layer.num_experts)
            counts[name] = counts[name] + add if name in counts else add
        return hook

    handles = [layer.register_forward_hook(count(name)) for name, layer in moe_layers(model).items()]
    try:
        yield found
    finally:
        for handle in handles:
            handle.remove()
        found.update({name: [int(c) for c in counted] for name, counted in counts.items()})


def add_loads(layers: dict, before: dict[str, list[int]], after: dict[str, list[int]]) -> None:
    """Each layer's report entry gains its loads on the probe through the source and through the new model."""
    for name, entry in layers.items():
        entry["load_before"], entry["load_after"] = before.get(name), after.get(name)


def silent_copies(layers: dict) -> list[str]:
    """One line per grown layer whose copies (the experts after the source's, `copied` in its report entry) no
    token of the probe reached (`load_after`)."""
    lines = []
    for name, entry in layers.items():
        after = entry.get("load_after")
        if after is None or not entry.get("copied"):
            continue
        E = len(after) - len(entry["copied"])
        silent = [e for e in range(E, len(after)) if after[e] == 0]
        if silent:
            lines.append(f"{name}: no token of the probe reaches the copies {silent} (of "
                         f"{[entry['copied'][e - E] for e in silent]}); they train no more than a dead expert")
    return lines

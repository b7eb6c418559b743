"""`upcycle prune --dry-run` and `upcycle grow --dry-run`: what a prune or a grow would write, from the folder's
config and checkpoint headers alone (no weight is read, nothing is written, OUT is not claimed).

Per MoE layer the expert count before and after; for the whole folder the parameters and the bytes on disk before
and after, where every tensor a resize indexes by expert (an upcycle layer's experts, router rows and biases and
selection bias; a stock block's router rows and stacked experts: what `streamed.write_resized` and
`expert_count._select_stock` change) scales by N / E and every other tensor stays. A grown layer without a router
bias gains one (N float32 numbers). The figures are exact for the tensors written (tested against the folders the
commands then write); the files add their headers and the tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoint.reader import CheckpointReader
from ..checkpoint.upcycle_format import MOE_CONFIG
from ..core.moe import moe_layers
from ..core.stock_moe import stock_moe_blocks
from .expert_count import ExpertCount


@dataclass(frozen=True)
class ResizePlan:
    """What a prune or a grow of `model` would write."""

    model: str
    kind: str                                   # "prune" or "grow"
    request: ExpertCount
    layers: dict[str, tuple[int, int]]          # MoE layer -> (experts now, experts after)
    parameters: tuple[int, int]                 # before, after
    bytes_on_disk: tuple[int, int]              # before, after
    streaming: bool

    def summary(self) -> str:
        (p0, p1), (b0, b1) = self.parameters, self.bytes_on_disk
        counts = sorted({f"{e} -> {n}" for e, n in self.layers.values()})
        how = f"--by {self.request.by}" + (f", --perturb {self.request.perturb}" if self.kind == "grow" else "")
        route = "a block at a time (--streaming)" if self.streaming else "in memory (the whole model loaded)"
        return "\n".join([
            f"{self.kind} plan for {self.model} ({how}), nothing written",
            f"  MoE layers           {len(self.layers)}, experts {', '.join(counts)}",
            f"  parameters           {p0 / 1e9:.3f} B -> {p1 / 1e9:.3f} B",
            f"  weights on disk      {b0 / 1e9:.3f} GB -> {b1 / 1e9:.3f} GB",
            f"  runs                 {route}"])


def plan_resize(model: str, request: ExpertCount, *, grow: bool, streaming: bool) -> ResizePlan:
    """The plan of a checked request (`run.check` first): the folder's MoE layers from a skeleton built of its
    config on the meta device, sizes from its safetensors headers."""
    folder = Path(model)
    reader = CheckpointReader(folder, check_values=False)
    names = reader.names()
    groups = _indexed_by_expert(folder)
    layers: dict[str, tuple[int, int]] = {}
    before, after = [0, 0], [0, 0]                  # parameters, bytes
    for name in names:
        shape = reader.shape(name)
        count = _numel(shape)
        nbytes = count * reader.dtype(name).itemsize
        before[0], before[1] = before[0] + count, before[1] + nbytes
        group = next((g for prefix, g in groups.items() if name == prefix or
                      (prefix.endswith(".") and name.startswith(prefix))), None)
        if group is None:
            after[0], after[1] = after[0] + count, after[1] + nbytes
            continue
        layer, E = group
        layers[layer] = (E, request.num_experts)
        after[0] += count // E * request.num_experts
        after[1] += nbytes // E * request.num_experts
    return ResizePlan(model, "grow" if grow else "prune", request, layers, (before[0], after[0]),
                      (before[1], after[1]), streaming)


def _indexed_by_expert(folder: Path) -> dict[str, tuple[str, int]]:
    """Tensor name (or a prefix ending in ".") -> (its MoE layer, the layer's expert count), for every tensor a
    resize indexes by expert: an upcycle MoE layer's own tensors (its shared experts left out), or a stock
    block's router and stacked experts."""
    if (folder / MOE_CONFIG).is_file():
        from .streamed import open_folder

        skeleton = open_folder(folder).model
        return {f"{name}.{key}": (name, layer.num_experts) for name, layer in moe_layers(skeleton).items()
                for key in layer.state_dict(keep_vars=True) if not key.startswith("shared_experts.")}
    from transformers import AutoConfig

    from ..checkpoint.skeleton import empty_model

    skeleton = empty_model(AutoConfig.from_pretrained(folder), torch.float32)
    return {f"{name}.{part}.": (name, block.gate.num_experts) for name, block in stock_moe_blocks(skeleton).items()
            for part in ("gate", "experts")}


def _numel(shape) -> int:
    count = 1
    for d in shape:
        count *= int(d)
    return count

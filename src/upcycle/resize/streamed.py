"""`upcycle prune --streaming` and `upcycle grow --streaming`: an upcycle folder resized a block at a time, so a
model larger than memory prunes or grows.

    score   the calibration batch runs through the model as the streaming conversion's probe does, each block
            read from disk for its forward and released after it (`probe.lazy_probe_output`); while a block is
            in memory, its MoE layer's experts are scored on the layer's inputs (`metrics.saliency`: REAP,
            frequency or random to prune, utility to grow) and, to prune, its exact copies found
            (`core.resize.copy_groups`), to grow, its copies' router-row offsets made (`core.router_split`): a
            number per expert, or a row per copy, is all that is kept
    write   the folder's tensors copied into planned shards (`checkpoint.writer.ShardedWriter`), an MoE layer's
            router rows, selection bias and stacked experts indexed by the experts it ends with as they pass
            (`write_resized`, a copy's row offset added), its router bias as the in-memory prune or grow makes
            it; grown copies perturbed (`--perturb`) with a layer's expert tensors together, layer after layer in
            the model's order, so the draws are the in-memory grow's
    compare the probe through the source and through the output, again a block at a time, for the KL

What is in memory at once: one block and the batch's hidden states, then one tensor (a perturbed grow: one layer's
expert tensors). The experts kept or copied, the order and the shifts are the in-memory path's
(`expert_count.choose_experts`, `choose_copies`), so both write the same tensors (a grown copy's router row to
rounding: it comes from a forward of another batch shape; tests).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..checkpoint.heap import trim_heap
from ..checkpoint.lazy import block_paths
from ..checkpoint.loading import TOKENIZER_FOLDER_FILES
from ..checkpoint.reader import CheckpointReader
from ..checkpoint.skeleton import empty_model
from ..checkpoint.streamed import StreamSource
from ..checkpoint.upcycle_format import MOE_CONFIG, one_line_errors, read_spec, saved_dtype
from ..checkpoint.writer import ShardedWriter
from ..core.expert_shape import STRUCTURE, ExpertShape
from ..core.moe import Experts, MoELayer, moe_layers
from ..core.resize import check_growable, copy_groups, pruned_router_bias
from ..core.router_split import copy_row_offsets
from ..core.surgery import install, track_padding_masks
from ..errors import UpcycleError
from ..metrics.saliency import expert_saliency
from ..probe import Probe, ProbeOutput, lazy_probe_output
from .expert_count import ExpertCount, check_counts, choose_copies, choose_experts
from .loads import add_loads, counted_loads
from .perturb import perturb_copies

COMPUTE = torch.float32
COPIED = ("config.json", "generation_config.json", *TOKENIZER_FOLDER_FILES)


def _skeleton(path: Path, spec: dict, config) -> nn.Module:
    """The folder's model with weights on the meta device and real buffers (rotary tables), for a lazy pass:
    the dense skeleton, its MoE layers built on the meta device (no expert tensor is ever allocated)."""
    model = empty_model(config, COMPUTE)
    if type(model).__name__ != spec["model_class"]:
        raise UpcycleError(f"{path}: {MOE_CONFIG} names {spec['model_class']}, its base config builds "
                           f"{type(model).__name__}")
    for entry in spec["layers"]:
        entry = dict(entry)
        block = entry.pop("block")
        with torch.device("meta"), one_line_errors(path):
            layer = MoELayer.from_spec(entry, dtype=COMPUTE)
        install(model, block, layer)
    track_padding_masks(model)
    return model.eval()


def open_folder(path: Path) -> StreamSource:
    """An upcycle folder opened for a pass a block at a time (headers read, no weight)."""
    spec, config = read_spec(path)
    model = _skeleton(path, spec, config)
    return StreamSource.open(path, config, COMPUTE, model=model, storage=saved_dtype(path))


def streamed_scores(source: StreamSource, batch: dict,
                    measure: Callable[[str, int, MoELayer, torch.Tensor], tuple]) -> dict[str, tuple]:
    """Per MoE layer: what `measure(name, index, layer, x_TD)` makes of the layer and its inputs at the real tokens
    of `batch`, taken while its block runs on the batch."""
    found: dict[str, tuple] = {}
    layers = moe_layers(source.model)
    index = {name: i for i, name in enumerate(layers)}

    def score(name: str):
        def hook(layer: MoELayer, args, output) -> None:
            x_TD = args[0].reshape(-1, args[0].shape[-1])
            mask = layer.last_record.mask_T if layer.last_record is not None else None
            x_TD = x_TD[mask.to(x_TD.device).bool()] if mask is not None else x_TD
            found[name] = measure(name, index[name], layer, x_TD)
            trim_heap()            # the block's tensors go back to the system before the next block is read
        return hook

    handles = [layer.register_forward_hook(score(name)) for name, layer in layers.items()]
    try:
        lazy_probe_output(source, Probe(batch, "calibration"))
    finally:
        for handle in handles:
            handle.remove()
    if set(found) != set(layers):
        raise UpcycleError(f"the pass scored {len(found)} of {len(layers)} MoE layers")
    return found


@dataclass(frozen=True)
class Resized:
    """What becomes of one MoE layer's tensors: new expert i is old expert `index[i]` (its weights, router row and
    selection bias); `router_bias` is the new router bias from the old one (None when the layer has none), or None
    for no bias; `change`, when given, changes the layer's new expert tensors in place (named as in the folder,
    all of them at once: perturbing grown copies); `row_offsets`, when given, is added to the new router rows."""

    index: list[int]
    router_bias: Callable[[torch.Tensor | None], torch.Tensor | None]
    change: Callable[[dict[str, torch.Tensor]], None] | None = None
    row_offsets: torch.Tensor | None = None      # added to the new router rows [len(index), D] (grown copies)


def write_resized(source_path: Path, out: Path, changes: dict[str, Resized]) -> dict:
    """The folder at `source_path` with every MoE layer of `changes` resized, written into the existing folder
    `out` layer by layer in the order of `changes` (a layer's expert tensors one at a time, or together when it
    has a `change`), then every other tensor as it is; returns the new spec."""
    spec, _ = read_spec(source_path)
    reader = CheckpointReader(source_path)
    names = list(reader.names())
    owner = {name: next((layer for layer in changes if name.startswith(layer + ".")), None) for name in names}
    resized = {name for name, layer in owner.items()
               if layer is not None and not name.startswith(layer + ".shared_experts.")}
    biases = {layer: change.router_bias(reader.get(f"{layer}.router.bias") if f"{layer}.router.bias" in owner
                                        else None) for layer, change in changes.items()}
    specs = [(name, (len(changes[owner[name]].index), *reader.shape(name)[1:]) if name in resized
              else tuple(reader.shape(name)), reader.dtype(name))
             for name in names if name not in {f"{layer}.router.bias" for layer in changes}]
    specs += [(f"{layer}.router.bias", tuple(bias.shape), bias.dtype) for layer, bias in biases.items()
              if bias is not None]
    writer = ShardedWriter(out, specs)
    try:
        for layer, change in changes.items():
            index = torch.tensor(change.index, dtype=torch.long)
            own = [name for name in names if owner[name] == layer and name in resized
                   and name != f"{layer}.router.bias"]
            experts = [name for name in own if name.startswith(layer + ".experts.")]
            if change.change is not None:          # the layer's experts together, changed, then written
                tensors = {name: reader.get(name).index_select(0, index) for name in experts}
                change.change(tensors)
                for name in experts:
                    writer.write(name, tensors.pop(name))
            for name in own:
                if change.change is None or name not in experts:
                    tensor = reader.get(name).index_select(0, index)
                    if name == f"{layer}.router.weight" and change.row_offsets is not None:
                        tensor = tensor + change.row_offsets.to(tensor)
                    writer.write(name, tensor)
            if biases[layer] is not None:
                writer.write(f"{layer}.router.bias", biases[layer])
        for name in names:                  # the rest as it is (a resized layer's old router bias is replaced)
            if name not in resized:
                writer.write(name, reader.get(name))
        writer.close()
    except BaseException:
        writer.abort()
        raise
    for layer, change in changes.items():
        entry = next((e for e in spec["layers"] if layer.startswith(e["block"] + ".")), None)
        if entry is None:
            raise UpcycleError(f"{layer} is in no block {MOE_CONFIG} lists")
        entry["num_experts"] = len(change.index)
        entry["router_bias"] = biases[layer] is not None
    for name in COPIED:
        if (source_path / name).is_file():
            shutil.copyfile(source_path / name, out / name)
    (out / MOE_CONFIG).write_text(json.dumps(spec, indent=2))
    return spec


def _pruned(keep: list[int], shift: list[float]) -> Resized:
    """The kept experts, their router bias as `core.resize.select_experts` makes it."""
    return Resized(keep, lambda old: pruned_router_bias(old, keep, shift))


def _grown(layer: MoELayer, copied: list[int], offsets_ND: torch.Tensor, perturb: str,
           generator: torch.Generator) -> Resized:
    """Experts 0..E-1 of `layer` (its skeleton: shapes only) and copies of `copied` with their sources' router bias
    and rows plus `offsets_ND` (`core.resize.duplicate_experts`), the copies perturbed as `perturb_copies` perturbs
    them in memory (the same draws from `generator`)."""
    E, shape = layer.num_experts, layer.spec()

    def change(tensors: dict[str, torch.Tensor]) -> None:
        prefix = next(iter(tensors)).rsplit(".", 1)[0] + "."
        with torch.device("meta"):
            experts = Experts(E + len(copied), ExpertShape(**{k: shape[k] for k in STRUCTURE}),
                              dtype=next(iter(tensors.values())).dtype)
        experts.load_state_dict({name[len(prefix):]: t for name, t in tensors.items()}, assign=True)
        perturb_copies(experts, range(E, E + len(copied)), perturb, generator)   # in place, in `tensors`

    index = [*range(E), *copied]
    rows = torch.cat([torch.zeros(E, offsets_ND.shape[1], dtype=offsets_ND.dtype), offsets_ND])
    return Resized(index, lambda old: pruned_router_bias(old, index), change if perturb != "none" else None, rows)


def prune_streamed(source_path: Path, out: Path, request: ExpertCount, batch: dict, probe: Probe | None = None,
                   phase: Callable[[str], None] = lambda _: None
                   ) -> tuple[dict, ProbeOutput | None, ProbeOutput | None]:
    """Score on `batch`, choose, write into `out` (module docstring); (the per-layer report, the probe's output
    through the source and through the written folder). `phase` is told as each pass over the weights ends."""
    source = open_folder(source_path)
    check_counts({name: (layer.num_experts, layer.top_k) for name, layer in moe_layers(source.model).items()},
                 request, grow=False)
    scores = streamed_scores(source, batch, lambda name, i, layer, x_TD: (
        expert_saliency(layer, x_TD, request.by, seed=request.seed + i), copy_groups(layer)))
    report, changes = {}, {}
    for name, (score, first) in scores.items():
        keep, shift = choose_experts(first, score, request.num_experts)
        changes[name] = _pruned(keep, shift)
        report[name] = {"saliency": [float(s) for s in score], "kept": keep,
                        "removed": [e for e in range(len(score)) if e not in keep],
                        "copies_of": {e: first[e] for e in range(len(score)) if first[e] != e}}
    phase(f"{len(scores)} MoE layers scored, a block at a time")
    return report, *_written(source_path, out, changes, probe, phase, report)


def grow_streamed(source_path: Path, out: Path, request: ExpertCount, batch: dict, probe: Probe | None = None,
                  phase: Callable[[str], None] = lambda _: None
                  ) -> tuple[dict, ProbeOutput | None, ProbeOutput | None]:
    """Copies chosen by utility (scored on `batch` a block at a time) or in turn, written into `out` layer by
    layer as `expert_count.grow_model` makes them in memory (the same tensors); as `prune_streamed` returns."""
    source = open_folder(source_path)
    layers = moe_layers(source.model)
    check_counts({name: (layer.num_experts, layer.top_k) for name, layer in layers.items()}, request, grow=True)
    for layer in layers.values():
        check_growable(layer)

    def measure(name: str, i: int, layer: MoELayer, x_TD: torch.Tensor) -> tuple:
        score = expert_saliency(layer, x_TD, "utility") if request.by == "utility" else None
        copied = choose_copies(score, layer.num_experts, request.num_experts)
        return score, copied, copy_row_offsets(layer, x_TD, copied, seed=request.seed + i)
    scores = streamed_scores(source, batch, measure)
    generator = torch.Generator().manual_seed(request.seed)       # the copies' perturbation, layer after layer
    report, changes = {}, {}
    for name, layer in layers.items():
        score, copied, offsets = scores[name]
        changes[name] = _grown(layer, copied, offsets, request.perturb, generator)
        report[name] = {"utility": None if score is None else [float(s) for s in score], "copied": copied,
                        "perturbed": request.perturb}
    phase(f"{len(layers)} MoE layers scored and their copies' rows split, a block at a time")
    return report, *_written(source_path, out, changes, probe, phase, report)


def _written(source_path: Path, out: Path, changes: dict[str, Resized], probe: Probe | None,
             phase: Callable[[str], None], report: dict) -> tuple[ProbeOutput | None, ProbeOutput | None]:
    """The probe through the source, the resized folder written, the probe through it (each pass a phase); each
    layer's entry of `report` gains its loads on the probe before and after."""
    before, loads_before = _probe_through(source_path, probe)
    phase("the probe through the source, a block at a time")
    write_resized(source_path, out, changes)
    phase("resized tensors written")
    after, loads_after = _probe_through(out, probe)
    add_loads(report, loads_before, loads_after)
    phase("the probe through the resized folder, a block at a time")
    return before, after


def _probe_through(folder: Path, probe: Probe | None) -> tuple[ProbeOutput | None, dict[str, list[int]]]:
    """The probe through the folder's model a block at a time, the heap trimmed before each block is read (the
    previous one released); with each MoE layer's load on it (`loads.counted_loads`)."""
    if probe is None:
        return None, {}
    source = open_folder(folder)

    def trim(*_) -> None:
        trim_heap()
    handles = [source.model.get_submodule(path).register_forward_pre_hook(trim)
               for path in block_paths(source.model)]
    try:
        with counted_loads(source.model) as loads:
            output = lazy_probe_output(source, probe)
        return output, loads
    finally:
        for handle in handles:
            handle.remove()
        trim_heap()

"""`upcycle prune --streaming`: an upcycle folder pruned a block at a time, so a model larger than memory prunes.

    score   the calibration batch runs through the model as the streaming conversion's probe does, each block
            read from disk for its forward and released after it (`probe.lazy_probe_output`); while a block is
            in memory, its MoE layer's experts are scored on the layer's inputs (`metrics.saliency`) and its
            exact copies found (`core.resize.copy_groups`): a number per expert is all that is kept
    write   the folder's tensors copied one at a time into planned shards (`checkpoint.writer.ShardedWriter`), an
            MoE layer's router rows, biases and stacked experts reduced to the kept experts as they pass (the
            kept copies' router bias shifted, as `expert_count.prune_model` does)
    compare the probe through the source and through the output, again a block at a time, for the KL

What is in memory at once: one block and the batch's hidden states, then one tensor. The kept experts, the order
and the shifts are the in-memory prune's (`expert_count._choose`), so both write the same tensors (a test).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ..checkpoint.heap import trim_heap
from ..checkpoint.lazy import block_paths
from ..checkpoint.loading import TOKENIZER_FILES
from ..checkpoint.reader import CheckpointReader
from ..checkpoint.skeleton import empty_model
from ..checkpoint.streamed import StreamSource
from ..checkpoint.upcycle_format import MOE_CONFIG, read_spec, saved_dtype
from ..checkpoint.writer import ShardedWriter
from ..core.moe import MoELayer, moe_layers
from ..core.resize import copy_groups
from ..core.surgery import install, track_padding_masks
from ..errors import UpcycleError
from ..metrics.saliency import expert_saliency
from ..probe import Probe, ProbeOutput, lazy_probe_output
from .expert_count import ExpertCount, check_counts, choose_experts

COMPUTE = torch.float32
COPIED = ("config.json", "generation_config.json", *TOKENIZER_FILES, "special_tokens_map.json", "chat_template.jinja")


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
        with torch.device("meta"):
            layer = MoELayer.from_spec(entry, dtype=COMPUTE)
        install(model, block, layer)
    track_padding_masks(model)
    return model.eval()


def open_folder(path: Path) -> StreamSource:
    """An upcycle folder opened for a pass a block at a time (headers read, no weight)."""
    spec, config = read_spec(path)
    model = _skeleton(path, spec, config)
    return StreamSource.open(path, config, COMPUTE, model=model, storage=saved_dtype(path))


def streamed_scores(source: StreamSource, batch: dict, request: ExpertCount) -> dict[str, tuple]:
    """Per MoE layer: (its scores, its first-copy map), taken while its block runs on `batch`."""
    found: dict[str, tuple] = {}
    layers = moe_layers(source.model)
    index = {name: i for i, name in enumerate(layers)}

    def score(name: str):
        def hook(layer: MoELayer, args, output) -> None:
            x_TD = args[0].reshape(-1, args[0].shape[-1])
            mask = layer.last_record.mask_T if layer.last_record is not None else None
            x_TD = x_TD[mask.to(x_TD.device).bool()] if mask is not None else x_TD
            found[name] = (expert_saliency(layer, x_TD, request.by, seed=request.seed + index[name]),
                           copy_groups(layer))
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


def write_pruned(source_path: Path, out: Path, choices: dict[str, tuple[list[int], list[float]]]) -> dict:
    """The folder at `source_path` with every MoE layer reduced to its kept experts (`choices`: name -> (kept,
    logit shifts)), written into the existing folder `out`; returns the new spec."""
    spec, _ = read_spec(source_path)
    reader = CheckpointReader(source_path)
    names = list(reader.names())
    moe = {name: next((layer for layer in choices if name.startswith(layer + ".")), None) for name in names}
    specs, added = [], {}
    for name in names:
        shape, dtype = reader.shape(name), reader.dtype(name)
        layer = moe[name]
        if layer is not None and not name.startswith(layer + ".shared_experts."):
            shape = (len(choices[layer][0]), *shape[1:])
        specs.append((name, tuple(shape), dtype))
        if layer is not None and name == f"{layer}.router.weight" and f"{layer}.router.bias" not in names \
                and any(choices[layer][1]):
            added[f"{layer}.router.bias"] = layer          # a shift needs a bias the layer did not have
            specs.append((f"{layer}.router.bias", (len(choices[layer][0]),), torch.float32))
    writer = ShardedWriter(out, specs)
    try:
        for name in names:
            tensor, layer = reader.get(name), moe[name]
            if layer is not None and not name.startswith(layer + ".shared_experts."):
                keep, shift = choices[layer]
                tensor = tensor.index_select(0, torch.tensor(keep, dtype=torch.long))
                if name == f"{layer}.router.bias":
                    tensor = tensor + torch.tensor(shift, dtype=tensor.dtype)
            writer.write(name, tensor)
            del tensor
            if layer is not None and f"{layer}.router.bias" in added and name == f"{layer}.router.weight":
                writer.write(f"{layer}.router.bias", torch.tensor(choices[layer][1], dtype=torch.float32))
        writer.close()
    except BaseException:
        writer.abort()
        raise
    for layer, (keep, _) in choices.items():
        entry = next((e for e in spec["layers"] if layer.startswith(e["block"] + ".")), None)
        if entry is None:
            raise UpcycleError(f"{layer} is in no block {MOE_CONFIG} lists")
        entry["num_experts"] = len(keep)
        entry["router_bias"] = entry.get("router_bias", False) or f"{layer}.router.bias" in added
    for name in COPIED:
        if (source_path / name).is_file():
            shutil.copyfile(source_path / name, out / name)
    (out / MOE_CONFIG).write_text(json.dumps(spec, indent=2))
    return spec


def prune_streamed(source_path: Path, out: Path, request: ExpertCount, batch: dict, probe: Probe | None = None,
                   phase: Callable[[str], None] = lambda _: None
                   ) -> tuple[dict, ProbeOutput | None, ProbeOutput | None]:
    """Score on `batch`, choose, write into `out` (module docstring); (the per-layer report, the probe's output
    through the source and through the written folder). `phase` is told as each pass over the weights ends."""
    source = open_folder(source_path)
    check_counts({name: (layer.num_experts, layer.top_k) for name, layer in moe_layers(source.model).items()},
                 request, grow=False)
    scores = streamed_scores(source, batch, request)
    report, choices = {}, {}
    for name, (score, first) in scores.items():
        keep, shift = choose_experts(first, score, request.num_experts)
        choices[name] = (keep, shift)
        report[name] = {"saliency": [float(s) for s in score], "kept": keep,
                        "removed": [e for e in range(len(score)) if e not in keep],
                        "copies_of": {e: first[e] for e in range(len(score)) if first[e] != e}}
    phase(f"{len(scores)} MoE layers scored, a block at a time")
    before = _probe_through(source_path, probe)
    phase("the probe through the source, a block at a time")
    write_pruned(source_path, out, choices)
    phase("pruned tensors written")
    after = _probe_through(out, probe)
    phase("the probe through the pruned folder, a block at a time")
    return report, before, after


def _probe_through(folder: Path, probe: Probe | None) -> ProbeOutput | None:
    """The probe through the folder's model a block at a time, the heap trimmed before each block is read (the
    previous one released)."""
    if probe is None:
        return None
    source = open_folder(folder)

    def trim(*_) -> None:
        trim_heap()
    handles = [source.model.get_submodule(path).register_forward_pre_hook(trim)
               for path in block_paths(source.model)]
    try:
        return lazy_probe_output(source, probe)
    finally:
        for handle in handles:
            handle.remove()
        trim_heap()

"""Streaming conversion: a dense checkpoint on disk to an upcycled checkpoint on disk, one block in memory.

mergekit streams checkpoints the same way, without data-aware methods or a check. The dense model is built
without weights (`checkpoint/skeleton.py`); its trunk (embeddings, norms, head) is read when the replayed
batches must run through it; each block is read when its turn comes in the block-by-block conversion
(`blockwise.py`), converted, written into the output's shards at their planned offsets
(`checkpoint/writer.ShardedWriter`) and released. A block after the last one that has to run is copied tensor by tensor.
Memory: the trunk, one dense block and its MoE layer, the method's working set for that layer, and (for
data-aware methods) the calibration batches' hidden states at one depth; never the whole model or output.

Dtypes: `dtype` is what the output stores; the blocks are read, replayed, converted and checked in float32
(`COMPUTE_DTYPE`), the MoE layer cast to the storage dtype as it is written. Methods do their linear algebra in
float32 anyway, and on a CPU bfloat16 matmuls are an order of magnitude slower than float32 ones (the
calibration replay of a 2B model in bfloat16 would take hours). The in-memory path computes in `dtype`; both
write the same bytes for copy, noise, drop, drop_svd, spri and granular (their float32 results are rounded once,
to the storage dtype); data-aware methods see float32 activations here.

The end-to-end check (`end_to_end_output`) runs a whole model the same way, one block at a time from disk, so it
is possible at any size; it costs another read of the dense checkpoint and of the output.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ..checkpoint.heap import trim_heap
from ..checkpoint.lazy import blocks_on_demand, materialize, materialize_trunk, release
from ..checkpoint.loading import DTYPES
from ..checkpoint.skeleton import bytes_by_block, tensor_specs
from ..checkpoint.streamed import NotStreamable, StreamSource
from ..checkpoint.writer import ShardedWriter
from ..config import ConvertConfig
from ..core.architectures import family_of
from ..core.devices import resolve_device
from ..core.surgery import Target, plan_targets
from ..errors import UpcycleError
from ..export.protocol import StockClass
from ..methods import Method
from ..probe import Probe, compare, lazy_probe_output, stock_probe_output
from .blockwise import (
    BlockVisit,
    BlockwiseResult,
    LayerBuilder,
    MethodLayers,
    ReplayGroup,
    convert_blocks,
    method_groups,
    visits,
)
from .calibration import first_block_inputs, real_tokens
from .layer_check import layer_probe
from .planned import layout_function, planned_model
from .preservation import ReorderedFFN
from .report import CalibrationSummary, Converted, Timings

COMPUTE_DTYPE = torch.float32
# Bytes the background writer may hold queued: half the largest block's output, so the next block's reading
# overlaps this one's writing without a second block in memory (docs/large-models.md has the measurements).
WRITE_QUEUE_FLOOR, WRITE_QUEUE_CAP = 64 * 2**20, 2 * 2**30


def write_queue_bytes(largest_block: int) -> int:
    return min(WRITE_QUEUE_CAP, max(WRITE_QUEUE_FLOOR, largest_block // 2))


def largest_block_bytes(specs: list[tuple[str, tuple[int, ...], torch.dtype]], block_paths: list[str]) -> int:
    """Bytes of the largest block in the output (the MoE blocks, for an upcycled model)."""
    return max(bytes_by_block(specs, block_paths).values(), default=0)


def source_first_inputs(source: StreamSource) -> Callable[[dict, list[list[dict]]], list[dict]]:
    """`first_inputs` of the block replay for a streamed source: the inputs of each tower's first block for each
    list of batches, running whatever blocks come before it from disk; the trunk (embeddings, head: a large share
    of a small model) is in memory only for this: the blocks take the hidden states from here on."""

    def first_inputs(towers: dict, batch_lists: list[list[dict]]) -> list[dict]:
        materialize_trunk(source.model, source.reader, source.names, source.dtype, source.storage, source.device)
        try:
            with blocks_on_demand(source.model, source.reader, source.names, source.dtype, source.storage,
                                  source.device):
                return [first_block_inputs(source.model, towers, batches, device=source.device)
                        for batches in batch_lists]
        finally:
            release(source.model)
            source.reader.close()

    return first_inputs


def stream_convert(source: StreamSource, cfg: ConvertConfig, directory: Path, groups: list[ReplayGroup],
                   build_layer: LayerBuilder, *, layout_of, max_shard_bytes: int, export=None, progress: bool = True,
                   desc: str = "upcycling blocks") -> tuple[BlockwiseResult, list[Target], nn.Module]:
    """Convert block by block into `directory`: the upcycle layout (the model's own tensor names), or with
    `export` (a `StockClass`) the stock class's layout. `groups` are replayed through the blocks and
    `build_layer` makes each target's layer (`blockwise.py`). Returns the per-layer results, the targets and
    the planned (weightless) MoE model."""
    from ..export.layout import export_specs, export_state_dict

    model, reader, names, dtype = source.model, source.reader, source.names, source.dtype
    family = family_of(model.config)
    targets = plan_targets(model, cfg.placement)
    planned, _ = planned_model(model.config, cfg.moe, cfg.placement, layout_of, dtype=DTYPES[cfg.dtype])
    specs = tensor_specs(planned) if export is None else export_specs(planned, export)
    planned_dtype = {name: dt for name, _, dt in specs}
    block_paths = [v.path for v in visits(model, family, targets, replay=any(g.batches for g in groups))]
    # the disk writes one block while the next is computed: at most one block's tensors wait in the queue
    writer = ShardedWriter(directory, specs, max_shard_bytes=max_shard_bytes,
                           max_pending_bytes=write_queue_bytes(largest_block_bytes(specs, block_paths)))

    def write(name: str, tensor: torch.Tensor) -> None:
        writer.write(name, tensor.to(planned_dtype[name]))

    def before_block(path: str, block: nn.Module) -> None:
        materialize(block, path + ".", reader, names, dtype, source.storage, source.device)

    def after_block(visit: BlockVisit, block: nn.Module, built) -> None:
        prefix = visit.path + "."
        if built is not None:
            family.install(block, built)
        if visit.needs_compute:
            tensors = (((prefix + n, t) for n, t in block.state_dict().items()) if export is None else
                       export_state_dict(model, export, prefix, copy=False)[0].items())
            for name, tensor in tensors:
                write(name, tensor)
            release(block)
            reader.close()      # unmaps the files: pages read for this block leave the process
            trim_heap()         # and the block's freed tensors leave the heap (heap.py)
            return
        if export is not None:          # the stock layout renames and adds tensors: through the block itself
            materialize(block, prefix, reader, names, dtype, source.storage, source.device)
            for name, tensor in export_state_dict(model, export, prefix, copy=False)[0].items():
                write(name, tensor)
            release(block)
            reader.close()
            return
        for name in (n for n in planned_dtype if n.startswith(prefix)):   # a block nothing runs: copied
            write(name, reader.get(names[name]))
        reader.close()

    try:
        result = convert_blocks(model, family, targets, groups, build_layer, before_block=before_block,
                                after_block=after_block, first_inputs=source_first_inputs(source), progress=progress,
                                desc=desc)
        for name in planned_dtype:
            if not any(name.startswith(p + ".") for p in block_paths):
                write(name, reader.get(names[name]))
        writer.close()
    except BaseException:
        writer.abort()
        raise
    return result, targets, planned


@contextlib.contextmanager
def _reordered(model: nn.Module, paths: list[str]):
    """While active, each block at `paths` computes its FFN with `ReorderedFFN` (after its weights are read)."""
    family = family_of(model.config)
    handles = []
    for path in paths:
        block = model.get_submodule(path)
        tower = next(t for t in family.towers_of(model.config).values() if t.layers in path)
        from ..core.architectures import tower_config

        tcfg = tower_config(model.config, tower)

        def swap(module, args, kwargs, tcfg=tcfg):
            module._upcycle_saved = {m: dict(m._modules) for m in module.modules()}
            family.install(module, ReorderedFFN(family.extract(module, tcfg)))

        def restore(module, args, kwargs, output):
            for m, children in module._upcycle_saved.items():
                m._modules.clear()
                m._modules.update(children)
            del module._upcycle_saved

        # registered after blocks_on_demand's hooks: runs after the read, and before the release
        handles += [block.register_forward_pre_hook(swap, with_kwargs=True),
                    block.register_forward_hook(restore, with_kwargs=True, prepend=True)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _end_to_end_wanted(setting, output_bytes: int) -> bool:
    """check.end_to_end: true/false as given; auto when the output would fit in the memory available now."""
    if setting != "auto":
        return bool(setting)
    import psutil

    return output_bytes <= psutil.virtual_memory().available


def convert_streaming(source: StreamSource, cfg: ConvertConfig, method: Method, args: dict, directory: Path, *,
                      promised: bool, tokenizer, probe: Probe, calibration: list[dict] | None,
                      calibration_source: str | None, progress: bool = True) -> tuple[Converted, dict]:
    """The streaming conversion into `directory` (an atomic temporary folder): configs and shards, with `export:
    hf` in the stock class's layout (the end-to-end check then loads that checkpoint with plain transformers).
    Returns what it measured and what it wrote (the report's `export`)."""
    from ..checkpoint.skeleton import output_bytes
    from ..checkpoint.upcycle_format import moe_spec, save_configs
    from ..checkpoint.writer import parse_size
    from ..export.layout import choose_export
    from .preservation import count_parameters

    if method.needs_calibration and not calibration:
        raise UpcycleError(f"method {method.name!r} needs calibration data: pass --calibration FILE")
    timings = Timings()
    layout_of = layout_function(method, args)
    targets = plan_targets(source.model, cfg.placement)
    planned, _ = planned_model(source.model.config, cfg.moe, cfg.placement, layout_of, dtype=DTYPES[cfg.dtype])
    end_to_end = _end_to_end_wanted(cfg.check.end_to_end, output_bytes(tensor_specs(planned)))
    dense_out = noise = None
    if end_to_end:
        t = time.perf_counter()
        dense_out = lazy_probe_output(source, probe)
        timings.dense_probe = time.perf_counter() - t
        if promised:
            t = time.perf_counter()
            reordered = lazy_probe_output(source, probe, around=lambda m: _reordered(m, [t_.path for t_ in targets]))
            noise = (dense_out.values_NC - reordered.values_NC).abs().max().item()
            timings.rounding_noise = time.perf_counter() - t
    before = count_parameters(source.model)
    stock, why_not = choose_export(planned, cfg)          # decided here, before a tensor is written
    groups = method_groups(cfg, [layer_probe(probe.inputs)] if cfg.check.per_layer else None, calibration)
    builder = MethodLayers(source.model, family_of(source.model.config), method, args, cfg, promised,
                           layer_dtype=DTYPES[cfg.dtype])
    result, targets, planned = stream_convert(source, cfg, directory, groups, builder, layout_of=layout_of,
                                              max_shard_bytes=parse_size(cfg.shard_size), export=stock,
                                              progress=progress)
    if stock is None:
        save_configs(planned, directory, moe_spec(planned), tokenizer)
    else:
        from ..export.layout import write_stock_configs

        write_stock_configs(planned, stock, directory, tokenizer)
    measured = None
    if end_to_end:
        t = time.perf_counter()
        if stock is None:
            # read back in the compute dtype, as the dense model ran: the skeleton in the storage dtype would
            # run its experts in bfloat16 and compare two precisions
            reader_model, _ = planned_model(source.model.config, cfg.moe, cfg.placement, layout_of,
                                            dtype=source.dtype)
            written = StreamSource.open(directory, planned.config, source.dtype, model=reader_model,
                                        device=source.device)
            measured = compare(dense_out, lazy_probe_output(written, probe))
        else:
            measured = compare(dense_out, stock_probe_output(directory, probe, source.dtype,
                                                             family_of(source.model.config).outputs))
        timings.check = time.perf_counter() - t
    steps = result.timings
    timings.calibration, timings.upcycle = steps["calibration"], steps["upcycle"]
    timings.check += steps["check"]
    done = Converted(
        model_class=type(planned).__name__, model_type=planned.config.model_type,
        moe_layers=[t.name for t in targets], before=before, after=count_parameters(planned), layers=result.layers,
        promised=promised, measured=measured, noise=noise, compute_dtype=source.dtype, probe=probe, timings=timings,
        calibration=None if not calibration else CalibrationSummary(
            calibration_source, len(calibration), real_tokens(calibration), cfg.calibration.tokens),
        streamed=True)
    return done, _written(directory, planned, stock, why_not, end_to_end)


def _written(directory: Path, planned: nn.Module, stock: StockClass | None, why_not: str | None,
             end_to_end: bool) -> dict:
    files = sorted(p.name for p in directory.glob("*.safetensors"))
    if stock is None:
        return {"format": "upcycle", "streamed": True, "files": files} | ({"why_not_hf": why_not} if why_not else {})
    import json

    from ..export.layout import folded_scales

    config = json.loads((directory / "config.json").read_text())
    return {"format": "hf", "class": stock.architecture, "model_type": stock.model_type,
            "folded_scales": folded_scales(planned, stock), "dense_layers": config.get("mlp_only_layers", []),
            "streamed": True, "files": files, "checked_against": "the dense model" if end_to_end else None}


def stream_source(cfg: ConvertConfig, path: str, config) -> StreamSource | None:
    """The checkpoint opened for streaming, or None when the in-memory path runs (streaming: false; a hub id; a
    folder without safetensors; names that do not match)."""
    if cfg.streaming is False:
        return None
    why = None
    if not Path(path).is_dir():
        why = f"{cfg.model} is not a local folder"
    elif cfg.export == "hf" and cfg.streaming == "auto":
        # in memory, the export is checked against the upcycled model itself; streamed (streaming: true), against
        # the dense model, since the upcycled model is never whole
        return None
    else:
        try:
            return StreamSource.open(path, config, COMPUTE_DTYPE, storage=DTYPES[cfg.dtype],
                                     device=resolve_device(cfg.device))
        except NotStreamable as e:
            why = str(e)
    if cfg.streaming is True:
        raise UpcycleError(f"streaming: true, but the conversion cannot stream: {why}")
    return None

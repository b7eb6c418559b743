"""Streaming conversion: a dense checkpoint on disk to an upcycled checkpoint on disk, one block in memory.

mergekit streams checkpoints the same way, without data-aware methods or a check. The dense model is built
without weights (`checkpoint/skeleton.py`); its trunk (embeddings, norms, head) is read when the replayed
batches must run through it; each block is read when its turn comes in the block-by-block conversion
(`blockwise.py`), converted, written into the output's shards at their planned offsets
(`checkpoint/writer.ShardedWriter`) and released. A block after the last one that has to run is copied tensor by tensor.
Memory: the trunk, one dense block and its MoE layer, the method's working set for that layer, and (for
data-aware methods) the calibration batches' hidden states at one depth; never the whole model or output.

Dtypes: `dtype` is what the output stores; the blocks are read, replayed, converted and checked in float32
(`plan.COMPUTE_DTYPE`), the MoE layer cast to the storage dtype as it is written. Methods do their linear algebra in
float32 anyway, and on a CPU bfloat16 matmuls are an order of magnitude slower than float32 ones (the
calibration replay of a 2B model in bfloat16 would take hours). The in-memory path computes in `dtype`; both
write the same bytes for copy, noise, drop, drop_svd, spri and granular (their float32 results are rounded once,
to the storage dtype); data-aware methods see float32 activations here.

The end-to-end check (`probe.lazy_probe_output`) runs a whole model the same way, one block at a time from disk, so
it is possible at any size; it costs another read of the dense checkpoint and of the output.

`StreamedBlocks` is the block source (`orchestrator.BlockSource`) that reads, writes and releases blocks;
`StreamedSource` converts one checkpoint with it, and `merge.MergedSource` several.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ..checkpoint.heap import HeapTrimmer
from ..checkpoint.lazy import blocks_on_demand, materialize, materialize_trunk, release
from ..checkpoint.loading import DTYPES
from ..checkpoint.skeleton import bytes_by_block, tensor_specs
from ..checkpoint.streamed import StreamSource
from ..checkpoint.writer import ShardedWriter
from ..core.architectures import family_of
from ..core.moe import MoELayer
from ..core.surgery import Target
from ..export.protocol import StockClass, export_entry
from ..probe import Probe, ProbeOutput, lazy_probe_output, stock_probe_output
from .blockwise import (
    BlockVisit,
    MethodLayers,
    ReplayGroup,
    probe_and_calibration,
    visits,
)
from .calibration import first_block_inputs
from .inputs import ConversionInputs
from .orchestrator import BlockSource
from .plan import ConversionPlan
from .planned import planned_model
from .preservation import ReorderedFFN

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


class StreamedBlocks(BlockSource):
    """The blocks of a checkpoint on disk (`source`), written block by block into `directory`: each block read
    when its turn comes, its layer installed, written into the planned shards (the upcycle layout, or with
    `export` a `StockClass`'s) and released; a block nothing runs is copied tensor by tensor. The one-model
    (`StreamedSource`) and several-source (`merge.MergedSource`) conversions say what is replayed and built."""

    streamed = True

    def __init__(self, source: StreamSource, plan: ConversionPlan, directory: Path) -> None:
        from ..export.layout import export_specs

        self.source, self.plan, self.directory, self.export = source, plan, directory, plan.stock
        self.model, self.compute_dtype, self.planned = source.model, source.dtype, plan.planned
        specs = tensor_specs(self.planned) if self.export is None else export_specs(self.planned, self.export)
        self.planned_dtype = {name: dt for name, _, dt in specs}
        self.block_paths = [v.path for v in visits(self.model, self.family, plan.targets, replay=False)]
        # the disk writes one block while the next is computed: at most one block's tensors wait in the queue
        self.writer = ShardedWriter(directory, specs, max_shard_bytes=plan.shard_bytes,
                                    max_pending_bytes=write_queue_bytes(largest_block_bytes(specs, self.block_paths)))
        self.first_inputs = source_first_inputs(source)
        self.trim_heap = HeapTrimmer()

    def dense_output(self, probe: Probe) -> ProbeOutput | None:
        return None         # the blocks are on disk: a subclass that checks reads them again (StreamedSource)

    def _write(self, name: str, tensor: torch.Tensor) -> None:
        self.writer.write(name, tensor.to(self.planned_dtype[name]))

    def _read(self, block: nn.Module, prefix: str) -> None:
        s = self.source
        materialize(block, prefix, s.reader, s.names, s.dtype, s.storage, s.device)

    def before_block(self, path: str, block: nn.Module) -> None:
        self._read(block, path + ".")

    def block_ready(self, visit: BlockVisit, block: nn.Module) -> None:
        """Called with each block in memory, its layer installed, before it is written and released (a block
        copied tensor by tensor, in our layout, never is): a merge's probe runs through it here."""

    def after_block(self, visit: BlockVisit, block: nn.Module, layer: MoELayer | None) -> None:
        from ..export.layout import export_state_dict

        prefix, reader, export = visit.path + ".", self.source.reader, self.export
        if layer is not None:
            self.family.install(block, layer)
        if visit.needs_compute:
            self.block_ready(visit, block)
            tensors = (((prefix + n, t) for n, t in block.state_dict().items()) if export is None else
                       export_state_dict(self.model, export, prefix, copy=False)[0].items())
            for name, tensor in tensors:
                self._write(name, tensor)
            release(block)
            reader.close()      # unmaps the files: pages read for this block leave the process
            self.trim_heap()    # and the block's freed tensors leave the heap (heap.py)
            return
        if export is not None:          # the stock layout renames and adds tensors: through the block itself
            self._read(block, prefix)
            self.block_ready(visit, block)
            for name, tensor in export_state_dict(self.model, export, prefix, copy=False)[0].items():
                self._write(name, tensor)
            release(block)
            reader.close()
            return
        for name in (n for n in self.planned_dtype if n.startswith(prefix)):   # a block nothing runs: copied
            self._write(name, reader.get(self.source.names[name]))
        reader.close()

    def finish(self, probe: Probe) -> nn.Module:
        """The tensors outside the blocks written, the shards closed; the planned (weightless) MoE model."""
        for name in self.planned_dtype:
            if not any(name.startswith(p + ".") for p in self.block_paths):
                self._write(name, self.source.reader.get(self.source.names[name]))
        self.writer.close()
        return self.planned

    def abort(self) -> None:
        self.writer.abort()


class StreamedSource(StreamedBlocks):
    """One dense checkpoint converted from disk to disk with an initialization method (the module docstring);
    with `check.end_to_end`, the probe runs through the dense checkpoint and then the written one, a block at a
    time from disk."""

    def __init__(self, plan: ConversionPlan, inputs: ConversionInputs, directory: Path) -> None:
        from ..checkpoint.skeleton import output_bytes

        planned = plan.planned
        self.end_to_end = _end_to_end_wanted(plan.check.end_to_end, output_bytes(tensor_specs(planned)))
        self.stock, self.why_not = plan.stock, plan.why_not_stock       # the plan's: before a tensor is written
        super().__init__(plan.stream, plan, directory)
        self.inputs = inputs

    def dense_output(self, probe: Probe) -> ProbeOutput | None:
        return lazy_probe_output(self.source, probe) if self.end_to_end else None

    def rounding_noise(self, probe: Probe, dense: ProbeOutput, targets: list[Target]) -> float:
        paths = [t.path for t in targets]
        reordered = lazy_probe_output(self.source, probe, around=lambda m: _reordered(m, paths))
        return (dense.values_NC - reordered.values_NC).abs().max().item()

    def replay_groups(self, probe: Probe) -> list[ReplayGroup]:
        return probe_and_calibration(self.plan, probe.inputs, self.inputs.calibration)

    def layer_builder(self) -> MethodLayers:
        return MethodLayers(self.model, self.family, self.plan, self.inputs, layer_dtype=DTYPES[self.plan.dtype])

    def finish(self, probe: Probe) -> nn.Module:
        from ..export.layout import write_configs

        planned = super().finish(probe)
        write_configs(planned, self.stock, self.directory, self.inputs.tokenizer)
        return planned

    def upcycled_output(self, probe: Probe) -> ProbeOutput:
        if self.stock is not None:
            return stock_probe_output(self.directory, probe, self.source.dtype, self.family.outputs)
        # read back in the compute dtype, as the dense model ran: the skeleton in the storage dtype would run its
        # experts in bfloat16 and compare two precisions
        plan, source = self.plan, self.source
        reader_model, _ = planned_model(self.model.config, plan.moe, plan.placement, plan.layout_of, dtype=source.dtype)
        written = StreamSource.open(self.directory, self.planned.config, source.dtype, model=reader_model,
                                    device=source.device)
        return lazy_probe_output(written, probe)

    def written(self) -> dict:
        """What was written, for the report's `export`."""
        return _written(self.directory, self.planned, self.stock, self.why_not, self.end_to_end)


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


def _written(directory: Path, planned: nn.Module, stock: StockClass | None, why_not: str | None,
             end_to_end: bool) -> dict:
    files = sorted(p.name for p in directory.glob("*.safetensors"))
    if stock is None:
        return export_entry(None, why_not, streamed=True, files=files)
    from ..export.layout import folded_scales, runtimes_note
    from ..files import read_json_file

    config = read_json_file(directory / "config.json", "written config")
    return export_entry(stock, folded_scales=folded_scales(planned, stock),
                        dense_layers=config.get("mlp_only_layers", []), streamed=True, files=files,
                        checked_against="the dense model" if end_to_end else None,
                        runtimes_note=runtimes_note(planned, stock))

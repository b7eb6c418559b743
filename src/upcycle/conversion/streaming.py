"""Streaming conversion: a dense checkpoint on disk to an upcycled checkpoint on disk, one block in memory.

Issue 13, item 1 (mergekit streams checkpoints the same way, without data-aware methods or a check). The dense
model is built without weights (`skeleton.py`); its trunk (embeddings, norms, head) is read when the probe or
calibration batches must run through it; each block is read when its turn comes in the block-by-block
conversion (`blockwise.py`), converted, written into the output's shards at their planned offsets
(`shards.ShardedWriter`) and released. A block after the last one that has to run is copied tensor by tensor.
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
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..config import ConvertConfig
from ..core.architectures import family_of
from ..core.surgery import Target, plan_targets
from ..errors import UpcycleError
from ..methods import Method
from .blockwise import BlockVisit, BlockwiseResult, convert_blocks, visits
from .calibration import _first_block_inputs
from .heap import trim_heap
from .layer_check import layer_probe
from .lazy import blocks_on_demand, checkpoint_names, materialize, materialize_trunk, release
from .loading import DTYPES
from .preservation import Probe, ProbeOutput, ReorderedFFN, probe_output
from .shards import CheckpointReader, NoWeights, ShardedWriter
from .skeleton import bytes_by_block, empty_model, layout_function, planned_model, tensor_specs

COMPUTE_DTYPE = torch.float32
# Bytes the background writer may hold queued: half the largest block's output (the next block's reading and
# replay overlap the end of this one's writing; a whole block queued put the 2B benchmark 26 MB over its memory
# target of 1.5 GB + 2 x the largest layer), at least 64 MiB, at most 2 GiB (a 70B model's MoE block is 11 GB:
# the disk then catches up between blocks rather than holding a second block in memory).
WRITE_QUEUE_FLOOR, WRITE_QUEUE_CAP = 64 * 2**20, 2 * 2**30


def write_queue_bytes(largest_block: int) -> int:
    return min(WRITE_QUEUE_CAP, max(WRITE_QUEUE_FLOOR, largest_block // 2))


def largest_block_bytes(specs: list[tuple[str, tuple[int, ...], torch.dtype]], block_paths: list[str]) -> int:
    """Bytes of the largest block in the output (the MoE blocks, for an upcycled model)."""
    return max(bytes_by_block(specs, block_paths).values(), default=0)


class NotStreamable(UpcycleError):
    """The checkpoint cannot be read tensor by tensor (no safetensors, or names the model does not have)."""


def check_shapes(model: nn.Module, reader: CheckpointReader, names: dict[str, str], path) -> None:
    """Refuse a checkpoint whose tensors do not fit the model its config.json describes (a wrong intermediate
    size, a hidden size that does not match), or that holds tensors the model has no place for (more blocks than
    the config says), before any tensor is read."""
    shapes = {name: tuple(t.shape) for name, t in model.state_dict(keep_vars=True).items()}
    wrong = [f"{key} is {list(reader.shape(key))} in the checkpoint, {list(shapes[name])} in the model"
             for name, key in names.items() if reader.shape(key) != shapes[name]]
    if wrong:
        raise UpcycleError(f"{path}: the checkpoint does not fit its config.json ({len(wrong)} tensor(s): "
                           f"{'; '.join(wrong[:3])})")
    # not extra: what transformers itself drops on load, and buffers the model computes rather than stores (BERT's
    # position_ids and rotary frequencies, which older checkpoints stored)
    ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]
    computed = {name.rsplit(".", 1)[-1] for name, _ in model.named_buffers()}
    extra = sorted(n for n in set(reader.names()) - set(names.values())
                   if not any(p.search(n) for p in ignored) and n.rsplit(".", 1)[-1] not in computed)
    if extra:
        raise UpcycleError(f"{path}: the checkpoint holds {len(extra)} tensor(s) its config.json has no place for "
                           f"(e.g. {', '.join(extra[:3])}); the weights and config.json must describe one model")


@dataclass
class StreamSource:
    """A dense checkpoint opened for streaming: its reader, the weightless model and the name map."""

    reader: CheckpointReader
    model: nn.Module
    names: dict[str, str]
    dtype: torch.dtype                      # the compute dtype
    storage: torch.dtype | None = None      # weights are rounded to it as they are read (the output's dtype)
    device: torch.device | None = None      # where blocks are read to and computed (None: the CPU)

    @classmethod
    def open(cls, path: str | Path, config, dtype: torch.dtype, *, model: nn.Module | None = None,
             storage: torch.dtype | None = None, device: torch.device | None = None) -> StreamSource:
        """`model`: the weightless model to read into (default: the dense model of `config`)."""
        try:
            reader = CheckpointReader(path)
        except NoWeights as e:       # damaged weights are an error here; only their absence means "load whole"
            raise NotStreamable(str(e)) from None
        try:
            model = model if model is not None else empty_model(config, dtype)
        except UpcycleError:
            raise
        except Exception as e:      # a config that builds no model (an unknown activation, a bad size)
            raise UpcycleError(f"{path}: config.json does not build a {config.model_type} model "
                               f"({type(e).__name__}: {' '.join(str(e).split())[:300]})") from None
        names, missing = checkpoint_names(model, reader)
        if missing:
            raise NotStreamable(f"{path}: the checkpoint's tensor names do not match {type(model).__name__}'s "
                                f"({len(missing)} not found, e.g. {missing[:3]})")
        check_shapes(model, reader, names, path)
        return cls(reader, model, names, dtype, storage, device)

    def first_inputs(self, towers: dict, batches: list[dict]) -> dict:
        """The inputs of each tower's first block, running whatever blocks come before it from disk."""
        with blocks_on_demand(self.model, self.reader, self.names, self.dtype, self.storage,
                              self.device):
            return _first_block_inputs(self.model, towers, batches, device=self.device)


def stream_convert(source: StreamSource, cfg: ConvertConfig, method: Method, args: dict, directory: Path, *,
                   layout_of, promised: bool, probe: Probe | None, calibration: list[dict] | None,
                   max_shard_bytes: int, export=None, progress: bool = True
                   ) -> tuple[BlockwiseResult, list[Target], nn.Module]:
    """Convert block by block into `directory`: the upcycle layout (the model's own tensor names), or with
    `export` (an `export.Target`) the stock class's layout. Returns the per-layer results, the targets and the
    planned (weightless) MoE model."""
    from .export import export_specs, export_state_dict

    model, reader, names, dtype = source.model, source.reader, source.names, source.dtype
    family = family_of(model.config)
    targets = plan_targets(model, cfg.placement)
    planned, _ = planned_model(model.config, cfg.moe, cfg.placement, layout_of, dtype=DTYPES[cfg.dtype])
    specs = tensor_specs(planned) if export is None else export_specs(planned, export)
    planned_dtype = {name: dt for name, _, dt in specs}
    probe_batches = [layer_probe(probe.inputs)] if probe is not None and cfg.check.per_layer else None
    replay = bool(probe_batches or calibration)
    block_paths = [v.path for v in visits(model, family, targets, replay=replay)]
    # the disk writes one block while the next is computed: at most one block's tensors wait in the queue
    writer = ShardedWriter(directory, specs, max_shard_bytes=max_shard_bytes,
                           max_pending_bytes=write_queue_bytes(largest_block_bytes(specs, block_paths)))

    def write(name: str, tensor: torch.Tensor) -> None:
        writer.write(name, tensor.to(planned_dtype[name]))

    def first_inputs(towers: dict, batches: list[dict]) -> dict:
        # the trunk (embeddings, head: a large share of a small model) is in memory only for this: the blocks
        # take the hidden states from here on
        materialize_trunk(model, reader, names, dtype, source.storage, source.device)
        try:
            return source.first_inputs(towers, batches)
        finally:
            release(model)
            reader.close()

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
        result = convert_blocks(model, family, targets, method, args, cfg, promised=promised,
                                probe_batches=probe_batches, calibration=calibration, before_block=before_block,
                                after_block=after_block, first_inputs=first_inputs,
                                layer_dtype=DTYPES[cfg.dtype], progress=progress)
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


@torch.no_grad()
def lazy_probe_output(source: StreamSource, probe: Probe, reordered: list[str] | None = None) -> ProbeOutput:
    """The probe through the whole model, each block read from disk for its forward and released after it;
    with `reordered`, those blocks' FFNs summed in another order (the rounding-noise run)."""
    model = source.model
    materialize_trunk(model, source.reader, source.names, source.dtype, source.storage, source.device)
    with blocks_on_demand(model, source.reader, source.names, source.dtype, source.storage, source.device), \
            (_reordered(model, reordered) if reordered else contextlib.nullcontext()):
        return probe_output(model, probe)


def _end_to_end_wanted(setting, output_bytes: int) -> bool:
    """check.end_to_end: true/false as given; auto when the output would fit in the memory available now."""
    if setting != "auto":
        return bool(setting)
    import psutil

    return output_bytes <= psutil.virtual_memory().available


def convert_streaming(source: StreamSource, cfg: ConvertConfig, method: Method, args: dict, directory: Path, *,
                      tokenizer, probe: Probe, calibration: list[dict] | None, promised: bool,
                      progress: bool = True) -> dict:
    """The streaming conversion into `directory` (an atomic temporary folder): configs, shards, and what the
    report needs (the converter assembles it). With `export: hf` the shards are in the stock class's layout and
    the end-to-end check loads that checkpoint with plain transformers."""
    from .io import moe_spec, save_configs
    from .preservation import compare, count_parameters
    from .shards import parse_size
    from .skeleton import output_bytes

    timings = {"dense_probe": 0.0, "rounding_noise": 0.0}
    layout_of = layout_function(method, args)
    targets = plan_targets(source.model, cfg.placement)
    planned, _ = planned_model(source.model.config, cfg.moe, cfg.placement, layout_of, dtype=DTYPES[cfg.dtype])
    end_to_end = _end_to_end_wanted(cfg.check.end_to_end, output_bytes(tensor_specs(planned)))
    dense_out = noise = None
    if end_to_end:
        t = time.perf_counter()
        dense_out = lazy_probe_output(source, probe)
        timings["dense_probe"] = time.perf_counter() - t
        if promised:
            t = time.perf_counter()
            reordered = lazy_probe_output(source, probe, reordered=[t_.path for t_ in targets])
            noise = (dense_out.values_NC - reordered.values_NC).abs().max().item()
            timings["rounding_noise"] = time.perf_counter() - t
    before = count_parameters(source.model)
    export = why_not_hf = None
    if cfg.export == "hf":
        from tqdm.auto import tqdm

        from .export import export_target

        try:
            export = export_target(planned, cfg.export_class)      # decided here, before a tensor is written
        except UpcycleError as e:
            if cfg.export_class != "auto":
                raise                      # a class the user named that does not fit is an error
            why_not_hf = str(e)
            tqdm.write(f"[upcycle] not exported to a stock class: {e}")
    result, targets, planned = stream_convert(source, cfg, method, args, directory, layout_of=layout_of,
                                              promised=promised, probe=probe, calibration=calibration,
                                              max_shard_bytes=parse_size(cfg.shard_size), export=export,
                                              progress=progress)
    if export is None:
        save_configs(planned, directory, moe_spec(planned), tokenizer)
    else:
        from .export import write_stock_configs

        write_stock_configs(planned, export, directory, tokenizer)
    measured = None
    if end_to_end:
        t = time.perf_counter()
        if export is None:
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
        timings["end_to_end_check"] = time.perf_counter() - t
    return {"result": result, "targets": targets, "before": before, "after": count_parameters(planned),
            "planned": planned, "measured": measured, "noise": noise, "timings": timings, "export": export,
            "why_not_hf": why_not_hf}


@torch.no_grad()
def stock_probe_output(directory: Path, probe: Probe, dtype: torch.dtype, outputs: tuple) -> ProbeOutput:
    """The probe through the written stock checkpoint, loaded whole with plain transformers (only run when
    the output fits in memory: check.end_to_end)."""
    from transformers import AutoModelForCausalLM

    stock = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, trust_remote_code=False).eval()
    return probe_output(stock, probe, outputs)

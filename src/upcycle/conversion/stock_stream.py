"""An upcycle folder rewritten as a stock transformers MoE checkpoint one block at a time, and checked against
it (issue 16, item 3: the multi-source merge's `export: hf`).

`export.export_folder` loads the whole upcycled model; this reads the folder a block at a time into the planned
(weightless) model, writes the stock class's tensors of that block (`export.export_state_dict` with the block's
prefix) into planned shards (`shards.ShardedWriter`) and releases it, so memory holds one block. The check runs
the probe through our folder (again a block at a time, `streaming.lazy_probe_output`) and through the stock
checkpoint loaded with plain transformers, both in float32 from the same stored weights, and refuses an export
whose logits differ by more than `check.export_tolerance`. Loading the stock model whole needs its size in
memory; when that is not available the check is skipped and the report says so.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..errors import UpcycleError
from .export import Target, export_specs, export_state_dict, write_stock_configs
from .lazy import block_paths, materialize, release
from .preservation import Probe, compare
from .shards import ShardedWriter
from .skeleton import output_bytes, tensor_specs
from .streaming import COMPUTE_DTYPE, StreamSource, lazy_probe_output, stock_probe_output


def export_streamed(folder: Path, directory: Path, planned: nn.Module, target: Target, *, tokenizer=None,
                    max_shard_bytes: int) -> dict:
    """Write the stock checkpoint of the upcycle folder `folder` (whose weightless model is `planned`, in the
    storage dtype) into `directory`; returns the stock config."""
    source = StreamSource.open(folder, planned.config, next(planned.parameters()).dtype, model=planned)
    reader, names, dtype = source.reader, source.names, source.dtype
    specs = export_specs(planned, target)
    planned_dtype = {name: dt for name, _, dt in specs}
    blocks = block_paths(planned)
    writer = ShardedWriter(directory, specs, max_shard_bytes=max_shard_bytes)
    try:
        for path in blocks:
            block = planned.get_submodule(path)
            materialize(block, path + ".", reader, names, dtype)
            for name, tensor in export_state_dict(planned, target, path + ".", copy=False)[0].items():
                writer.write(name, tensor.to(planned_dtype[name]))
            release(block)
            reader.close()
        for name in planned_dtype:
            if not any(name.startswith(p + ".") for p in blocks):
                writer.write(name, reader.get(names[name]).to(planned_dtype[name]))
        writer.close()
    except BaseException:
        writer.abort()
        raise
    return write_stock_configs(planned, target, directory, tokenizer)


def check_export(folder: Path, directory: Path, reader_model: nn.Module, probe: Probe, tolerance: float,
                 outputs: tuple) -> dict:
    """Max |logit difference| between our folder and its stock export on the probe (module docstring);
    `reader_model`: the weightless upcycled model in float32. Refuses a difference above `tolerance`."""
    import psutil

    size = output_bytes(tensor_specs(reader_model))
    if size > psutil.virtual_memory().available:
        return {"checked": False, "why_not": f"the stock model ({size / 2**30:.1f} GiB in float32) does not fit "
                                             f"in the memory available"}
    ours = lazy_probe_output(StreamSource.open(folder, reader_model.config, COMPUTE_DTYPE, model=reader_model),
                             probe)
    theirs = stock_probe_output(directory, probe, torch.float32, outputs)
    measured = compare(ours, theirs)
    diff = measured["max_abs_logit_diff"]
    if not diff <= tolerance:
        raise UpcycleError(f"the stock export's logits differ from ours by {diff:.3g} (> check.export_tolerance "
                           f"{tolerance:g}); nothing was written")
    return {"checked": True, "max_abs_logit_diff": diff, "tolerance": tolerance}

"""Writing a stock transformers MoE checkpoint and checking it against the upcycled model it came from.

The layout (which class, its config, its tensors) is `layout.py`'s; here it is written and checked:
  - `export_hf`: a model in memory, written with its stock config, loaded back with plain transformers and its
    logits compared with ours on a probe (`check.export_tolerance`);
  - `export_streamed` + `check_export`: an upcycle folder rewritten as the stock class one block at a time (the
    several-source merge's `export: hf`), then the probe run through our folder (a block at a time) and through the
    stock checkpoint loaded whole, which is skipped, and said so, when that does not fit in memory.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from ..checkpoint.lazy import block_paths, materialize, release
from ..checkpoint.skeleton import output_bytes, tensor_specs
from ..checkpoint.streamed import StreamSource
from ..checkpoint.writer import ShardedWriter
from ..core.modes import eval_mode
from ..errors import UpcycleError
from ..probe import Probe, compare, input_device, lazy_probe_output, stock_probe_output
from .layout import export_specs, export_state_dict, export_target, write_stock_configs
from .protocol import StockClass


def export_hf(model: nn.Module, directory: str | Path, *, input_ids: torch.Tensor, tolerance: float,
              export_class: str = "auto", tokenizer=None) -> dict:
    """Write the stock checkpoint into an existing (temporary) directory, load it back with plain
    transformers and compare its logits with `model`'s on `input_ids`; return what was done."""

    directory = Path(directory)
    target = export_target(model, export_class)
    config = write_stock_configs(model, target, directory, tokenizer)
    tensors, folded = export_state_dict(model, target)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    diff = compare_with_stock(model, directory, input_ids)
    if diff > tolerance:
        raise UpcycleError(f"the exported {target.architecture} differs from the upcycled model by {diff:.3g} "
                           f"> tolerance {tolerance:g}; nothing was written")
    return {"format": "hf", "class": target.architecture, "model_type": target.model_type,
            "folded_scales": folded, "dense_layers": config.get("mlp_only_layers", []),
            "max_abs_logit_diff_vs_upcycle": diff}


@torch.no_grad()
def compare_with_stock(model: nn.Module, directory: str | Path, input_ids: torch.Tensor) -> float:
    """Load the written folder with plain AutoModelForCausalLM and return max |logit difference| vs `model`."""
    from transformers import AutoModelForCausalLM

    device = input_device(model)          # the GPU with --device cuda: both run there
    stock = AutoModelForCausalLM.from_pretrained(directory, dtype=model.dtype, trust_remote_code=False)
    stock = stock.to(device).eval()
    input_ids = input_ids.to(device)
    with eval_mode(model):
        ours = model(input_ids=input_ids).logits.float()
    return (stock(input_ids=input_ids).logits.float() - ours).abs().max().item()


def export_streamed(folder: Path, directory: Path, planned: nn.Module, target: StockClass, *, tokenizer=None,
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
    ours = lazy_probe_output(StreamSource.open(folder, reader_model.config, torch.float32, model=reader_model),
                             probe)
    theirs = stock_probe_output(directory, probe, torch.float32, outputs)
    measured = compare(ours, theirs)
    diff = measured["max_abs_logit_diff"]
    if not diff <= tolerance:
        raise UpcycleError(f"the stock export's logits differ from ours by {diff:.3g} (> check.export_tolerance "
                           f"{tolerance:g}); nothing was written")
    return {"checked": True, "max_abs_logit_diff": diff, "tolerance": tolerance}

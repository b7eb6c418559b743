"""Writing a stock transformers MoE checkpoint and checking it against the upcycled model it came from.

The layout (which class, its config, its tensors) is `layout.py`'s; here it is written and checked:
  - `export_hf`: a model in memory, written with its stock config, loaded back with plain transformers and its
    logits compared with ours on a probe (`check.export_tolerance`);
  - `check_stock_folder`: a stock checkpoint written block by block (a streamed conversion or merge writes the
    stock layout directly) loaded whole with plain transformers and its outputs on the probe compared with ours,
    taken as the blocks were written; `stock_too_large` says beforehand whether loading it whole fits in memory (the
    check is skipped, and said so, when it does not).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from ..checkpoint.skeleton import output_bytes, tensor_specs
from ..core.modes import eval_mode
from ..errors import UpcycleError
from ..probe import Probe, ProbeOutput, compare, input_device, stock_probe_output
from .layout import export_state_dict, export_target, runtimes_note, write_stock_configs
from .protocol import export_entry


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
    return export_entry(target, folded_scales=folded, dense_layers=config.get("mlp_only_layers", []),
                        max_abs_logit_diff_vs_upcycle=diff, runtimes_note=runtimes_note(model, target))


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


def stock_too_large(planned: nn.Module) -> str | None:
    """Why the stock model of `planned`, loaded whole in float32 for its check, does not fit in the memory
    available now; None when it does."""
    import psutil

    size = output_bytes([(name, shape, torch.float32) for name, shape, _ in tensor_specs(planned)])
    if size > psutil.virtual_memory().available:
        return f"the stock model ({size / 2**30:.1f} GiB in float32) does not fit in the memory available"
    return None


def check_stock_folder(directory: Path, ours: ProbeOutput, probe: Probe, tolerance: float, outputs: tuple) -> dict:
    """Max |logit difference| between our outputs on the probe and the stock checkpoint's in `directory`, loaded
    whole in float32 with plain transformers; a difference above `tolerance` is refused."""
    theirs = stock_probe_output(directory, probe, torch.float32, outputs)
    diff = compare(ours, theirs)["max_abs_logit_diff"]
    if not diff <= tolerance:
        raise UpcycleError(f"the stock export's logits differ from ours by {diff:.3g} (> check.export_tolerance "
                           f"{tolerance:g}); nothing was written")
    return {"checked": True, "max_abs_logit_diff": diff, "tolerance": tolerance}

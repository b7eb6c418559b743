"""The conversion of a dense model held whole in memory: converted in place, checked, then written.

The dense model's outputs on the probe are recorded before any weight changes (and, when the method promises
the dense function, the rounding noise of computing its FFNs in another order); the blocks are converted by
the shared block loop (`blockwise.py`); every MoE layer is installed once all are built, so a method failing on
any layer leaves the model untouched; then the probe runs again and the two outputs are compared
(`preservation.py`). The pipeline (`pipeline.py`) makes the report and writes the folder.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from torch import nn

from ..checkpoint.upcycle_format import save_folder_files
from ..config import ConvertConfig
from ..core.architectures import family_of
from ..core.moe import MoELayer
from ..core.surgery import install, plan_targets, tower_cfg, track_padding_masks
from ..errors import UpcycleError
from ..export.protocol import StockClass
from ..export.stock_folder import export_hf
from ..methods import Method
from ..probe import compare, make_probe, probe_output
from .blockwise import MethodLayers, convert_blocks, method_groups
from .calibration import real_tokens
from .layer_check import layer_probe
from .preservation import count_parameters, rounding_noise
from .report import CalibrationSummary, Converted, Timings


def convert_in_memory(model: nn.Module, cfg: ConvertConfig, method: Method, args: dict, *, promised: bool,
                      tokenizer=None, texts: list[str] | None = None, text_source: str = "held-out text",
                      calibration: list[dict] | None = None, calibration_source: str | None = "batches",
                      progress: bool = True, phase=lambda message: None) -> Converted:
    """Convert `model` in place as `cfg` says (checked: `pipeline.validate`); returns what it measured.
    `calibration`: model-input batches whose FFN inputs data-aware methods use."""
    if cfg.dtype == "auto":          # a model given in memory: it is in the dtype it computes in
        cfg = dataclasses.replace(cfg, dtype=str(next(model.parameters()).dtype).removeprefix("torch."))
    family = family_of(model.config)
    targets = plan_targets(model, cfg.placement)
    if method.needs_calibration and not calibration:
        raise UpcycleError(f"method {method.name!r} needs calibration data: pass --calibration FILE (text, or JSONL "
                           f"with a \"text\" field); on the default model the embedded Wikipedia train split is used")
    timings = Timings()

    t = time.perf_counter()
    before = count_parameters(model)
    probe = make_probe(model, tokenizer, texts, cfg.check, cfg.seed, text_source)
    dense_out = probe_output(model, probe)
    timings.dense_probe = time.perf_counter() - t
    t = time.perf_counter()
    blocks = [(model.get_submodule(target.path), tower_cfg(model, family, target)) for target in targets]
    noise = rounding_noise(model, probe, dense_out, blocks, family) if promised else None
    ffn_dtype = family.extract(*blocks[0]).w_up.dtype      # the conversion dtype, whose rounding the check allows
    timings.rounding_noise = time.perf_counter() - t
    phase("dense outputs recorded")

    t = time.perf_counter()
    built: dict[str, MoELayer] = {}

    def keep(visit, block, layer) -> None:
        if layer is not None:
            built[visit.path] = layer

    groups = method_groups(cfg, [layer_probe(probe.inputs)] if cfg.check.per_layer else None, calibration)
    result = convert_blocks(model, family, targets, groups, MethodLayers(model, family, method, args, cfg, promised),
                            before_block=lambda path, block: None, after_block=keep, progress=progress)
    # Install only once every layer is built: a method failing on any layer leaves the model untouched.
    for path, layer in built.items():
        install(model, path, layer.train(model.training))
    track_padding_masks(model)
    timings.calibration = result.timings["calibration"]
    timings.upcycle = time.perf_counter() - t
    phase(f"{len(targets)} layers upcycled")

    t = time.perf_counter()
    measured = compare(dense_out, probe_output(model, probe))
    timings.check = time.perf_counter() - t
    phase("preservation checked")
    return Converted(
        model_class=type(model).__name__, model_type=model.config.model_type, moe_layers=[t.name for t in targets],
        before=before, after=count_parameters(model), layers=result.layers, promised=promised, measured=measured,
        noise=noise, compute_dtype=ffn_dtype, probe=probe, timings=timings, dtype=cfg.dtype,
        calibration=None if not calibration else CalibrationSummary(
            calibration_source, len(calibration), real_tokens(calibration), cfg.calibration.tokens))


def write_model(model: nn.Module, directory: Path, cfg: ConvertConfig, stock: StockClass | None, why_not: str | None,
                tokenizer, probe_inputs: dict) -> dict:
    """The upcycled model into `directory`: as the stock class `stock` (checked against our model) or in the
    upcycle format. Returns what was written, for the report."""
    if stock is not None:
        return export_hf(model, directory, input_ids=probe_inputs["input_ids"],   # exports are decoders
                         tolerance=cfg.check.export_tolerance, export_class=stock.name, tokenizer=tokenizer)
    save_folder_files(model, directory, tokenizer=tokenizer)
    return {"format": "upcycle"} | ({"why_not_hf": why_not} if why_not else {})

"""The conversion of a dense model held whole in memory: converted in place, checked, then written.

`InMemorySource` is the block source of `orchestrator.run_conversion`: the dense model's outputs on the probe
(and, when the method promises the dense function, the rounding noise of computing its FFNs in another order)
come from the model itself; every MoE layer is installed once all are built, so a method failing on any layer
leaves the model untouched; then the probe runs again through the same model. The pipeline (`pipeline.py`)
makes the report and writes the folder (`write_model`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from torch import nn

from ..checkpoint.upcycle_format import save_folder_files
from ..config import ConvertConfig
from ..core.moe import MoELayer
from ..core.surgery import install, plan_targets, tower_cfg, track_padding_masks
from ..export.protocol import StockClass
from ..export.stock_folder import export_hf
from ..methods import Method
from ..probe import Probe
from .blockwise import BlockVisit, MethodLayers, ReplayGroup, probe_and_calibration
from .orchestrator import BlockSource, run_conversion
from .report import Converted
from .validate import require_calibration


class InMemorySource(BlockSource):
    """A dense model held whole: its blocks replayed by its own forward, each target's layer built from the block's
    FFN (`blockwise.MethodLayers`), and every layer installed once all are built, so a method failing on any
    layer leaves the model untouched."""

    def __init__(self, model: nn.Module, cfg: ConvertConfig, method: Method, args: dict, *, promised: bool,
                 calibration: list[dict] | None) -> None:
        self.model, self.cfg, self.method, self.args = model, cfg, method, args
        self.promised, self.calibration = promised, calibration
        self.built: dict[str, MoELayer] = {}
        first = plan_targets(model, cfg.placement)[0]
        # the conversion dtype, whose rounding the check allows
        self.compute_dtype = self.family.extract(model.get_submodule(first.path),
                                                 tower_cfg(model, self.family, first)).w_up.dtype

    def replay_groups(self, probe: Probe) -> list[ReplayGroup]:
        return probe_and_calibration(self.cfg, probe.inputs, self.calibration)

    def layer_builder(self) -> MethodLayers:
        return MethodLayers(self.model, self.family, self.method, self.args, self.cfg, self.promised)

    def after_block(self, visit: BlockVisit, block: nn.Module, layer: MoELayer | None) -> None:
        if layer is not None:
            self.built[visit.path] = layer

    def finish(self, probe: Probe) -> nn.Module:
        for path, layer in self.built.items():
            install(self.model, path, layer.train(self.model.training))
        track_padding_masks(self.model)
        return self.model


def convert_in_memory(model: nn.Module, cfg: ConvertConfig, method: Method, args: dict, *, promised: bool,
                      tokenizer=None, texts: list[str] | None = None, text_source: str = "held-out text",
                      calibration: list[dict] | None = None, calibration_source: str | None = "batches",
                      progress: bool = True, phase=lambda message: None, load_s: float = 0.0) -> Converted:
    """Convert `model` in place as `cfg` says (checked: `validate.validate`); returns what it measured.
    `calibration`: model-input batches whose FFN inputs data-aware methods use."""
    if cfg.dtype == "auto":          # a model given in memory: it is in the dtype it computes in
        cfg = dataclasses.replace(cfg, dtype=str(next(model.parameters()).dtype).removeprefix("torch."))
    require_calibration(method, calibration)
    source = InMemorySource(model, cfg, method, args, promised=promised, calibration=calibration)
    return run_conversion(source, cfg, promised=promised, tokenizer=tokenizer, texts=texts, text_source=text_source,
                          calibration=calibration, calibration_source=calibration_source, progress=progress,
                          phase=phase, load_s=load_s)


def write_model(model: nn.Module, directory: Path, cfg: ConvertConfig, stock: StockClass | None, why_not: str | None,
                tokenizer, probe_inputs: dict) -> dict:
    """The upcycled model into `directory`: as the stock class `stock` (checked against our model) or in the
    upcycle format. Returns what was written, for the report."""
    if stock is not None:
        return export_hf(model, directory, input_ids=probe_inputs["input_ids"],   # exports are decoders
                         tolerance=cfg.check.export_tolerance, export_class=stock.name, tokenizer=tokenizer)
    save_folder_files(model, directory, tokenizer=tokenizer)
    return {"format": "upcycle"} | ({"why_not_hf": why_not} if why_not else {})

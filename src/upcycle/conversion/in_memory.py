"""The conversion of a dense model held whole in memory: converted in place, checked, then written.

`InMemorySource` is the block source of `orchestrator.run_conversion`: the dense model's outputs on the probe
(and, when the method promises the dense function, the rounding noise of computing its FFNs in another order)
come from the model itself; every MoE layer is installed once all are built, so a method failing on any layer
leaves the model untouched; then the probe runs again through the same model. The pipeline (`pipeline.py`)
makes the report and writes the folder (`write_model`).
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from ..checkpoint.upcycle_format import save_folder_files
from ..core.moe import MoELayer
from ..core.surgery import install, tower_cfg, track_padding_masks
from ..export.protocol import export_entry
from ..export.stock_folder import export_hf
from ..probe import Probe
from .blockwise import BlockVisit, MethodLayers, ReplayGroup, probe_and_calibration
from .inputs import ConversionInputs
from .orchestrator import BlockSource, run_conversion
from .plan import ConversionPlan
from .report import Converted


class InMemorySource(BlockSource):
    """A dense model held whole: its blocks replayed by its own forward, each target's layer built from the block's
    FFN (`blockwise.MethodLayers`), and every layer installed once all are built, so a method failing on any
    layer leaves the model untouched."""

    def __init__(self, model: nn.Module, plan: ConversionPlan, inputs: ConversionInputs) -> None:
        self.model, self.plan, self.inputs = model, plan, inputs
        self.built: dict[str, MoELayer] = {}
        first = plan.targets[0]
        # the conversion dtype, whose rounding the check allows
        self.compute_dtype = self.family.extract(model.get_submodule(first.path),
                                                 tower_cfg(model, self.family, first)).w_up.dtype

    def replay_groups(self, probe: Probe) -> list[ReplayGroup]:
        return probe_and_calibration(self.plan, probe.inputs, self.inputs.calibration)

    def layer_builder(self) -> MethodLayers:
        return MethodLayers(self.model, self.family, self.plan, self.inputs)

    def after_block(self, visit: BlockVisit, block: nn.Module, layer: MoELayer | None) -> None:
        if layer is not None:
            self.built[visit.path] = layer

    def finish(self, probe: Probe) -> nn.Module:
        for path, layer in self.built.items():
            install(self.model, path, layer.train(self.model.training))
        track_padding_masks(self.model)
        return self.model


def convert_in_memory(model: nn.Module, plan: ConversionPlan, inputs: ConversionInputs, *, progress: bool = True,
                      phase=lambda message: None) -> Converted:
    """Convert `model` in place as `plan` says with `inputs`; returns what it measured."""
    return run_conversion(InMemorySource(model, plan, inputs), inputs, progress=progress, phase=phase)


def write_model(model: nn.Module, directory: Path, plan: ConversionPlan, tokenizer, probe_inputs: dict) -> dict:
    """The upcycled model into `directory`: as the plan's stock class (`export.layout.choose_export`), checked
    against our model, or in the upcycle format (the report says why no class fits). Returns the report's
    `export` entry."""
    stock, why_not = plan.stock, plan.why_not_stock
    if stock is not None:
        return export_hf(model, directory, input_ids=probe_inputs["input_ids"],   # exports are decoders
                         tolerance=plan.check.export_tolerance, export_class=stock.name, tokenizer=tokenizer)
    save_folder_files(model, directory, tokenizer=tokenizer)
    return export_entry(None, why_not)

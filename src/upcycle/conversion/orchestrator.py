"""One function runs every conversion (`run_conversion`), whatever its blocks come from.

What the conversions differ in is a `BlockSource`: where the blocks come from (a model in memory, a checkpoint
read block by block, several checkpoints merged), how their inputs are produced (the model's forward, or its
trunk read from disk), what is replayed through them and how a target's layer is built, and where the result goes
(installed in the model, or written into shards). Everything else is here, once:

    parameters of the dense model                       count_parameters
    the probe                                           probe.make_probe (the only place a conversion builds it)
    the dense outputs and, when the method promises
      the dense function, their rounding noise          source.dense_output, source.rounding_noise
    the blocks, replayed and converted                  blockwise.convert_blocks
    the layers installed or the rest written            source.finish
    the upcycled model's outputs, compared              source.upcycled_output, probe.compare
    the timings of every phase and the record           Timings, Converted (made nowhere else)

A fourth source (a model on another machine, a format read some other way) is one subclass of `BlockSource`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..core.architectures import Family, family_of
from ..core.moe import MoELayer
from ..core.surgery import Target, tower_cfg
from ..probe import Probe, ProbeOutput, compare, make_probe, probe_output
from .blockwise import BlockVisit, LayerBuilder, ReplayGroup, convert_blocks
from .calibration import real_tokens
from .inputs import ConversionInputs
from .plan import ConversionPlan
from .preservation import count_parameters, rounding_noise
from .report import CalibrationSummary, Converted, Timings


class BlockSource:
    """Where a conversion's blocks come from and where its result goes. A subclass sets `model` (the dense model
    the blocks are visited in: whole, or a skeleton filled block by block) and `compute_dtype`, and gives the
    replay groups and the layer builder; the rest has defaults for a model held whole, checked end to end."""

    model: nn.Module
    plan: ConversionPlan
    compute_dtype: torch.dtype
    streamed: bool = False
    desc: str = "upcycling blocks"
    records_probe: bool = True        # the record states the probe (a merge checks no dense function: None)
    first_inputs: Callable[[dict, list[list[dict]]], list[dict]] | None = None   # default: the model's forward

    @property
    def family(self) -> Family:
        """The plan's family, decided once; a source without a plan (a test's) looks up its model's."""
        plan = getattr(self, "plan", None)
        return plan.family if plan is not None else family_of(self.model.config)

    def dense_output(self, probe: Probe) -> ProbeOutput | None:
        """The probe through the dense model, before any weight changes; None: no end-to-end check."""
        return probe_output(self.model, probe)

    def rounding_noise(self, probe: Probe, dense: ProbeOutput, targets: list[Target]) -> float:
        """How far the dense outputs move when the targets' FFNs sum in another order (`preservation.py`)."""
        model, family = self.model, self.family
        blocks = [(model.get_submodule(t.path), tower_cfg(model, family, t)) for t in targets]
        return rounding_noise(model, probe, dense, blocks, family)

    def replay_groups(self, probe: Probe) -> list[ReplayGroup]:
        raise NotImplementedError

    def layer_builder(self) -> LayerBuilder:
        raise NotImplementedError

    def before_block(self, path: str, block: nn.Module) -> None:
        """The block's weights made available before it runs (a read from disk)."""

    def after_block(self, visit: BlockVisit, block: nn.Module, layer: MoELayer | None) -> None:
        """The block done: its layer installed, or the block written and released."""

    def finish(self, probe: Probe) -> nn.Module:
        """After the last block: the upcycled model (whole, or weightless when it was written block by block)."""
        return self.model

    def abort(self) -> None:
        """The conversion failed: let go of anything half-written."""

    def upcycled_output(self, probe: Probe) -> ProbeOutput | None:
        """The probe through the upcycled model (asked only when `dense_output` gave one)."""
        return probe_output(self.model, probe)

    def record(self, layers: list) -> dict:
        """What this source adds to the record, given the layers' entries (a merge: its sources and their
        agreement)."""
        return {}


def run_conversion(source: BlockSource, inputs: ConversionInputs, *, progress: bool = True,
                   phase: Callable[[str], None] = lambda message: None) -> Converted:
    """Convert `source`'s model as its plan says (`plan.make_plan`) with what `inputs` holds, and
    return what was measured (its `timings.load` is the caller's to set); on any failure the source lets go of
    what it holds (`abort`) before the error goes on."""
    try:
        return _run(source, inputs, progress, phase)
    except BaseException:
        source.abort()
        raise


def _run(source: BlockSource, inputs: ConversionInputs, progress: bool, phase) -> Converted:
    """`run_conversion`'s steps, in order (the module docstring)."""
    timings, plan = Timings(load=0.0), source.plan
    model, promised, calibration = source.model, inputs.promised, inputs.calibration
    targets = plan.targets
    with timings.phase("dense_probe"):
        before = count_parameters(model)
        probe = make_probe(model, inputs.tokenizer, inputs.texts, plan.check, plan.seed, inputs.text_source)
        dense = source.dense_output(probe)
    with timings.phase("rounding_noise"):
        noise = source.rounding_noise(probe, dense, targets) if promised and dense is not None else None
    phase("dense outputs recorded")
    layers = convert_blocks(source, targets, source.replay_groups(probe), timings, progress=progress)
    with timings.phase("write"):
        upcycled = source.finish(probe)
    phase(f"{len(targets)} layers upcycled")
    with timings.phase("check"):
        out = source.upcycled_output(probe) if dense is not None else None
        measured = compare(dense, out) if out is not None else None
    phase("preservation checked")
    return Converted(
        model_class=type(upcycled).__name__, model_type=upcycled.config.model_type,
        moe_layers=[t.name for t in targets], before=before, after=count_parameters(upcycled), layers=layers,
        promised=promised, measured=measured, noise=noise, compute_dtype=source.compute_dtype,
        probe=probe if source.records_probe else None, timings=timings, dtype=plan.dtype, streamed=source.streamed,
        calibration=None if not calibration else CalibrationSummary(
            inputs.calibration_source, len(calibration), real_tokens(calibration), plan.calibration.tokens),
        **source.record(layers))

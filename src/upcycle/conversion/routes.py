"""The three ways a planned conversion runs (`plan.ConversionPlan.route`), each the same two calls:

    route.run(progress, phases) -> Converted     the conversion, by `orchestrator.run_conversion`
    route.write(report) -> dict                  after the preservation verdict: what is written (or was, while
                                                 the blocks streamed), as the report's `export` entry

  InMemoryRoute   the dense model loaded whole, converted in place (`in_memory.InMemorySource`), then written
                  (the stock class the plan chose, or the upcycle format)
  StreamedRoute   the checkpoint the plan opened, read block by block and written shard by shard
                  (`streaming.StreamedSource`)
  MergedRoute     several fine-tunes of one base, streamed the same way (`merge.MergedSource`)

`directory` is the claimed output's temporary folder, or None (in memory only: nothing is written).
"""

from __future__ import annotations

import time
from pathlib import Path

from torch import nn

from ..checkpoint.loading import dense_weights
from ..core.devices import resolve_device
from .in_memory import convert_in_memory, write_model
from .inputs import ConversionInputs
from .orchestrator import run_conversion
from .plan import IN_MEMORY, MERGED, STREAMED, ConversionPlan
from .report import ConversionReport, Converted


class Route:
    """What every route holds: the plan, its inputs, the output's temporary folder; `model` is the upcycled
    model when it was ever whole in memory (else None) and `tokenizer` the one written beside it."""

    method_name: str | None = None        # the report's method name, when not the method's own

    def __init__(self, plan: ConversionPlan, inputs: ConversionInputs, directory: Path | None) -> None:
        self.plan, self.inputs, self.directory = plan, inputs, directory
        self.model: nn.Module | None = None
        self.tokenizer = inputs.tokenizer


class InMemoryRoute(Route):
    def run(self, progress: bool, phases) -> Converted:
        plan, started = self.plan, time.perf_counter()
        self.model = dense_weights(plan.model, plan.path, plan.config, plan.dtype).to(resolve_device(plan.device))
        load_s = time.perf_counter() - started
        phases("model loaded")
        self.done = convert_in_memory(self.model, plan, self.inputs, progress=progress, phase=phases)
        self.done.timings.load = load_s
        return self.done

    def write(self, report: ConversionReport) -> dict:
        with report.timings.phase("write"):
            return write_model(self.model, self.directory, self.plan,
                               self.tokenizer, self.done.probe.inputs)


class StreamedRoute(Route):
    def run(self, progress: bool, phases) -> Converted:
        from .streaming import StreamedSource

        phases("checkpoint opened (streaming)")
        self.source = StreamedSource(self.plan, self.inputs, self.directory)
        return run_conversion(self.source, self.inputs, progress=progress, phase=phases)

    def write(self, report: ConversionReport) -> dict:
        return self.source.written()


class MergedRoute(Route):
    def __init__(self, plan: ConversionPlan, inputs: ConversionInputs, directory: Path | None) -> None:
        super().__init__(plan, inputs, directory)
        self.method_name, self.tokenizer = f"sources ({plan.method.name})", None

    def run(self, progress: bool, phases) -> Converted:
        from .merge import merge_sources

        done, self.export = merge_sources(self.plan, self.inputs, self.directory, progress=progress, phase=phases)
        return done

    def write(self, report: ConversionReport) -> dict:
        return self.export


ROUTES: dict[str, type[Route]] = {IN_MEMORY: InMemoryRoute, STREAMED: StreamedRoute, MERGED: MergedRoute}


"""`upcycle convert`: a dense model (or several fine-tunes of one) becomes an MoE model, checked, written atomically.

    plan     everything decided before a weight loads, every weight-free refusal (`plan.make_plan`)
    claim    OUT (`outputs.claims`: never an input, replaced only when upcycle wrote it)
    inputs   the tokenizer, the probe's text and the calibration data (`model_data.read_inputs`)
    run      the plan's route: in memory, streamed or merged (`routes.py`), each by `orchestrator.run_conversion`
    report   the measurements and the preservation verdict (`report.refuse_if_broken`: a method that promised the
             dense function and broke it writes nothing)
    write    the weights (the plan's stock class, or the upcycle format), run_config.yaml, and upcycle_report.json
             last; the folder renamed into place
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

import yaml
from torch import nn

from ..checkpoint.loading import load_model
from ..checkpoint.save_load import mark_upcycled
from ..config import ConvertConfig
from ..files import json_text
from ..outputs.claims import Claim
from ..outputs.job import run_job
from ..progress import Phases
from .dry_run import check_fits
from .in_memory import convert_in_memory
from .inputs import ConversionInputs
from .model_data import read_inputs
from .plan import ConversionPlan, make_plan
from .report import ConversionReport, PreservationError, checked_report
from .routes import ROUTES

__all__ = ["Conversion", "PreservationError", "convert", "upcycle_model"]


@dataclass
class Conversion:
    """What `convert` returns: the plan it carried out, the report, and the model. After a streamed conversion the
    model was never in memory: `model` then loads the written folder when first asked for."""

    _model: nn.Module | None
    tokenizer: object | None
    report: ConversionReport
    out: Path | None = None
    plan: ConversionPlan | None = None

    @property
    def model(self) -> nn.Module:
        if self._model is None and self.out is not None:      # an upcycle folder, or a stock export
            self._model = load_model(str(self.out))[0]
        return self._model


def convert(cfg: ConvertConfig, out: str | Path | None = None, *, overwrite: bool = False,
            progress: bool = True, recipe: str | None = None) -> Conversion:
    """Convert `cfg.model` as `cfg` says (module docstring) and, when `out` is given, write the folder
    atomically; `overwrite` lets it replace an existing `out` that upcycle wrote (never an input, a folder
    holding one or inside one, the current directory). `recipe`: the recipe file the config came from."""
    started = time.perf_counter()
    plan = make_plan(cfg, writing=out is not None, recipe=recipe)
    planning_s = time.perf_counter() - started
    if out is None:
        return execute(plan, None, progress, planning_s)
    # a run that cannot fit the machine is refused before it builds anything
    return run_job(plan, out, lambda claim: execute(plan, claim, progress, planning_s),
                   check=lambda: check_fits(plan), overwrite=overwrite)


def execute(plan: ConversionPlan, claim: Claim | None, progress: bool = True, planning_s: float = 0.0
            ) -> Conversion:
    """Carry out `plan` into the claimed output (None: in memory only, nothing written). The report's load
    time counts `planning_s` (the config and headers read) and the inputs read, as well as the weights."""
    phases = Phases(5 if claim is not None else 4, progress, "upcycle convert")
    try:
        started = time.perf_counter()
        inputs = read_inputs(plan)                      # before minutes of loading the weights
        reading_s = planning_s + time.perf_counter() - started
        with claim.directory() if claim is not None else contextlib.nullcontext() as tmp:
            route = ROUTES[plan.route](plan, inputs, tmp)
            done = route.run(progress, phases)
            done.timings.load += reading_s
            report = checked_report(plan, done, method_name=route.method_name)
            if claim is not None:
                report.export = route.write(report)
                _finish(tmp, plan, report, phases, claim)
        return Conversion(route.model, route.tokenizer, report, claim.out if claim is not None else None, plan)
    finally:
        phases.close()


def upcycle_model(model: nn.Module, cfg: ConvertConfig, *, tokenizer=None, texts: list[str] | None = None,
                  calibration: list[dict] | None = None, progress: bool = True) -> ConversionReport:
    """Convert `model` (in memory) in place as `cfg` says and return the report; nothing is written.
    `texts`: the probe's text (read with `tokenizer`; default: seeded random token ids). `calibration`: model-input
    batches (e.g. `data.model_inputs.text_batches`) whose FFN inputs data-aware methods use; when given, the report adds
    each layer's routing of those tokens at init."""
    plan = make_plan(cfg, writing=False, model=model)     # a model given in memory computes in its own dtype
    inputs = ConversionInputs(plan.method, plan.args, plan.promised, tokenizer=tokenizer, texts=texts,
                              calibration=calibration, calibration_source="batches")
    done = convert_in_memory(model, plan, inputs, progress=progress)
    mark_upcycled(model)        # from here on its save_pretrained writes the upcycle format (upcycle.save too)
    return checked_report(plan, done)


def _finish(tmp: Path, plan: ConversionPlan, report: ConversionReport, phases: Phases, claim: Claim) -> None:
    """The files every conversion ends with: its config, and its report, the last file written (a folder
    holding a report is whole)."""
    (tmp / "run_config.yaml").write_text(yaml.safe_dump(plan.settings))
    (tmp / "upcycle_report.json").write_text(json_text(report.to_dict(), indent=2, where="upcycle_report.json"))
    phases(f"written to {claim.out}")

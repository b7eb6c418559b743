"""The conversion report (`upcycle_report.json`), typed, written as JSON.

    ConversionReport      what was converted, how, and what the conversion measured
      parameters          Parameters: ParameterCount before and after (total, active per token)
      preservation        Preservation: the check's settings and result, its Allowance when the method promised
      layers              [LayerEntry]: the method's facts per layer, expert similarity, LayerCalibration
      calibration         CalibrationSummary, or None without calibration data
      timings             Timings: seconds per phase

Every conversion (in memory, streamed, merged) makes its report through `conversion_report`, from what the
conversion measured (`Converted`). `to_dict()` gives the JSON (derived keys such as `num_moe_layers` and
`folded_scales` are computed there); attributes are the typed form.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..config import MoEConfig, to_dict
from ..data.model_names import recorded_location
from ..errors import UpcycleError
from ..version import __version__

if TYPE_CHECKING:
    import torch

    from ..probe import Probe
    from .plan import ConversionPlan


@dataclass
class ParameterCount:
    total: int                  # shared tensors counted once
    active_per_token: int       # k of E routed experts


@dataclass
class Parameters:
    before: ParameterCount
    after: ParameterCount

    def to_dict(self) -> dict:
        return {"before": vars(self.before).copy(), "after": vars(self.after).copy()}


@dataclass
class Allowance:
    """The allowed max |difference| and its parts (`preservation.preservation_tolerance`, in its order)."""

    allowed_max_abs_logit_diff: float
    rounding_noise: float
    noise_factor: float
    calibrated_tolerance: float
    ulp_floor: float
    output_scale: float
    user_tolerance: float


@dataclass
class Preservation:
    promised: bool              # the method (with these MoE options) promises the dense function
    tolerance: float
    relative_logit_diff: float | None    # None when no whole-model comparison ran
    relative_tolerance: float
    passed: bool | None         # None when nothing was promised
    allowance: Allowance | None  # None when nothing was promised
    compared_output: str
    compared_rows: int
    probe_source: str | None
    probe_shape: list[int] | None
    end_to_end: bool = True     # whether the whole-model comparison ran (else only the per-layer checks)
    why: str | None = None      # why nothing is promised, when no method could promise it (a merge)

    def to_dict(self) -> dict:
        if self.why is not None:
            return {"promised": self.promised, "passed": self.passed, "why": self.why}
        return {"promised": self.promised, "tolerance": self.tolerance,
                "relative_logit_diff": self.relative_logit_diff, "relative_tolerance": self.relative_tolerance,
                "passed": self.passed, **(vars(self.allowance) if self.allowance is not None else {}),
                "compared_output": self.compared_output, "compared_rows": self.compared_rows,
                "probe_source": self.probe_source, "probe_shape": self.probe_shape,
                "end_to_end": self.end_to_end}


@dataclass
class RoutingAtInit:
    """How a layer's router splits the calibration tokens at init (`metrics.routing.layer_routing_stats`)."""

    router_load: list[float]
    router_load_cov: float
    routing_entropy: float
    router_cluster_agreement: float | None = None    # only for methods that cluster the tokens

    def to_dict(self) -> dict:
        out = {"router_load": self.router_load, "router_load_cov": self.router_load_cov,
               "routing_entropy": self.routing_entropy}
        if self.router_cluster_agreement is not None:
            out["router_cluster_agreement"] = self.router_cluster_agreement
        return out


@dataclass
class LayerCalibration:
    tokens_seen: int
    tokens_kept: int
    routing: RoutingAtInit


@dataclass
class LayerCheck:
    """The layer against the dense FFN on the probe's FFN inputs (`layer_check.py`)."""

    max_abs_diff: float | None
    relative_diff: float | None
    probe_tokens: int
    allowed_max_abs_diff: float | None = None      # only when the method promised the dense function
    rounding_noise: float | None = None
    passed: bool | None = None

    def to_dict(self) -> dict:
        out = {"max_abs_diff": self.max_abs_diff, "relative_diff": self.relative_diff,
               "probe_tokens": self.probe_tokens}
        if self.allowed_max_abs_diff is not None:
            out |= {"allowed_max_abs_diff": self.allowed_max_abs_diff, "layer_rounding_noise": self.rounding_noise,
                    "passed": self.passed}
        return out


@dataclass
class LayerEntry:
    name: str                   # e.g. text.3
    block: str                  # the block's module path
    method_facts: dict          # what the method reports for this layer (its `ExpertInit.info`)
    expert_similarity: float
    diversity: float
    calibration: LayerCalibration | None = None
    check: LayerCheck | None = None
    sources: dict | None = None  # a merge's facts about the layer (`merge_layers.SourceLayers`): agreement, tokens

    def to_dict(self) -> dict:
        if self.sources is not None:     # a merge: each source's method facts in a list, beside the sources'
            return {"name": self.name, "block": self.block, "method_facts": self.method_facts or None,
                    "expert_similarity": self.expert_similarity, "diversity": self.diversity, **self.sources}
        out = {"name": self.name, "block": self.block, **self.method_facts,
               "expert_similarity": self.expert_similarity, "diversity": self.diversity}
        if self.calibration is not None:
            c = self.calibration
            out |= {"calibration_tokens_seen": c.tokens_seen, "calibration_tokens_kept": c.tokens_kept,
                    **c.routing.to_dict()}
        if self.check is not None:
            out |= self.check.to_dict()
        return out


@dataclass
class CalibrationSummary:
    source: str
    batches: int
    real_tokens: int
    budget_per_layer: int


@dataclass
class Timings:
    """Seconds per phase; `load` and `write` only when `convert` loaded and wrote the model."""

    dense_probe: float = 0.0
    rounding_noise: float = 0.0
    calibration: float = 0.0
    upcycle: float = 0.0
    check: float = 0.0
    load: float | None = None
    write: float | None = None

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Add the seconds the block takes to phase `name` (one phase may run in many pieces: every block's)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, name, (getattr(self, name) or 0.0) + time.perf_counter() - start)

    def to_dict(self) -> dict:
        out = {} if self.load is None else {"load": self.load}
        out |= {"dense_probe": self.dense_probe, "rounding_noise": self.rounding_noise,
                "calibration": self.calibration, "upcycle": self.upcycle, "check": self.check}
        if self.write is not None:
            out["write"] = self.write
        return out


@dataclass(eq=False)
class ConversionReport:
    upcycle_version: str
    method: str
    paper: str
    method_args: dict
    source_model: str
    model_class: str
    model_type: str
    moe_layers: list[str]
    moe: MoEConfig
    parameters: Parameters
    max_abs_logit_diff: float | None
    kl_to_dense: float | None
    preservation: Preservation
    calibration: CalibrationSummary | None
    layers: list[LayerEntry]
    seed: int
    dtype: str
    timings: Timings = field(default_factory=Timings)
    export: dict | None = None  # what was written (the pipeline's writer); None until written
    streamed: bool = False      # converted block by block from the checkpoint on disk (`streaming.py`)
    sources: dict | None = None  # a merge's sources (`merge.py`): their models, data, and expert_source
    router_source_agreement: dict | None = None   # a merge's per-source agreement over the layers

    def folded_scales(self) -> list[dict]:
        """Scales a method folded into the expert weights (docs/methods.md §2.8), per layer."""
        return [{"layer": layer.name, "scale": layer.method_facts["folded_scale"]} for layer in self.layers
                if layer.sources is None and "folded_scale" in layer.method_facts]

    def to_dict(self) -> dict:
        out = {"upcycle_version": self.upcycle_version, "method": self.method, "paper": self.paper,
               "method_args": self.method_args, "source_model": self.source_model,
               "source_path": recorded_location(self.source_model), "model_class": self.model_class,
               "model_type": self.model_type, "num_moe_layers": len(self.moe_layers),
               "moe_layers": list(self.moe_layers), "num_experts": self.moe.num_experts, "top_k": self.moe.top_k,
               "moe": to_dict(self.moe), "parameters": self.parameters.to_dict(),
               "max_abs_logit_diff": self.max_abs_logit_diff, "kl_to_dense": self.kl_to_dense,
               "preservation": self.preservation.to_dict(), "folded_scales": self.folded_scales(),
               "calibration": None if self.calibration is None else vars(self.calibration).copy(),
               "layers": [layer.to_dict() for layer in self.layers], "seed": self.seed, "dtype": self.dtype,
               "timings_s": self.timings.to_dict(), "streamed": self.streamed}
        if self.sources is not None:
            out |= {"sources": self.sources, "router_source_agreement": self.router_source_agreement}
        if self.export is not None:
            out["export"] = self.export
        return out


class PreservationError(UpcycleError):
    """The method promised the dense function and the converted model does not reproduce it."""

    def __init__(self, message: str, report: ConversionReport):
        super().__init__(message)
        self.report = report


def refuse_if_broken(report: ConversionReport, noise_factor: float) -> None:
    """Raise PreservationError when a promised method broke the dense function: first any MoE layer that
    failed its own check (it names the layer), then the end-to-end comparison. The same rule for the in-memory
    and the streaming conversion."""
    failed = next((layer for layer in report.layers if layer.check is not None and layer.check.passed is False),
                  None)
    if failed is not None:
        c = failed.check
        raise PreservationError(
            f"method {report.method!r} promises to preserve the dense model's function, but MoE layer "
            f"{failed.name} differs from the dense FFN it replaces by {c.max_abs_diff:.3g} > allowed "
            f"{c.allowed_max_abs_diff:.3g} = {noise_factor:g} x that layer's rounding noise "
            f"{c.rounding_noise:.3g} on the probe's hidden states; refusing to write", report)
    p = report.preservation
    if p.promised and p.passed is False and report.max_abs_logit_diff is not None:
        a = p.allowance
        raise PreservationError(
            f"method {report.method!r} promises to preserve the dense model's function, but max |logit difference| "
            f"is {report.max_abs_logit_diff:.3g} > allowed {a.allowed_max_abs_logit_diff:.3g} = {noise_factor:g} x "
            f"the rounding noise {a.rounding_noise:.3g} of the dense model computed in another order on the same "
            f"probe; refusing to write (check.tolerance=X accepts up to X anyway)", report)


@dataclass
class Converted:
    """What one conversion measured, whichever way its blocks were read (`conversion_report` makes the report)."""

    model_class: str
    model_type: str
    moe_layers: list[str]
    before: dict                 # `preservation.count_parameters` of the dense model
    after: dict                  # and of the MoE model
    layers: list[LayerEntry]
    promised: bool
    measured: dict | None        # `probe.compare` of the whole model; None when it did not run
    noise: float | None          # the dense model's rounding noise on the probe (when promised and measured)
    compute_dtype: torch.dtype   # the dtype the check computed in
    probe: Probe | None
    calibration: CalibrationSummary | None
    timings: Timings
    streamed: bool = False
    dtype: str | None = None     # the dtype converted in, when the config said auto (a model given in memory)
    why_not_promised: str | None = None     # nothing could be promised (a merge of several models)
    sources: dict | None = None
    router_source_agreement: dict | None = None


def conversion_report(plan: ConversionPlan, done: Converted, *, method_name: str | None = None) -> ConversionReport:
    """The report of a conversion: the preservation verdict from the whole-model comparison (when it ran)
    and every layer's own check (`refuse_if_broken` then refuses a broken promise)."""
    from .preservation import preservation_tolerance

    measured, promised = done.measured, done.promised
    allowed = passed = None
    if measured is not None and promised:
        allowed = preservation_tolerance(measured["output_scale"], done.noise, done.compute_dtype, plan.check)
        passed = measured["max_abs_logit_diff"] <= allowed["allowed_max_abs_logit_diff"]
    if promised:
        layer_results = [layer.check.passed for layer in done.layers if layer.check is not None]
        passed = (passed is not False) and all(r is not False for r in layer_results)
        if measured is None and not layer_results:
            passed = None               # check.per_layer and check.end_to_end both off: nothing was checked
    probe = done.probe
    shape = None
    if probe is not None:
        shape = list((probe.inputs["input_ids"] if "input_ids" in probe.inputs else probe.inputs["pixel_values"]).shape)
    preservation = Preservation(
        promised=promised, tolerance=plan.check.tolerance,
        relative_logit_diff=measured["relative_logit_diff"] if measured else None,
        relative_tolerance=plan.check.relative_tolerance, passed=passed if promised else None,
        allowance=Allowance(**allowed) if allowed else None,
        compared_output=measured["compared_output"] if measured else "per-layer only",
        compared_rows=measured["compared_rows"] if measured else 0,
        probe_source=probe.source if probe is not None else None, probe_shape=shape,
        end_to_end=measured is not None, why=done.why_not_promised)
    return ConversionReport(
        upcycle_version=__version__, method=method_name or plan.method.name, paper=plan.method.paper,
        method_args=plan.args,
        source_model=plan.model, model_class=done.model_class, model_type=done.model_type,
        moe_layers=done.moe_layers, moe=plan.moe,
        parameters=Parameters(ParameterCount(**done.before), ParameterCount(**done.after)),
        max_abs_logit_diff=measured["max_abs_logit_diff"] if measured else None,
        kl_to_dense=measured["kl_to_dense"] if measured else None, preservation=preservation,
        calibration=done.calibration, layers=done.layers, seed=plan.seed, dtype=done.dtype or plan.dtype,
        timings=done.timings, streamed=done.streamed, sources=done.sources,
        router_source_agreement=done.router_source_agreement)


def checked_report(plan: ConversionPlan, done: Converted, method_name: str | None = None) -> ConversionReport:
    """The conversion's report (`conversion_report`), refused when a promise broke (`refuse_if_broken`)."""
    report = conversion_report(plan, done, method_name=method_name)
    refuse_if_broken(report, plan.check.noise_factor)
    return report

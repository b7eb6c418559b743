"""`upcycle convert`: a dense model (or several fine-tunes of one) becomes an MoE model, checked, written atomically.

Every conversion runs these steps, each in one place:

    validate (the method, its arguments, the device, the sources; once)
    -> claim OUT (`outputs.claims`: never an input, replaced only when upcycle wrote it)
    -> read the probe's text and the calibration data (`model_data.py`), before any weight
    -> the conversion, by `orchestrator.run_conversion` over one of three block sources:
         in memory   the dense model loaded whole, converted in place (`in_memory.InMemorySource`)
         streaming   a local safetensors checkpoint read block by block, written shard by shard
                     (`streaming.StreamedSource`)
         merge       several fine-tunes of one base, streamed the same way (`merge.MergedSource`)
    -> the report (`report.conversion_report`) and the preservation verdict (`report.refuse_if_broken`:
       a method that promised the dense function and broke it writes nothing)
    -> the weights (upcycle format, or a stock transformers class where one fits: `export.layout.choose_export`)
    -> run_config.yaml and upcycle_report.json, the last file written; the folder renamed into place.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import yaml
from torch import nn
from tqdm.auto import tqdm

from ..checkpoint.loading import DTYPES, dense_config, dense_weights, load_model
from ..checkpoint.save_load import mark_upcycled
from ..config import ConvertConfig, to_dict
from ..core.devices import resolve_device
from ..data.model_names import model_inputs
from ..errors import UpcycleError
from ..export.layout import choose_export
from ..files import json_text
from ..methods import Method
from ..outputs.claims import Claim, Input, claim_output, inputs
from .in_memory import convert_in_memory, write_model
from .inputs import ConversionInputs, promises_dense_function, with_resolved_dtype
from .model_data import probe_source, probe_texts, read_inputs
from .orchestrator import run_conversion
from .planned import layout_function, planned_model
from .report import ConversionReport, Converted, PreservationError, conversion_report, refuse_if_broken
from .validate import validate

__all__ = ["Conversion", "PreservationError", "convert", "upcycle_model", "validate"]


@dataclass
class Conversion:
    """What `convert` returns. After a streamed conversion the model was never in memory: `model` then loads
    the written folder when first asked for."""

    _model: nn.Module | None
    tokenizer: object | None
    report: ConversionReport
    out: Path | None = None

    @property
    def model(self) -> nn.Module:
        if self._model is None and self.out is not None:      # an upcycle folder, or a stock export
            self._model = load_model(str(self.out))[0]
        return self._model


def conversion_inputs(cfg: ConvertConfig, recipe: str | None = None) -> list[Input]:
    """Every path a conversion reads, for the output checks: the model (the embedded model's cache and wheel
    too), the recipe, the probe and calibration files, and a merge's sources and their text."""
    found = [Input(what, path) for what, path in model_inputs(cfg.model)]
    for i, source in enumerate(cfg.sources.experts):
        found += [Input(f"source {i}'s {what}", path) for what, path in model_inputs(source.model)]
        found += inputs((f"source {i}'s data", source.data), (f"source {i}'s held-out data", source.eval_data))
    return found + inputs(("recipe", recipe), ("probe text", cfg.check.text),
                          ("calibration data", cfg.calibration.data))


def upcycle_model(model: nn.Module, cfg: ConvertConfig, *, tokenizer=None, texts: list[str] | None = None,
                  calibration: list[dict] | None = None, progress: bool = True) -> ConversionReport:
    """Convert `model` (in memory) in place as `cfg` says and return the report; nothing is written.
    `texts`: the probe's text (read with `tokenizer`; default: seeded random token ids). `calibration`: model-input
    batches (e.g. `calibration.text_batches`) whose FFN inputs data-aware methods use; when given, the report adds
    each layer's routing of those tokens at init."""
    if cfg.sources.experts:
        raise UpcycleError("a merge of several source models reads them from disk: use convert(cfg, out)")
    method, args = validate(cfg)
    cfg = with_resolved_dtype(cfg, model=model)       # a model given in memory computes in its own dtype
    inputs = ConversionInputs(method, args, promises_dense_function(method, args, cfg), tokenizer=tokenizer,
                              texts=texts, calibration=calibration, calibration_source="batches")
    done = convert_in_memory(model, cfg, inputs, progress=progress)
    mark_upcycled(model)        # from here on its save_pretrained writes the upcycle format (upcycle.save too)
    return _checked_report(cfg, method, args, done)


def convert(cfg: ConvertConfig, out: str | Path | None = None, *, overwrite: bool = False,
            progress: bool = True, recipe: str | None = None) -> Conversion:
    """Convert `cfg.model` as `cfg` says (module docstring) and, when `out` is given, write the folder
    atomically; `overwrite` lets it replace an existing `out` that upcycle wrote (never an input, a folder
    holding one or inside one, the current directory). `recipe`: the recipe file the config came from."""
    method, args = validate(cfg)
    if out is None:
        if cfg.sources.experts:
            raise UpcycleError("a merge of several source models is streamed to a folder: give OUT")
        return _convert(cfg, method, args, None, progress)
    with claim_output(out, kind="convert", given=conversion_inputs(cfg, recipe), overwrite=overwrite) as claim:
        return _convert(cfg, method, args, claim, progress)


def _checked_report(cfg: ConvertConfig, method: Method, args: dict, done: Converted, **kw) -> ConversionReport:
    report = conversion_report(cfg, method, args, done, **kw)
    refuse_if_broken(report, cfg.check.noise_factor)
    return report


def _convert(cfg: ConvertConfig, method: Method, args: dict, claim: Claim | None, progress: bool) -> Conversion:
    phases = Phases(5 if claim is not None else 4, progress)
    try:
        if cfg.sources.experts:
            return _merge(cfg, method, args, claim, progress, phases)
        return _one_model(cfg, method, args, claim, progress, phases)
    finally:
        phases.close()


def _merge(cfg, method, args, claim: Claim, progress: bool, phases: Phases) -> Conversion:
    from .merge import merge_sources
    from .sources import open_sources

    opened = open_sources(cfg)          # configs and headers only: a mismatch is refused here
    cfg = with_resolved_dtype(cfg, opened[0].config)
    texts = probe_texts(cfg) if cfg.export == "hf" else None
    # each source's text calibrates its own experts (validate._check_sources): no calibration of the whole
    inputs = ConversionInputs(method, args, promised=False, texts=texts,
                              text_source=probe_source(cfg) if texts else "random token ids", per_source=True)
    with claim.directory() as tmp:
        done, export = merge_sources(cfg, inputs, tmp, opened, progress=progress, phase=phases)
        report = _checked_report(cfg, method, args, done, method_name=f"sources ({method.name})")
        _finish(tmp, cfg, report, export, phases, claim)
    return Conversion(None, None, report, claim.out)


def _one_model(cfg, method, args, claim: Claim | None, progress: bool, phases: Phases) -> Conversion:
    t = time.perf_counter()
    path, config = dense_config(cfg.model)
    cfg = with_resolved_dtype(cfg, config)          # the report states the dtype used
    inputs = read_inputs(cfg, method, args, path, config)       # before minutes of loading the weights
    from .streaming import StreamedSource, stream_source

    stream = stream_source(cfg, path, config) if claim is not None else None
    if stream is not None:
        load_s = time.perf_counter() - t        # config, tokenizer and the checkpoint's index: no weights
        phases("checkpoint opened (streaming)")
        with claim.directory() as tmp:
            source = StreamedSource(stream, cfg, inputs, tmp)
            done = run_conversion(source, cfg, inputs, progress=progress, phase=phases)
            done.timings.load = load_s
            report = _checked_report(cfg, method, args, done)
            _finish(tmp, cfg, report, source.written(), phases, claim)
        return Conversion(None, inputs.tokenizer, report, claim.out)
    # the stock class is chosen on the planned (weightless) model: one that cannot fit is refused before any
    # weight is read, as on the streamed and merged paths
    chosen = (None, None)
    if claim is not None and cfg.export == "hf":
        planned, _ = planned_model(config, cfg.moe, cfg.placement, layout_function(method, args),
                                   dtype=DTYPES[cfg.dtype])
        chosen = choose_export(planned, cfg)
    model = dense_weights(cfg.model, path, config, cfg.dtype).to(resolve_device(cfg.device))
    load_s = time.perf_counter() - t
    phases("model loaded")
    done = convert_in_memory(model, cfg, inputs, progress=progress, phase=phases)
    done.timings.load = load_s
    report = _checked_report(cfg, method, args, done)
    if claim is None:
        return Conversion(model, inputs.tokenizer, report)
    with claim.directory() as tmp:
        with report.timings.phase("write"):
            export = write_model(model, tmp, cfg, chosen, inputs.tokenizer, done.probe.inputs)
        _finish(tmp, cfg, report, export, phases, claim)
    return Conversion(model, inputs.tokenizer, report)


def _finish(tmp: Path, cfg: ConvertConfig, report: ConversionReport, export: dict, phases: Phases,
            claim: Claim) -> None:
    """The files every conversion ends with: its config, and its report, the last file written (a folder
    holding a report is whole)."""
    report.export = export
    (tmp / "run_config.yaml").write_text(yaml.safe_dump(to_dict(cfg)))
    (tmp / "upcycle_report.json").write_text(json_text(report.to_dict(), indent=2, where="upcycle_report.json"))
    phases(f"written to {claim.out}")


class Phases:
    """A progress bar whose steps are the conversion's phases (the per-block phase has its own bar)."""

    def __init__(self, total: int, progress: bool):
        self.bar = tqdm(total=total, desc="upcycle convert", unit="phase", disable=not progress)

    def __call__(self, message: str) -> None:
        self.bar.set_postfix_str(message)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()

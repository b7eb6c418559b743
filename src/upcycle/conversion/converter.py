"""`upcycle convert`: dense model -> MoE model, checked against the dense model, written atomically.

Data flow (DESIGN): validate everything (method, arguments, sizes, placement, output) -> record the dense
model's outputs on a fixed held-out batch -> for each target block: extract the FFN, run the method, install
the MoE layer -> run the batch again and compare -> refuse to write when a method that promises function
preservation breaks it -> write the folder (temporary directory, renamed at the end).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import yaml
from torch import nn
from tqdm.auto import tqdm

from ..config import ConvertConfig, to_dict
from ..core.architectures import PIXELS, TOKEN_IDS, family_of
from ..core.moe import MoELayer
from ..core.surgery import install, plan_targets, tower_cfg, track_padding_masks
from ..data.assets import DEFAULT_MODEL_NAMES, model_inputs
from ..errors import UpcycleError
from ..files import json_text
from ..methods import Method, get_method
from ..outputs import Claim, Input, claim_output, inputs
from ..version import __version__
from .blockwise import convert_blocks
from .calibration import real_tokens, tensor_batches, text_batches
from .export import export_hf, export_target
from .io import save
from .layer_check import layer_probe
from .loading import DTYPES, dense_config, dense_weights, load_model, load_tokenizer, resolve_device, resolve_dtype
from .preservation import compare, count_parameters, make_probe, preservation_tolerance, probe_output, rounding_noise
from .report import (
    Allowance,
    CalibrationSummary,
    ConversionReport,
    ParameterCount,
    Parameters,
    Preservation,
    PreservationError,  # noqa: F401  (raised by refuse_if_broken; imported from here by callers)
    Timings,
    refuse_if_broken,
)
from .shards import parse_size


@dataclass
class Conversion:
    """What `convert` returns. After a streaming conversion the model was never in memory: `model` then loads
    the written folder when first asked for."""

    _model: nn.Module | None
    tokenizer: object | None
    report: ConversionReport | dict     # a dict for a merge of several sources (`merge.merge_sources`)
    out: Path | None = None

    @property
    def model(self) -> nn.Module:
        if self._model is None and self.out is not None:      # an upcycle folder, or a stock export
            self._model = load_model(str(self.out))[0]
        return self._model


def validate(cfg: ConvertConfig) -> tuple[Method, dict]:
    """Checks that need no model and that the config cannot make itself (its keys' ranges and choices are checked
    when it is built): the method and its arguments, the device, the shard size."""
    method = get_method(cfg.method)
    args = method.resolve_args(cfg.method_args)
    resolve_device(cfg.device)
    parse_size(cfg.shard_size)
    return method, args


def check_model_inputs(cfg: ConvertConfig, config, tokenizer, calibration_data: list | None) -> None:
    """Refuse, before the weights load, data the model cannot take (each tower's input is in its row of the
    architecture table): text for a model with an image tower (it calibrates on image-caption pairs), text
    without a tokenizer, model inputs lacking a tower's input, and a probe text file that would silently be
    replaced by random ids."""
    family = family_of(config)
    towers = family.towers_of(config)
    reads = list(dict.fromkeys(tower.input for tower in towers.values()))     # each input once, in tower order
    name = cfg.model
    if cfg.check.text is not None and tokenizer is None:
        raise UpcycleError(f"check.text (--probe-text) {cfg.check.text}: model {name!r} has no tokenizer to read "
                           f"it with (add the tokenizer files to the model folder, or leave out --probe-text to "
                           f"probe with seeded random token ids)")
    if cfg.check.text is not None and TOKEN_IDS not in reads:
        raise UpcycleError(f"check.text (--probe-text) {cfg.check.text}: model {name!r} is a vision model and "
                           f"takes no text")
    if calibration_data is None:
        return
    if isinstance(calibration_data[0], dict):      # model inputs from a .safetensors file
        missing = [key for key in reads if key not in calibration_data[0]]
        if missing:
            raise UpcycleError(f"calibration data {cfg.calibration.data}: model {name!r} ({config.model_type}, "
                               f"towers {', '.join(towers)}) needs {' and '.join(missing)} in every batch")
        return
    if PIXELS in reads:
        text = TOKEN_IDS in reads
        kind = f"a two-tower {family.display_name} model" if text else "a vision model"
        raise UpcycleError(f"calibration data {cfg.calibration.data}: model {name!r} is {kind}, which calibrates "
                           f"on images, not text: pass image-caption pairs as a .safetensors file of model inputs "
                           f"({PIXELS}{f', {TOKEN_IDS}, attention_mask' if text else ''})")
    if tokenizer is None:
        raise UpcycleError(f"model {name!r} has no tokenizer, so calibration text cannot be tokenized; "
                           f"pass model inputs as a .safetensors file (input_ids, attention_mask)")


def probe_texts(cfg: ConvertConfig) -> list[str] | None:
    """The user's probe text file, else the embedded held-out Wikipedia split (None if not installed)."""
    from ..data.text import read_texts, wikipedia_split

    if cfg.check.text is not None:
        try:
            return read_texts(cfg.check.text)
        except (FileNotFoundError, ValueError) as e:
            raise UpcycleError(f"check.text: {e}") from None
    try:
        return wikipedia_split()[1]
    except (FileNotFoundError, OSError):
        return None


def calibration_corpus(cfg: ConvertConfig) -> tuple[list[str] | list[dict] | None, str | None]:
    """(data, source) for calibration, read before the model loads: documents from the user's text/JSONL file,
    or ready model-input batches from a .safetensors file; else the embedded Wikipedia train split on the
    default model when the method needs data; (None, None) when none is needed."""
    from ..data.text import read_texts, wikipedia_split

    method = get_method(cfg.method)
    data = cfg.calibration.data
    if data is not None:
        if not Path(data).is_file():
            raise UpcycleError(f"calibration data: no file {data}")
        if Path(data).suffix.lower() == ".safetensors":
            return tensor_batches(data, batch_size=cfg.calibration.batch_size), f"model inputs {data}"
        try:
            return read_texts(data), f"text file {data}"
        except (FileNotFoundError, ValueError) as e:
            raise UpcycleError(f"calibration data: {e}") from None
    if not method.needs_calibration:
        return None, None
    if cfg.model not in DEFAULT_MODEL_NAMES:
        raise UpcycleError(f"method {method.name!r} needs calibration data: pass --calibration FILE (text, JSONL "
                           f"with a \"text\" field, or .safetensors of model inputs) representative of the data "
                           f"the model will be trained on")
    try:
        return wikipedia_split()[0], "Wikipedia train split (embedded)"
    except (FileNotFoundError, OSError) as e:
        raise UpcycleError(f"method {method.name!r} needs calibration data and the embedded corpus is missing ({e});"
                           f" pass --calibration FILE") from None


def upcycle_model(model: nn.Module, cfg: ConvertConfig, *, tokenizer=None, texts: list[str] | None = None,
                  text_source: str = "held-out text", calibration: list[dict] | None = None,
                  calibration_source: str = "batches", progress: bool = True, phases: Phases | None = None,
                  ) -> ConversionReport:
    """Convert `model` in place as `cfg` says and return the report (see module docstring for the steps).

    `calibration`: model-input batches (e.g. from `text_batches`) whose FFN inputs data-aware methods use;
    required by methods that need calibration data, and when given the report adds each layer's routing of
    those tokens at init."""
    if cfg.sources.experts:
        raise UpcycleError("a merge of several source models reads them from disk: use convert(cfg, out)")
    method, args = validate(cfg)
    if cfg.dtype == "auto":          # a model given in memory: it is in the dtype it computes in
        cfg = dataclasses.replace(cfg, dtype=str(next(model.parameters()).dtype).removeprefix("torch."))
    family = family_of(model.config)
    targets = plan_targets(model, cfg.placement)
    if method.needs_calibration and not calibration:
        raise UpcycleError(f"method {method.name!r} needs calibration data: pass --calibration FILE (text, or JSONL "
                           f"with a \"text\" field); on the default model the embedded Wikipedia train split is used")
    timings = Timings()
    bar = phases or Phases(3, progress)

    t = time.perf_counter()
    before = ParameterCount(**count_parameters(model))
    probe = make_probe(model, tokenizer, texts, cfg.check, cfg.seed, text_source)
    dense_out = probe_output(model, probe)
    timings.dense_probe = time.perf_counter() - t
    t = time.perf_counter()
    # a route scale other than 1 scales the routed output: no method's construction undoes it
    promised = (method.preserves(args, cfg.moe.normalize_topk, cfg.moe.capacity_factor_eval is None)
                and cfg.moe.route_scale == 1.0)
    blocks = [(model.get_submodule(target.path), tower_cfg(model, family, target)) for target in targets]
    noise = rounding_noise(model, probe, dense_out, blocks, family) if promised else None
    ffn_dtype = family.extract(*blocks[0]).w_up.dtype      # the conversion dtype, whose rounding the check allows
    timings.rounding_noise = time.perf_counter() - t
    bar("dense outputs recorded")

    t = time.perf_counter()
    built: dict[str, MoELayer] = {}

    def keep(visit, block, layer) -> None:
        if layer is not None:
            built[visit.path] = layer

    result = convert_blocks(model, family, targets, method, args, cfg, promised=promised,
                            probe_batches=[layer_probe(probe.inputs)] if cfg.check.per_layer else None,
                            calibration=calibration,
                            before_block=lambda path, block: None, after_block=keep, progress=progress)
    layers = result.layers
    # Install only once every layer is built: a method failing on any layer leaves the model untouched.
    for path, layer in built.items():
        install(model, path, layer.train(model.training))
    track_padding_masks(model)
    timings.calibration = result.timings["calibration"]
    timings.upcycle = time.perf_counter() - t
    bar(f"{len(targets)} layers upcycled")

    t = time.perf_counter()
    measured = compare(dense_out, probe_output(model, probe))
    timings.check = time.perf_counter() - t
    bar("preservation checked")

    # the allowed difference follows from the rounding this depth, logit scale and dtype show (checks module)
    allowed = (preservation_tolerance(measured["output_scale"], noise, ffn_dtype, cfg.check)
               if promised else None)
    passed = promised and measured["max_abs_logit_diff"] <= allowed["allowed_max_abs_logit_diff"]
    shape = probe.inputs["input_ids"].shape if "input_ids" in probe.inputs else probe.inputs["pixel_values"].shape
    preservation = Preservation(
        promised=promised, tolerance=cfg.check.tolerance, relative_logit_diff=measured["relative_logit_diff"],
        relative_tolerance=cfg.check.relative_tolerance, passed=passed if promised else None,
        allowance=Allowance(**allowed) if allowed else None, compared_output=measured["compared_output"],
        compared_rows=measured["compared_rows"], probe_source=probe.source, probe_shape=list(shape))
    report = ConversionReport(
        upcycle_version=__version__, method=method.name, paper=method.paper, method_args=args,
        source_model=cfg.model, model_class=type(model).__name__, model_type=model.config.model_type,
        moe_layers=[t.name for t in targets], moe=cfg.moe,
        parameters=Parameters(before, ParameterCount(**count_parameters(model))),
        max_abs_logit_diff=measured["max_abs_logit_diff"], kl_to_dense=measured["kl_to_dense"],
        preservation=preservation, calibration=None if not calibration else CalibrationSummary(
            calibration_source, len(calibration), real_tokens(calibration), cfg.calibration.tokens),
        layers=layers, seed=cfg.seed, dtype=cfg.dtype, timings=timings)
    refuse_if_broken(report, cfg.check.noise_factor)
    return report


def conversion_inputs(cfg: ConvertConfig, recipe: str | None = None) -> list[Input]:
    """Every path a conversion reads, for the output checks: the model (the embedded model's cache and wheel
    too), the recipe, the probe and calibration files, and a merge's sources and their text."""
    found = [Input(what, path) for what, path in model_inputs(cfg.model)]
    for i, source in enumerate(cfg.sources.experts):
        found += [Input(f"source {i}'s {what}", path) for what, path in model_inputs(source.model)]
        found += inputs((f"source {i}'s data", source.data), (f"source {i}'s held-out data", source.eval_data))
    return found + inputs(("recipe", recipe), ("probe text", cfg.check.text),
                          ("calibration data", cfg.calibration.data))


def convert(cfg: ConvertConfig, out: str | Path | None = None, *, overwrite: bool = False,
            progress: bool = True, recipe: str | None = None) -> Conversion:
    """Load `cfg.model`, upcycle it, and (when `out` is given) write the upcycle folder atomically; `overwrite`
    lets it replace an existing `out` that upcycle wrote (never an input, a folder holding one or inside one, the
    current directory). `recipe`: the recipe file the config came from, an input like the others."""
    if cfg.sources.experts and out is None:
        raise UpcycleError("a merge of several source models is streamed to a folder: give OUT")
    if not cfg.sources.experts:
        validate(cfg)
    if out is None:
        return _convert(cfg, None, progress)
    with claim_output(out, kind="convert", given=conversion_inputs(cfg, recipe), overwrite=overwrite) as claim:
        if cfg.sources.experts:             # several fine-tunes of cfg.model: a streamed merge
            from .merge import merge_sources

            report = merge_sources(cfg, claim, progress=progress)
            return Conversion(None, None, report, Path(out))
        return _convert(cfg, claim, progress)


def _convert(cfg: ConvertConfig, claim: Claim | None, progress: bool) -> Conversion:
    out = claim.out if claim is not None else None
    if cfg.check.text is not None and not Path(cfg.check.text).is_file():
        raise UpcycleError(f"check.text: no file {cfg.check.text}")
    calibration_data, calibration_source = calibration_corpus(cfg)
    phases = Phases(5 if out is not None else 4, progress)
    t = time.perf_counter()
    path, config = dense_config(cfg.model)
    cfg = dataclasses.replace(cfg, dtype=resolve_dtype(cfg.dtype, config))     # the report states the dtype used
    tokenizer = load_tokenizer(path)
    check_model_inputs(cfg, config, tokenizer, calibration_data)    # before minutes of loading the weights
    source = f"text file {cfg.check.text}" if cfg.check.text else "held-out Wikipedia (embedded)"
    texts = probe_texts(cfg) if tokenizer else None                 # a malformed probe file fails here too
    calibration = None
    if calibration_data is not None and isinstance(calibration_data[0], dict):
        calibration = calibration_data               # model inputs prepared by the user
    elif calibration_data is not None:               # text, with a tokenizer (check_model_inputs)
        c = cfg.calibration
        calibration = text_batches(tokenizer, calibration_data, tokens=c.tokens, sequence_length=c.sequence_length,
                                   batch_size=c.batch_size, seed=cfg.seed)
    stream = _stream_source(cfg, path, config) if out is not None else None
    if stream is not None:
        from .streamed import convert_streamed

        load_s = time.perf_counter() - t        # config, tokenizer and the checkpoint's index: no weights
        report = convert_streamed(stream, cfg, *validate(cfg), claim, load_s=load_s,
                                  tokenizer=tokenizer, texts=texts, text_source=source, calibration=calibration,
                                  calibration_source=calibration_source, progress=progress, phases=phases)
        phases.close()
        return Conversion(None, tokenizer, report, Path(out))
    model = dense_weights(cfg.model, path, config, cfg.dtype).to(resolve_device(cfg.device))
    load_s = time.perf_counter() - t
    phases("model loaded")
    report = upcycle_model(model, cfg, tokenizer=tokenizer, texts=texts, text_source=source,
                           calibration=calibration, calibration_source=calibration_source, progress=progress,
                           phases=phases)
    report.timings.load = load_s
    if out is not None:
        t = time.perf_counter()
        with claim.directory() as tmp:
            probe = make_probe(model, tokenizer, texts, cfg.check, cfg.seed, source)
            report.export = write_output(model, tmp, cfg, tokenizer, probe.inputs)
            (tmp / "run_config.yaml").write_text(yaml.safe_dump(to_dict(cfg)))
            report.timings.write = time.perf_counter() - t
            text = json_text(report.to_dict(), indent=2, where="upcycle_report.json")
            (tmp / "upcycle_report.json").write_text(text)   # last file written
        phases(f"written to {out}")
    phases.close()
    return Conversion(model, tokenizer, report)


def _stream_source(cfg: ConvertConfig, path: str, config):
    """The checkpoint opened for streaming, or None when the in-memory path runs (streaming: false; a hub id; a
    folder without safetensors; names that do not match)."""
    if cfg.streaming is False:
        return None
    from .streaming import COMPUTE_DTYPE, NotStreamable, StreamSource

    why = None
    if not Path(path).is_dir():
        why = f"{cfg.model} is not a local folder"
    elif cfg.export == "hf" and cfg.streaming == "auto":
        # in memory, the export is checked against the upcycled model itself; streamed (streaming: true), against
        # the dense model, since the upcycled model is never whole
        return None
    else:
        try:
            return StreamSource.open(path, config, COMPUTE_DTYPE, storage=DTYPES[cfg.dtype],
                                     device=resolve_device(cfg.device))
        except NotStreamable as e:
            why = str(e)
    if cfg.streaming is True:
        raise UpcycleError(f"streaming: true, but the conversion cannot stream: {why}")
    return None


def write_output(model: nn.Module, directory: Path, cfg: ConvertConfig, tokenizer, probe_inputs: dict) -> dict:
    """The stock transformers checkpoint when asked and one fits (checked against our model), else the
    upcycle format. Returns what was written, for the report."""
    if cfg.export == "hf":
        try:
            target = export_target(model, cfg.export_class)
        except UpcycleError as e:
            if cfg.export_class != "auto":
                raise                      # a class the user named that does not fit is an error
            tqdm.write(f"[upcycle] not exported to a stock class: {e}")
            return {"format": "upcycle", "why_not_hf": str(e)} | _save_upcycle(model, directory, tokenizer)
        return export_hf(model, directory, input_ids=probe_inputs["input_ids"],   # exports are decoders
                         tolerance=cfg.check.export_tolerance, export_class=target.model_type, tokenizer=tokenizer)
    return _save_upcycle(model, directory, tokenizer)


def _save_upcycle(model: nn.Module, directory: Path, tokenizer) -> dict:
    save(model, directory, tokenizer=tokenizer)
    return {"format": "upcycle"}


class Phases:
    """A progress bar whose steps are the conversion's phases (the per-layer phase has its own bar)."""

    def __init__(self, total: int, progress: bool):
        self.bar = tqdm(total=total, desc="upcycle convert", unit="phase", disable=not progress)

    def __call__(self, message: str) -> None:
        self.bar.set_postfix_str(message)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()

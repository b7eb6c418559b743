"""`upcycle convert` on the streaming path: the folder written block by block, then the report (issue 13).

`converter.convert` comes here when the dense model is a local folder of safetensors and an output folder is
given (`streaming: auto`). The conversion itself is `streaming.convert_streaming`; this module decides what the
check promised, writes everything into the atomic temporary folder and refuses to rename it into place when a
promised check fails, with the same report and messages as the in-memory path (`converter.upcycle_model`).
"""

from __future__ import annotations

import json
import time

import yaml

from ..config import ConvertConfig, to_dict
from ..errors import UpcycleError
from ..files import json_text
from ..outputs import Claim
from ..version import __version__
from .calibration import real_tokens
from .preservation import make_probe, preservation_tolerance
from .report import (
    Allowance,
    CalibrationSummary,
    ConversionReport,
    ParameterCount,
    Parameters,
    Preservation,
    Timings,
    refuse_if_broken,
)
from .streaming import StreamSource, convert_streaming


def convert_streamed(source: StreamSource, cfg: ConvertConfig, method, args: dict, claim: Claim, *,
                     load_s: float, tokenizer, texts: list[str] | None, text_source: str,
                     calibration: list[dict] | None, calibration_source: str | None, progress: bool,
                     phases) -> ConversionReport:
    if method.needs_calibration and not calibration:
        raise UpcycleError(f"method {method.name!r} needs calibration data: pass --calibration FILE")
    promised = (method.preserves(args, cfg.moe.normalize_topk, cfg.moe.capacity_factor_eval is None)
                and cfg.moe.route_scale == 1.0)
    probe = make_probe(source.model, tokenizer, texts, cfg.check, cfg.seed, text_source)
    phases("checkpoint opened (streaming)")
    t = time.perf_counter()
    with claim.directory() as tmp:
        done = convert_streaming(source, cfg, method, args, tmp, tokenizer=tokenizer, probe=probe,
                                 calibration=calibration, promised=promised, progress=progress)
        phases(f"{len(done['targets'])} layers upcycled and written")
        report = _report(cfg, method, args, source, probe, done, promised, calibration, calibration_source)
        report.timings.load = load_s
        phases("preservation checked")
        refuse_if_broken(report, cfg.check.noise_factor)
        files = sorted(p.name for p in tmp.glob("*.safetensors"))
        target = done["export"]
        if target is None:
            report.export = {"format": "upcycle", "streamed": True, "files": files}
            if done["why_not_hf"]:
                report.export["why_not_hf"] = done["why_not_hf"]
        else:
            from .export import folded_scales

            config = json.loads((tmp / "config.json").read_text())
            report.export = {"format": "hf", "class": target.architecture, "model_type": target.model_type,
                             "folded_scales": folded_scales(done["planned"], target),
                             "dense_layers": config.get("mlp_only_layers", []), "streamed": True, "files": files,
                             "checked_against": "the dense model" if report.preservation.end_to_end else None}
        (tmp / "run_config.yaml").write_text(yaml.safe_dump(to_dict(cfg)))
        report.timings.write = time.perf_counter() - t - report.timings.upcycle - report.timings.check
        text = json_text(report.to_dict(), indent=2, where="upcycle_report.json")
        (tmp / "upcycle_report.json").write_text(text)   # last file written
    phases(f"written to {claim.out}")
    return report


def _report(cfg, method, args, source, probe, done, promised, calibration, calibration_source) -> ConversionReport:
    measured, noise = done["measured"], done["noise"]
    allowed = passed = None
    if measured is not None and promised:
        allowed = preservation_tolerance(measured["output_scale"], noise, source.dtype, cfg.check)
        passed = measured["max_abs_logit_diff"] <= allowed["allowed_max_abs_logit_diff"]
    layers = done["result"].layers
    if promised:
        layer_results = [layer.check.passed for layer in layers if layer.check is not None]
        passed = (passed is not False) and all(r is not False for r in layer_results)
        if measured is None and not layer_results:
            passed = None               # check.per_layer and check.end_to_end both off: nothing was checked
    shape = probe.inputs["input_ids"].shape if "input_ids" in probe.inputs else probe.inputs["pixel_values"].shape
    preservation = Preservation(
        promised=promised, tolerance=cfg.check.tolerance,
        relative_logit_diff=measured["relative_logit_diff"] if measured else None,
        relative_tolerance=cfg.check.relative_tolerance, passed=passed if promised else None,
        allowance=Allowance(**allowed) if allowed else None,
        compared_output=measured["compared_output"] if measured else "per-layer only",
        compared_rows=measured["compared_rows"] if measured else 0, probe_source=probe.source,
        probe_shape=list(shape), end_to_end=measured is not None)
    steps = done["result"].timings
    timings = Timings(dense_probe=done["timings"]["dense_probe"], rounding_noise=done["timings"]["rounding_noise"],
                      calibration=steps["calibration"], upcycle=steps["upcycle"],
                      check=steps["check"] + done["timings"].get("end_to_end_check", 0.0))
    planned = done["planned"]
    return ConversionReport(
        upcycle_version=__version__, method=method.name, paper=method.paper, method_args=args,
        source_model=cfg.model, model_class=type(planned).__name__, model_type=planned.config.model_type,
        moe_layers=[t.name for t in done["targets"]], moe=cfg.moe,
        parameters=Parameters(ParameterCount(**done["before"]), ParameterCount(**done["after"])),
        max_abs_logit_diff=measured["max_abs_logit_diff"] if measured else None,
        kl_to_dense=measured["kl_to_dense"] if measured else None, preservation=preservation,
        calibration=None if not calibration else CalibrationSummary(
            calibration_source, len(calibration), real_tokens(calibration), cfg.calibration.tokens),
        layers=layers, seed=cfg.seed, dtype=cfg.dtype, timings=timings, streamed=True)

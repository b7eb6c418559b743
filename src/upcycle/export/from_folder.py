"""`upcycle export IN OUT`: an upcycle-format folder loaded whole and written as a stock transformers checkpoint
(checked against it: `stock_folder.export_hf`), or with `--format gguf` as a GGUF file for llama.cpp (`gguf.py`,
checked by reading it back). Nothing here converts: the folder's report gains an `export` entry."""

from __future__ import annotations

from pathlib import Path

from ..checkpoint.upcycle_format import load
from ..config import CheckConfig
from ..errors import UpcycleError
from ..files import json_text, read_json_file
from ..outputs.claims import claim_output, inputs
from ..probe import make_probe
from .layout import export_target
from .stock_folder import export_hf


def export_folder(src: str | Path, out: str | Path, *, export_class: str = "auto", overwrite: bool = False,
                  tolerance: float = 1e-5, format: str = "hf", gguf_type: str = "f16") -> dict:
    """`upcycle export IN OUT`: an upcycle-format folder -> a stock checkpoint, checked against the original;
    with `format="gguf"`, OUT holds `model.gguf` (weights as `gguf_type`) for llama.cpp instead."""
    from ..checkpoint.loading import load_tokenizer
    from .gguf import FILE_TYPES

    if format not in ("hf", "gguf"):
        raise UpcycleError(f"export format must be hf or gguf, got {format!r}")
    if gguf_type not in FILE_TYPES:
        raise UpcycleError(f"GGUF weight type must be one of {sorted(FILE_TYPES)}, got {gguf_type!r}")
    src, out = Path(src), Path(out)
    with claim_output(out, kind="export", given=inputs(("upcycle folder", src)), overwrite=overwrite) as claim:
        if not src.is_dir():
            raise UpcycleError(f"{src} is not a folder; export takes a folder written by `upcycle convert`")
        model = load(src)
        target = export_target(model, export_class)          # refuse before writing anything
        tokenizer = load_tokenizer(src)
        if format == "gguf":
            from .gguf import gguf_plan

            gguf_plan(model, target, tokenizer, gguf_type)
        probe_ids = make_probe(model, None, None, CheckConfig(), seed=0).inputs["input_ids"]
        report_file = src / "upcycle_report.json"
        report = read_json_file(report_file, "conversion report") if report_file.is_file() else {}
        if not isinstance(report, dict):
            raise UpcycleError(f"{report_file} is not a conversion report (a JSON object)")
        with claim.directory() as tmp:
            if format == "gguf":
                from .gguf import write_gguf

                info = write_gguf(model, target, tmp / "model.gguf", tokenizer,
                                  out_type=gguf_type, name=src.resolve().name)
            else:
                info = export_hf(model, tmp, input_ids=probe_ids, tolerance=tolerance, export_class=export_class,
                                 tokenizer=tokenizer)
            report["export"] = {**info, "source_folder": str(src.resolve())}
            (tmp / "upcycle_report.json").write_text(json_text(report, indent=2, where="upcycle_report.json"))
    return report["export"]

"""`upcycle export IN OUT`: an upcycle folder written as a stock transformers MoE checkpoint, checked against it,
or (`--format gguf`) as a GGUF file for llama.cpp, checked by reading it back (docs/runtimes.md)."""

from __future__ import annotations

import argparse

from .flags import dumps


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..export.registry import STOCK_CLASSES

    parser.add_argument("src", help="folder written by `upcycle convert`")
    parser.add_argument("out", help="output folder (written atomically)")
    parser.add_argument("--export-class", dest="export_class", default="auto", choices=("auto", *STOCK_CLASSES))
    parser.add_argument("--format", default="hf", choices=("hf", "gguf"),
                        help="hf: a stock transformers checkpoint; gguf: OUT/model.gguf for llama.cpp")
    parser.add_argument("--gguf-type", dest="gguf_type", default=None, choices=("f32", "f16", "bf16", "q8_0", "q4_0"),
                        help="with --format gguf: weight type of the GGUF file (default f16; K-quants such as Q4_K: "
                             "llama.cpp's llama-quantize on an f16 file)")
    parser.add_argument("--overwrite", action="store_true")


def run(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    from ..errors import UpcycleError
    from ..export.from_folder import export_folder

    if args.gguf_type is not None and args.format != "gguf":      # it would be ignored: say so, write nothing
        raise UpcycleError(f"--gguf-type {args.gguf_type} is the weight type of a GGUF file: give --format gguf "
                           f"with it (--format {args.format} writes safetensors in the model's own dtype)")
    info = export_folder(args.src, args.out, export_class=args.export_class, overwrite=args.overwrite,
                         format=args.format, gguf_type=args.gguf_type or "f16")
    print(dumps(info))
    if args.format == "gguf":
        print(f"wrote {args.out}/model.gguf: runs with llama.cpp (llama-cli -m {args.out}/model.gguf)")
        if "note" in info:
            print(f"note: {info['note']}")
    else:
        print(f"wrote {args.out}: loads with transformers.AutoModelForCausalLM.from_pretrained")
    return 0

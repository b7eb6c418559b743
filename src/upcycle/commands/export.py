"""`upcycle export IN OUT`: an upcycle folder written as a stock transformers MoE checkpoint, checked against it."""

from __future__ import annotations

import argparse

from .flags import dumps


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..export.registry import STOCK_CLASSES

    parser.add_argument("src", help="folder written by `upcycle convert`")
    parser.add_argument("out", help="output folder (written atomically)")
    parser.add_argument("--export-class", dest="export_class", default="auto", choices=("auto", *STOCK_CLASSES))
    parser.add_argument("--overwrite", action="store_true")


def run(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    from ..conversion.stock_export import export_folder

    info = export_folder(args.src, args.out, export_class=args.export_class, overwrite=args.overwrite)
    print(dumps(info))
    print(f"wrote {args.out}: loads with transformers.AutoModelForCausalLM.from_pretrained")
    return 0

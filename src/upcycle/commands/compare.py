"""`upcycle compare MODEL OUT --methods ... --config RECIPE`: which method wins. Every method converts the same
model with the same placement, E and k, trains with one recipe and token budget, and is evaluated and diagnosed
against the dense model continued the same way (resumable; see `upcycle.compare.study`)."""

from __future__ import annotations

import argparse
import json
import sys

from ..compare.request import KEEP, CompareRequest
from ..compare.study import compare
from .flags import comma_list, quiet_transformers, whole_number


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="the dense model: 'default' (embedded SmolLM2-135M), a folder, or an id")
    parser.add_argument("out", help="the study folder (created, or an earlier compare folder to continue)")
    parser.add_argument("--methods", type=comma_list, required=True,
                        help="comma-separated methods (`upcycle methods`); the dense-continued baseline is added")
    parser.add_argument("--eesd", type=comma_list, help="comma-separated EESD settings: none or a coefficient, e.g. "
                                                        "none,1.0 (default: the recipe's own)")
    parser.add_argument("--seeds", type=comma_list, default=["0"], help="comma-separated seeds (default 0)")
    parser.add_argument("--config", required=True,
                        help="the training recipe every cell uses (a file, or a packaged train recipe by name)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a training key")
    parser.add_argument("--convert-config", dest="convert_config",
                        help="conversion recipe (placement, E, k, capacity): a file, or a packaged convert recipe "
                             "by name")
    parser.add_argument("--convert-set", dest="convert_set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a conversion key for every method, e.g. calibration.tokens=16384")
    for flag, key in (("--num-experts", "moe.num_experts"), ("--top-k", "moe.top_k"), ("--every", "placement.every"),
                      ("--calibration", "calibration.data"), ("--calibration-tokens", "calibration.tokens")):
        parser.add_argument(flag, dest=key, metavar=flag.lstrip("-").replace("-", "_").upper(),
                            help=f"the conversion key {key} for every method")
    parser.add_argument("--layers", dest="placement.layers", type=comma_list, metavar="LAYERS",
                        help="the conversion key placement.layers (comma-separated blocks)")
    parser.add_argument("--towers", dest="placement.towers", type=comma_list, metavar="TOWERS",
                        help="the conversion key placement.towers (CLIP: text,vision)")
    parser.add_argument("--method-set", dest="method_set", action="append", default=[], metavar="METHOD.KEY=VALUE",
                        help="a conversion key for one method, e.g. drop.method_args.ratio=0.25")
    parser.add_argument("--method-config", dest="method_config", action="append", default=[],
                        metavar="METHOD=RECIPE", help="one method's own training recipe (SPRI's two stages: "
                        "spri=smollm2-spri); --set applies on top")
    parser.add_argument("--keep", choices=KEEP, default="models",
                        help="what a finished cell keeps: all, models (default: the converted and the trained "
                             "model, not the checkpoints), results (JSON and logs only)")
    parser.add_argument("--stop-after", dest="stop_after", type=whole_number,
                        help="stop a cell's training at this step with a checkpoint (run again to resume)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars (the cell lines stay)")
    parser.add_argument("--dry-run", dest="dry_run", action="store_true",
                        help="print every cell and whether it finished before, after the checks a run makes before "
                             "its first cell (methods, arguments, recipes, OUT); writes nothing")


CONVERT_FLAG_KEYS = ("moe.num_experts", "moe.top_k", "placement.every", "calibration.data", "calibration.tokens",
                     "placement.layers", "placement.towers")


def request_from_args(args: argparse.Namespace) -> CompareRequest:
    """The flags as a request; a conversion flag is a --convert-set of its key (so its value is read by the
    key's type, as everywhere)."""
    sets = []
    for key in CONVERT_FLAG_KEYS:
        value = getattr(args, key)
        if value is not None:
            sets.append(f"{key}={json.dumps(value) if isinstance(value, list) else value}")
    return CompareRequest(model=args.model, methods=tuple(args.methods), train_recipe=args.config,
                          seeds=tuple(args.seeds), eesd=None if args.eesd is None else tuple(args.eesd),
                          train_sets=tuple(args.set), convert_recipe=args.convert_config,
                          convert_sets=tuple(sets) + tuple(args.convert_set), method_sets=tuple(args.method_set),
                          method_recipes=tuple(args.method_config), keep=args.keep)


def run(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    if args.quiet:
        quiet_transformers()
    command = " ".join(["upcycle", *(argv if argv is not None else sys.argv[1:])])
    if args.dry_run:
        from ..compare.plan import make_plan
        from ..outputs.job import dry_run_job

        print(dry_run_job(make_plan(request_from_args(args), args.out), args.out))
        return 0
    from ..training.trainer import train

    summary = compare(request_from_args(args), args.out, train=train, progress=not args.quiet,
                      stop_after=args.stop_after, command=command)
    print(json.dumps(summary, indent=2))
    return 130 if summary["interrupted"] else 0

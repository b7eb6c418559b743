"""`upcycle prune MODEL OUT --num-experts N`: every MoE layer keeps its N most salient experts (REAP by default;
frequency or random), the router rows and selection bias with them (`upcycle.resize`)."""

from __future__ import annotations

import argparse

from .flags import whole_number


def add_arguments(parser: argparse.ArgumentParser, *, grow: bool = False) -> None:
    parser.add_argument("model", help="an upcycle folder: a conversion's, or a training run's model/")
    parser.add_argument("out", help="output folder (written atomically)")
    parser.add_argument("--num-experts", type=whole_number, required=True, dest="num_experts",
                        help="the experts every MoE layer ends with")
    choices = ("utility", "uniform") if grow else ("reap", "frequency", "random")
    parser.add_argument("--by", choices=choices, default=choices[0],
                        help=("which experts are copied: the highest utility (load x output norm), or each in turn"
                              if grow else "which experts stay: REAP saliency, routing frequency, or a seeded draw")
                        + f" (default {choices[0]})")
    parser.add_argument("--calibration", help="text (.txt, .jsonl) the experts are scored on (default: the embedded "
                                              "Wikipedia train split)")
    parser.add_argument("--calibration-tokens", type=whole_number, default=4096, dest="calibration_tokens",
                        help="real tokens scored (default 4096)")
    parser.add_argument("--seed", type=whole_number, default=0)
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--quiet", action="store_true")


def run(args: argparse.Namespace, argv: list[str] | None = None, *, grow: bool = False) -> int:
    from ..resize.expert_count import ExpertCount
    from ..resize.run import resize

    resize(args.model, args.out, ExpertCount(args.num_experts, args.by, args.seed), grow=grow,
           calibration=args.calibration, tokens=args.calibration_tokens, overwrite=bool(args.overwrite),
           progress=not args.quiet)
    print(f"wrote {args.out} (report: {args.out}/resize_report.json)")
    return 0

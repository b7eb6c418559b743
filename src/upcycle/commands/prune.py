"""`upcycle prune MODEL OUT --num-experts N`: every MoE layer keeps its N most salient experts (REAP by default;
frequency or random), the router rows and selection bias with them (`upcycle.resize`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from .flags import seed_number, whole_number


def add_arguments(parser: argparse.ArgumentParser, *, grow: bool = False) -> None:
    parser.add_argument("model", help="an upcycle folder: a conversion's, or a training run's model/")
    parser.add_argument("out", help="output folder (written atomically)")
    parser.add_argument("--num-experts", type=whole_number, required=not grow, dest="num_experts",
                        help="the experts every MoE layer ends with")
    if grow:
        parser.add_argument("--add", metavar="FINETUNE",
                            help="instead of copies: one expert per layer from FINETUNE (a dense fine-tune of the "
                                 "model's base, same tokenizer), its router row from its text (--calibration)")
    choices = ("utility", "uniform") if grow else ("reap", "frequency", "random")
    parser.add_argument("--by", choices=choices, default=choices[0],
                        help=("which experts are copied: the highest utility (load x output norm), or each in turn"
                              if grow else "which experts stay: REAP saliency, routing frequency, or a seeded draw")
                        + f" (default {choices[0]})")
    if grow:
        parser.add_argument("--perturb", choices=("none", "noise", "drop"), default="none",
                            help="the copies perturbed so that training can part them: as the noise init does "
                                 "(Gaussian, std 0.01 of each matrix's) or as drop does (half the neurons "
                                 "re-drawn); default none (exact copies)")
    parser.add_argument("--calibration", help="text (.txt, .jsonl) the experts are scored on (default: the embedded "
                                              "Wikipedia train split)")
    parser.add_argument("--calibration-tokens", type=whole_number, default=4096, dest="calibration_tokens",
                        help="real tokens scored (default 4096)")
    parser.add_argument("--seed", type=seed_number, default=0,
                        help="draws the calibration tokens, random's experts and the copies' split and perturbation "
                             "(0 to 2^32-1)")
    parser.add_argument("--streaming", action="store_true",
                        help="a block at a time, for a model larger than memory (an upcycle folder)")
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--dry-run", action="store_true", dest="dry_run",
                        help="print the experts, parameters and bytes on disk before and after from the config and "
                             "checkpoint headers (no weight read), write nothing")


def run(args: argparse.Namespace, argv: list[str] | None = None, *, grow: bool = False) -> int:
    from ..errors import UpcycleError
    from ..resize.expert_count import ExpertCount
    from ..resize.run import CALIBRATION, resize

    add = getattr(args, "add", None)
    if grow and (add is None) == (args.num_experts is None):
        raise UpcycleError("grow takes --num-experts N (copies of its experts) or --add FINETUNE (one expert from "
                           "another fine-tune), one of them")
    request = ExpertCount(args.num_experts or 0, "add" if add else args.by, args.seed, add,
                          getattr(args, "perturb", "none"))
    budget = dataclasses.replace(CALIBRATION, data=args.calibration, tokens=args.calibration_tokens)
    if args.dry_run:
        from ..resize.run import dry_run

        print(dry_run(args.model, request, grow=grow, budget=budget, streaming=bool(args.streaming), out=args.out,
                      overwrite=bool(args.overwrite)))
        return 0
    report = resize(args.model, args.out, request, grow=grow, budget=budget,
                    streaming=bool(args.streaming), overwrite=bool(args.overwrite),
                    progress=not args.quiet)
    for line in report["warnings"]:          # a copy no token reaches: said where the user looks, not only in JSON
        print(f"WARNING: {line}", file=sys.stderr)
    print(json.dumps({k: report[k] for k in ("kind", "kl_to_source", "max_abs_logit_diff")}))
    print(f"wrote {args.out} (report: {args.out}/resize_report.json)")
    return 0

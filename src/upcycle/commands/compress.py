"""`upcycle compress MODEL OUT --rank R`: a full-expert upcycle folder rewritten with delta experts, each MoE
layer's experts as their mean plus a rank-R change each, and what that kept in compress_report.json
(`upcycle.resize.compress`)."""

from __future__ import annotations

import argparse
import json

from .flags import whole_number


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="an upcycle folder with full experts: a conversion's, or a training run's model/")
    parser.add_argument("out", help="output folder (written atomically)")
    parser.add_argument("--rank", type=whole_number, required=True,
                        help="the rank of each expert's change from the experts' mean, per matrix (at most "
                             "min(model width, expert width): that rank is exact)")
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--dry-run", action="store_true", dest="dry_run",
                        help="print the parameters before and after from the config and checkpoint headers (no "
                             "weight read), write nothing")


def run(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    from ..resize.compress import compress, dry_run

    if args.dry_run:
        print(dry_run(args.model, args.rank, args.out, overwrite=bool(args.overwrite)))
        return 0
    report = compress(args.model, args.out, args.rank, overwrite=bool(args.overwrite), progress=not args.quiet)
    print(json.dumps({k: report[k] for k in ("rank", "kl_to_source", "max_abs_logit_diff", "weight_bytes")}))
    print(f"wrote {args.out} (report: {args.out}/compress_report.json)")
    return 0

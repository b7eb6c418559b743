"""`upcycle analyze TARGET OUT`: what the experts learned, every docs/methods.md §5 metric per MoE layer, as
analysis.json, PNG figures and a self-contained report.html."""

from __future__ import annotations

import argparse
import json
import sys

from ..analyze.run import AnalyzeOptions, analyze
from ..data.source_texts import DEFAULT_SOURCES
from .flags import quiet_transformers, seed_number, whole_number


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = AnalyzeOptions()
    parser.add_argument("target", help="an upcycle folder, an exported stock MoE folder, or a training run folder")
    parser.add_argument("out", help="output folder: analysis.json, *.png, report.html (written atomically)")
    parser.add_argument("--source", action="append", default=[], metavar="NAME=FILE",
                        help="a named data source (.txt: blank-line separated documents; .jsonl: 'text' fields); "
                             "repeatable. Default: a merged model's own sources (their held-out text, as its "
                             "report records), else " + ", ".join(DEFAULT_SOURCES))
    parser.add_argument("--data", action="append", default=[], metavar="FILE",
                        help="a data source named after its file name (same as --source STEM=FILE)")
    parser.add_argument("--pairs", metavar="FILE",
                        help="encoders: a pair file (.jsonl/.jsonl.gz); its queries and documents are the sources, one "
                             "per pair source and role (default: the run's held-out pairs, else the packaged ones)")
    parser.add_argument("--dense", help="the dense model for KL(dense || model) (default: the dense source the "
                                        "target records; 'default' is the embedded SmolLM2)")
    parser.add_argument("--tokens", type=whole_number, default=d.tokens, help=f"tokens per source (default {d.tokens})")
    parser.add_argument("--sequence-length", dest="sequence_length", type=whole_number, default=d.sequence_length)
    parser.add_argument("--checkpoints", default=d.checkpoints,
                        help="for a run folder: all (default), last, or every:N")
    parser.add_argument("--output-tokens", dest="output_tokens", type=whole_number, default=d.output_tokens,
                        help=f"tokens each expert runs on for output similarity and RC (default {d.output_tokens})")
    parser.add_argument("--seed", type=seed_number, default=d.seed)
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.add_argument("--dry-run", dest="dry_run", action="store_true",
                        help="print the snapshots, sources and dense model the analysis would use, after the checks "
                             "it makes before loading a weight (OUT's too); writes nothing")


def run(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    if args.quiet:
        quiet_transformers()
    options = AnalyzeOptions(sources=tuple(args.source), data=tuple(args.data), dense=args.dense, tokens=args.tokens,
                             sequence_length=args.sequence_length, checkpoints=args.checkpoints,
                             output_tokens=args.output_tokens, seed=args.seed, pairs=args.pairs)
    command = " ".join(["upcycle", *(argv if argv is not None else sys.argv[1:])])
    if args.dry_run:
        from ..analyze.run import make_analysis_plan
        from ..outputs.job import dry_run_job

        print(dry_run_job(make_analysis_plan(args.target, options, command), args.out,
                          overwrite=bool(args.overwrite)))
        return 0
    result = analyze(args.target, args.out, options, overwrite=args.overwrite, progress=not args.quiet,
                     command=command)
    print(json.dumps({"out": args.out, "snapshots": len(result["snapshots"]),
                      "moe_layers": len(result["snapshots"][-1]["layers"]), "seconds": result["seconds"]}, indent=2))
    print(f"wrote {args.out}: open {args.out}/report.html")
    return 0

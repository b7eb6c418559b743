"""`upcycle eval MODEL`: held-out perplexity (causal LMs) or zero-shot and retrieval (CLIP), as JSON."""

from __future__ import annotations

import argparse
from pathlib import Path

from .flags import dumps, whole_number


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a model folder, a training run folder (its model/), or 'default'")
    parser.add_argument("--data", help="held-out data (default: held-out Wikipedia / the digits test split)")
    parser.add_argument("--tokens", type=whole_number, default=32768,
                        help="causal LMs: held-out tokens (default 32768)")
    parser.add_argument("--sequence-length", type=whole_number, default=256, dest="sequence_length")
    parser.add_argument("--out", help="also write the JSON to this file (written atomically; never an input)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace --out if it is an earlier `upcycle eval` result")


def run(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    from ..checkpoint.folders import Input, claim_output, inputs
    from ..data.assets import model_inputs
    from ..train.evaluate import evaluate_model

    path = Path(args.model).expanduser()
    if (path / "model").is_dir() and not (path / "config.json").exists():      # a training run folder
        path = path / "model"
    name = str(path) if path.exists() else args.model

    def evaluate() -> str:
        result = evaluate_model(name, data=args.data, tokens=args.tokens, sequence_length=args.sequence_length)
        return dumps({"format": "upcycle-eval", **result})

    if not args.out:
        print(evaluate())
        return 0
    given = [*(Input(what, p) for what, p in model_inputs(args.model)), *inputs(("held-out data", args.data))]
    with claim_output(args.out, kind="eval", given=given, overwrite=bool(args.overwrite), file=True) as claim:
        text = evaluate()
        claim.write_text(text + "\n")
    print(text)
    return 0

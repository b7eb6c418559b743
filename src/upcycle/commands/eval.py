"""`upcycle eval MODEL`: held-out perplexity (causal LMs), zero-shot and retrieval (CLIP), or pair retrieval
(text encoders: BERT, all-MiniLM-L6-v2), as JSON.

The held-out budget is training's (docs/training.md, "Watching a run"): `upcycle.config.EVAL_TOKENS` tokens in
rows of 256 by default, and for a training run folder the run's own `eval_tokens`, `sequence_length` and held-out
data, so `upcycle eval RUN` reads the number the run's last evaluation logged. Flags given win.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..config import EVAL_TOKENS, TASKS
from ..files import read_json_file
from .flags import dumps, quiet_transformers, whole_number

SEQUENCE_LENGTH = 256


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a model folder, a training run folder (its model/), or 'default'")
    parser.add_argument("--data", help="held-out data (default: a run's eval_data, else held-out Wikipedia / the "
                                       "digits test split)")
    parser.add_argument("--tokens", type=whole_number, default=None,
                        help=f"causal LMs: held-out tokens, in whole rows (default: a run's eval_tokens, else "
                             f"{EVAL_TOKENS}, training's default)")
    parser.add_argument("--sequence-length", type=whole_number, default=None, dest="sequence_length",
                        help=f"row length (default: a run's sequence_length, else {SEQUENCE_LENGTH})")
    parser.add_argument("--out", help="also write the JSON to this file (written atomically; never an input)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace --out if it is an earlier `upcycle eval` result")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--task", choices=TASKS, help="default: from the model (CLIP: clip, encoders: contrastive)")
    parser.add_argument("--device", default="auto",
                        help="where the model runs: auto (a GPU where torch sees one, as `upcycle train`), cpu, cuda "
                             "or cuda:N; always in float32, as a run's own evaluations")
    parser.add_argument("--pairs", type=whole_number,
                        help="contrastive: held-out pairs, a fixed sample (default: all of them)")


def run_defaults(run: Path) -> dict:
    """A training run's held-out budget, {"tokens", "sequence_length", "data"}, as its evaluations used it (the
    run config's keys; the held-out data as the absolute path inputs.json records); {} for a folder that is not a
    run or whose records do not read."""
    import yaml

    from ..runs.layout import INPUTS, RUN_CONFIG

    try:
        saved = yaml.safe_load((run / RUN_CONFIG).read_text())
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return {}
    if not isinstance(saved, dict):
        return {}
    try:
        recorded = read_json_file(run / INPUTS, "record of the run's inputs")
    except (OSError, ValueError, UnicodeDecodeError):
        recorded = {}
    data = recorded.get("eval_data") if isinstance(recorded, dict) and "eval_data" in recorded else \
        saved.get("eval_data")
    found = {"tokens": saved.get("eval_tokens"), "sequence_length": saved.get("sequence_length"), "data": data}
    # only values of the right type: a hand-edited config must not turn into a confusing error here
    return {k: v for k, v in found.items() if isinstance(v, str if k == "data" else int) and not isinstance(v, bool)}


def run(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    from ..core.devices import resolve_device
    from ..data.model_names import model_inputs
    from ..outputs.claims import Input, claim_output, inputs
    from ..tasks.evaluate import evaluate_model

    if args.quiet:
        quiet_transformers()
    resolve_device(args.device)          # a device that is not there is refused before any output is claimed
    path = Path(args.model).expanduser()
    defaults: dict = {}
    if (path / "model").is_dir() and not (path / "config.json").exists():      # a training run folder
        defaults = run_defaults(path)
        path = path / "model"
    name = str(path) if path.exists() else args.model
    data = args.data if args.data is not None else defaults.get("data")
    tokens = args.tokens if args.tokens is not None else defaults.get("tokens", EVAL_TOKENS)
    length = args.sequence_length if args.sequence_length is not None else defaults.get("sequence_length",
                                                                                        SEQUENCE_LENGTH)

    def evaluate() -> str:
        result = evaluate_model(name, data=data, tokens=tokens, sequence_length=length, progress=not args.quiet,
                                task=args.task, pairs=args.pairs, device=args.device)
        return dumps({"format": "upcycle-eval", **result})

    if not args.out:
        print(evaluate())
        return 0
    given = [*(Input(what, p) for what, p in model_inputs(args.model)), *inputs(("held-out data", data))]
    with claim_output(args.out, kind="eval", given=given, overwrite=bool(args.overwrite), file=True) as claim:
        text = evaluate()
        claim.write_text(text + "\n")
    print(text)
    return 0

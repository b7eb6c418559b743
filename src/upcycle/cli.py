"""The `upcycle` command line: a thin layer over convert, train, evaluate, analyze and the method registry.

Configuration precedence (DESIGN principle 8): dataclass defaults < `--config recipe.yaml` < explicit flags
< `--set key=value` (repeatable, dotted keys, YAML values).

A flag of `convert` or `train` that sets a config key is declared once, as a `ConfigFlag` naming its dotted key:
the parser takes the key's existence and default (shown in the help) from the config dataclass, and the flag's
text becomes the key's value through the config's own rule (`upcycle.config.coerce`: `--calibration-tokens 1e5`
means what `--set calibration.tokens=1e5` means), so a flag cannot drift from its key. The other flags (`--config`,
`--set`, `--overwrite`, ...) are about the run, not the config, and are listed in `RUN_FLAGS`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import signal
import sys
import typing
from dataclasses import dataclass
from pathlib import Path

from .config import (
    EXPORT_CLASS_NAMES,
    STORAGE_DTYPES,
    ConvertConfig,
    TrainConfig,
    build,
    coerce,
    load_recipe,
    refuse_overwrite_key,
    set_override,
)
from .errors import UpcycleError

# Only the standard library, YAML and the config are imported above: torch and transformers load inside `main`,
# where an interrupt while they load is a one-line message, not a traceback.


def _whole_number(text: str) -> int:
    """A run flag's integer (not a config key: --stop-after, eval's --tokens, tiny-clip's sizes), read by the
    config's number rule like every other number the user writes (`--tokens 1e5` is 100000)."""
    try:
        return coerce(text, int, "value")
    except UpcycleError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _comma_list(text: str) -> list[str]:
    """'1, 3,-1' -> ['1', '3', '-1']: the items stay text, read by the key's element type (coerce)."""
    return [x for x in text.replace(" ", "").split(",") if x]


@dataclass(frozen=True)
class ConfigFlag:
    """A command-line flag that sets the config key `key` (dotted, e.g. moe.top_k)."""

    flag: str
    key: str
    help: str
    split: bool = False                 # a comma-separated list (--layers 1,3,5) for a list-typed key


def config_field(cls: type, key: str) -> dataclasses.Field:
    """The dataclass field a dotted key names in config class `cls`; a key that is not there is a programming
    error, raised when the parser is built (so every command fails at once, not the flag silently)."""
    *sections, leaf = key.split(".")
    for section in sections:
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if section not in fields or not dataclasses.is_dataclass(typing.get_type_hints(cls)[section]):
            raise TypeError(f"flag for {key!r}: {cls.__name__} has no section {section!r}")
        cls = typing.get_type_hints(cls)[section]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if leaf not in fields:
        raise TypeError(f"flag for {key!r}: {cls.__name__} has no key {leaf!r}")
    return fields[leaf]


def flag_choices(cls: type, key: str) -> tuple[str, ...] | None:
    """The values a key's flag offers: the choices the config field declares (`upcycle.config.choice`)."""
    choices = config_field(cls, key).metadata.get("choices")
    return tuple(c for c in choices if isinstance(c, str)) if choices else None


def default_text(value) -> str:
    """A config default as the help shows it (as one would write it on the command line)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def _add_config_flags(parser: argparse.ArgumentParser, cls: type, flags: tuple[ConfigFlag, ...]) -> None:
    for f in flags:
        field = config_field(cls, f.key)
        default = field.default_factory() if field.default is dataclasses.MISSING else field.default
        shown = "" if default is None else f" (default {default_text(default)})"
        choices = flag_choices(cls, f.key)
        # no argparse default: a flag left out must not override the recipe (precedence); no argparse type:
        # the text is read by the key's type when the config is built
        parser.add_argument(f.flag, dest=f.key, help=f.help + shown, choices=choices,
                            type=_comma_list if f.split else None,
                            metavar=None if choices else f.flag.lstrip("-").replace("-", "_").upper())


CONVERT_FLAGS = (
    ConfigFlag("--method", "method", "initialization method (see `upcycle methods`)"),
    ConfigFlag("--num-experts", "moe.num_experts", "routed experts per MoE layer"),
    ConfigFlag("--top-k", "moe.top_k", "experts per token"),
    ConfigFlag("--every", "placement.every", "make every n-th block MoE: block i when (i+1) %% n == 0"),
    ConfigFlag("--layers", "placement.layers", "explicit block indices, e.g. 1,3,5 (negative from the end)",
               split=True),
    ConfigFlag("--towers", "placement.towers", "for CLIP: text, vision, or text,vision", split=True),
    ConfigFlag("--seed", "seed", "seed of every random draw: same seed, same bytes"),
    ConfigFlag("--dtype", "dtype", f"dtype of the written weights (the in-memory conversion computes in it): auto "
                                   f"(the checkpoint's own), {', '.join(STORAGE_DTYPES)}"),
    ConfigFlag("--device", "device", "where calibration, the methods' linear algebra and the checks run: auto (the "
                                     "GPU when torch sees one), cpu, cuda, cuda:N"),
    ConfigFlag("--probe-text", "check.text",
               "text or JSONL file for the preservation check (default: held-out Wikipedia)"),
    ConfigFlag("--calibration", "calibration.data", "text or JSONL ('text' field) file of calibration data for "
               "data-aware methods (cluster); default on the embedded model: the Wikipedia train split"),
    ConfigFlag("--calibration-tokens", "calibration.tokens", "FFN-input tokens kept per layer (reservoir-sampled)"),
    ConfigFlag("--export", "export", "upcycle (any architecture) or hf: a stock transformers MoE class where one "
               "fits"),
    ConfigFlag("--shard-size", "shard_size", "largest output shard (safetensors), e.g. 5GB, 500MB"),
    ConfigFlag("--export-class", "export_class", "with --export hf: auto (qwen2_moe, or qwen3_moe for Qwen3), "
               "or a class by name"),
    ConfigFlag("--router", "sources.router", "with --expert: the router's rows from random draws, the sources' "
               "prompts, or the centroid of each source's data"),
    ConfigFlag("--non-ffn", "sources.non_ffn", "with --expert: attention, embeddings and norms from the base, or "
               "the sources' average"),
)

TRAIN_FLAGS = (
    ConfigFlag("--task", "task", "default: from the model (CLIP models: clip)"),
    ConfigFlag("--data", "data", "causal_lm: .txt/.jsonl text (default on the embedded model: Wikipedia train "
               "split); clip: 'digits' (default), a JSONL of image/caption, or an image folder"),
    ConfigFlag("--eval-data", "eval_data", "held-out data of the same kind (default: the held-out Wikipedia "
               "split / the digits test split)"),
    ConfigFlag("--steps", "steps", "optimizer steps"),
    ConfigFlag("--batch-size", "batch_size", "global rows per optimizer step"),
    ConfigFlag("--grad-accum", "grad_accum", "micro-batches per step and process"),
    ConfigFlag("--sequence-length", "sequence_length", "packed row length"),
    ConfigFlag("--lr", "lr", "peak learning rate"),
    ConfigFlag("--schedule", "schedule", "decay after warmup"),
    ConfigFlag("--warmup", "warmup", "fraction of the steps with linear warmup"),
    ConfigFlag("--weight-decay", "weight_decay", "AdamW weight decay"),
    ConfigFlag("--train", "train", "what trains: comma-separated groups or globs (all, moe, routed, router, "
               "experts, dense, ...)", split=True),
    ConfigFlag("--checkpoint-every", "checkpoint_every", "steps between checkpoints (0: only at the end)"),
    ConfigFlag("--eval-every", "eval_every", "steps between evaluations (0: only before and after training)"),
    ConfigFlag("--mixed-precision", "mixed_precision", "auto: bf16 where the GPU has it, else no"),
    ConfigFlag("--seed", "seed", "seed of the run"),
)

# Flags (by dest) of `convert` and `train` that are about the run, not a config key; `model` is the positional
# that sets the key `model`.
RUN_FLAGS = {"convert": {"help", "out", "config", "set", "overwrite", "quiet", "dry_run", "expert"},
             "train": {"help", "out", "config", "set", "resume", "stop_after", "overwrite", "quiet"}}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="upcycle", description="Upcycle dense transformers into Mixture-of-Experts.")
    sub = parser.add_subparsers(dest="command", required=True)

    c = sub.add_parser("convert", help="convert a dense model to an MoE model and write it to OUT")
    c.add_argument("model", help="'default' (embedded SmolLM2-135M), a Hugging Face id, or a local folder")
    c.add_argument("out", nargs="?", help="output folder (written atomically; must not exist unless --overwrite)")
    _add_config_flags(c, ConvertConfig, CONVERT_FLAGS)
    c.add_argument("--config", help="YAML recipe with the same keys as the run config")
    c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config key, e.g. --set method_args.ratio=0.25 --set moe.capacity_factor_eval=2")
    c.add_argument("--expert", action="append", metavar="MODEL[=DATA]",
                   help="a fine-tune of MODEL whose FFNs become a routed expert, with its text file (repeat for each "
                        "source; replaces the recipe's sources.experts): MODEL is then the base of the merge")
    c.add_argument("--overwrite", action="store_true", default=None, help="replace OUT if it exists")
    c.add_argument("--quiet", action="store_true", help="no progress bars")
    c.add_argument("--dry-run", dest="dry_run", action="store_true",
                   help="print the plan (placement, parameters, output size, estimated peak memory) from the "
                        "model's config.json alone; reads no weights, writes nothing")

    x = sub.add_parser("export", help="write an upcycle-format folder as a stock transformers checkpoint")
    x.add_argument("src", help="folder written by `upcycle convert`")
    x.add_argument("out", help="output folder (written atomically)")
    x.add_argument("--export-class", dest="export_class", default="auto", choices=("auto", *EXPORT_CLASS_NAMES))
    x.add_argument("--overwrite", action="store_true")

    t = sub.add_parser("train", help="train a model (upcycled or dense) and write the run to OUT")
    t.add_argument("model", help="an upcycle folder, a dense transformers folder or id, or 'default'")
    t.add_argument("out", help="run folder: run_config.yaml, log.jsonl, checkpoints/, model/")
    _add_config_flags(t, TrainConfig, TRAIN_FLAGS)
    t.add_argument("--config", help="YAML training recipe (configs/train/)")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any key, e.g. --set regularizers.load_balance=0.01")
    t.add_argument("--resume", action="store_true", help="continue the run in OUT from its latest checkpoint")
    t.add_argument("--stop-after", type=_whole_number, dest="stop_after",
                   help="checkpoint and exit after this step (resume later to finish the schedule)")
    t.add_argument("--overwrite", action="store_true", default=None,
                   help="replace an existing OUT, once the new run holds its first checkpoint (never an input, a "
                   "folder holding one, or the current directory)")
    t.add_argument("--quiet", action="store_true", help="no progress bar")

    e = sub.add_parser("eval", help="held-out perplexity (causal LMs) or zero-shot + retrieval (CLIP), as JSON")
    e.add_argument("model", help="a model folder, a training run folder (its model/), or 'default'")
    e.add_argument("--data", help="held-out data (default: held-out Wikipedia / the digits test split)")
    e.add_argument("--tokens", type=_whole_number, default=32768, help="causal LMs: held-out tokens (default 32768)")
    e.add_argument("--sequence-length", type=_whole_number, default=256, dest="sequence_length")
    e.add_argument("--out", help="also write the JSON to this file (written atomically; never an input)")
    e.add_argument("--overwrite", action="store_true", help="replace --out if it is an earlier `upcycle eval` result")

    k = sub.add_parser("tiny-clip", help="write a small random dense CLIP (and caption tokenizer) to pretrain")
    k.add_argument("out", help="output folder (written atomically)")
    k.add_argument("--data", default="digits", help="captions to build the tokenizer from (default digits)")
    k.add_argument("--image-size", type=_whole_number, default=16, dest="image_size")
    k.add_argument("--patch-size", type=_whole_number, default=4, dest="patch_size")
    k.add_argument("--hidden-size", type=_whole_number, default=64, dest="hidden_size")
    k.add_argument("--layers", type=_whole_number, default=4)
    k.add_argument("--max-length", type=_whole_number, default=16, dest="max_length", help="caption tokens")
    k.add_argument("--seed", type=_whole_number, default=0)
    k.add_argument("--overwrite", action="store_true")

    from .analyze.command import add_arguments as add_analyze_arguments

    add_analyze_arguments(sub.add_parser("analyze", help="what the experts learned: every METHODS §5 metric per MoE "
                                         "layer as analysis.json, PNG figures and a self-contained report.html"),
                          _whole_number)

    from .compare.command import add_arguments as add_compare_arguments

    add_compare_arguments(sub.add_parser("compare", help="which method wins: convert with each method, train each "
                                         "with one recipe, evaluate and diagnose, against the dense model continued "
                                         "the same way; comparison.json, comparison.md and figures (resumable)"),
                          _whole_number, _comma_list)

    sub.add_parser("methods", help="list the upcycling methods, their arguments and papers")
    return parser


def _nested(data: dict, flags: dict) -> dict:
    """Put each non-None dotted flag into the nested recipe mapping."""
    for key, value in flags.items():
        if value is not None:
            node = data
            *parents, leaf = key.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
    return data


def _flag_values(args: argparse.Namespace, flags: tuple[ConfigFlag, ...]) -> dict:
    """{dotted key: the flag's text (or list of texts)} for every config flag, None where not given."""
    return {f.key: getattr(args, f.key) for f in flags}


def convert_config(args: argparse.Namespace) -> ConvertConfig:
    data = load_recipe(args.config)
    refuse_overwrite_key(data, f"recipe {args.config}")
    data["model"] = args.model
    if args.expert:
        experts = [dict(zip(("model", "data"), text.split("=", 1), strict=False)) for text in args.expert]
        data.setdefault("sources", {})["experts"] = experts
    _nested(data, _flag_values(args, CONVERT_FLAGS))
    _apply_sets(data, args.set)
    _experts_count(data)
    return build(ConvertConfig, data)


def _experts_count(data: dict) -> None:
    """A merge of several sources has as many routed experts as its entries make (their `count`, 1 by
    default): moe.num_experts is filled in when the recipe and the flags leave it out."""
    sources = data.get("sources")
    experts = sources.get("experts") if isinstance(sources, dict) else None
    if not isinstance(experts, list) or not experts:
        return
    moe = data.setdefault("moe", {})
    if isinstance(moe, dict) and "num_experts" not in moe:
        counts = [e.get("count", 1) if isinstance(e, dict) else 1 for e in experts]
        if all(isinstance(c, int) for c in counts):
            moe["num_experts"] = sum(counts)


def _apply_sets(data: dict, assignments: list[str]) -> None:
    for assignment in assignments:
        refuse_overwrite_key({assignment.split("=", 1)[0].strip(): None}, f"--set {assignment}")
        set_override(data, assignment)


def train_config(args: argparse.Namespace) -> TrainConfig:
    if args.resume and args.config is None:   # the run's own config, with any flags on top (which must agree)
        from .train.run_folder import saved_config

        data = saved_config(Path(args.out))
    else:
        data = load_recipe(args.config)
        refuse_overwrite_key(data, f"recipe {args.config}")
    data["model"] = args.model
    _nested(data, _flag_values(args, TRAIN_FLAGS))
    _apply_sets(data, args.set)
    return build(TrainConfig, data)


def _train(args: argparse.Namespace) -> int:
    from .train.trainer import train

    cfg = train_config(args)
    summary = train(cfg, args.out, resume=args.resume, overwrite=bool(args.overwrite), stop_after=args.stop_after,
                    progress=not args.quiet, recipe=args.config)
    if summary["interrupted"]:
        print(f"upcycle: interrupted at step {summary['step']}; checkpoint {summary['checkpoint']} "
              f"(continue with --resume)", file=sys.stderr)
        return 130
    print(dumps(summary))
    return 0


def dumps(result: dict) -> str:
    """JSON as the commands print and write it: valid JSON, so a NaN or infinite number is an error (a model or
    a run that produced one is reported, not written as the invalid token NaN)."""
    try:
        return json.dumps(result, indent=2, allow_nan=False)
    except ValueError:
        bad = [key for key, value in _leaves(result) if isinstance(value, float) and not math.isfinite(value)]
        raise NonFiniteResult(f"the result holds non-finite numbers ({', '.join(bad[:5])}): the model's outputs "
                              f"are not finite (NaN or infinite weights or activations)") from None


class NonFiniteResult(UpcycleError):
    """A computed result that is NaN or infinite."""


def _leaves(value, prefix: str = ""):
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, f"{prefix}{key}.")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _leaves(item, f"{prefix}{i}.")
    else:
        yield prefix.rstrip("."), value


def _eval(args: argparse.Namespace) -> int:
    from .data.assets import model_inputs
    from .outputs import Input, claim_output, inputs
    from .train.evaluate import evaluate_model

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


def _tiny_clip(args: argparse.Namespace) -> int:
    from .data.clip_pairs import caption_tokenizer, load_pairs
    from .data.tiny_clip import check_sizes, tiny_clip
    from .outputs import claim_output, inputs

    sizes = dict(image_size=args.image_size, patch_size=args.patch_size, hidden_size=args.hidden_size,
                 layers=args.layers, max_length=args.max_length, seed=args.seed)
    check_sizes(**sizes)
    with claim_output(args.out, kind="tiny-clip", given=inputs(("caption data", args.data)),
                      overwrite=args.overwrite) as claim:
        pairs = load_pairs(args.data, split="train")
        tokenizer = caption_tokenizer(pairs.captions, max_length=args.max_length)
        model = tiny_clip(tokenizer, **sizes)
        with claim.directory() as tmp:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.out}: dense CLIP, {params:,} parameters, {len(tokenizer)} caption tokens")
    return 0


def _methods() -> None:
    from .methods import METHODS

    for method in METHODS.values():
        print(f"{method.name}: {method.summary}")
        print(f"    paper: {method.paper}")
        print(f"    needs calibration data: {'yes' if method.needs_calibration else 'no'}")
        for arg in method.args.values():
            print(f"    --set method_args.{arg.name}={arg.describe()}   (default {arg.default!r})")


def main(argv: list[str] | None = None) -> int:
    """The `upcycle` command: 0 on success, 2 for bad input (one line on stderr, no traceback), 130 when
    interrupted (Ctrl-C at any point after start-up, loading torch included)."""
    # SIGTERM becomes SystemExit so the atomic writer removes its temporary folder on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return _run(_parser().parse_args(argv), argv)
    except UpcycleError as e:
        print(f"upcycle: error: {_message(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:     # train says what OUT holds; elsewhere outputs are written atomically
        print(f"upcycle: interrupted; {e or 'nothing was written'}", file=sys.stderr)
        return 130


def _message(error: Exception) -> str:
    """An error as one line of bounded length (a message quoting a huge value stays readable)."""
    text = " ".join(str(error).split())
    return text if len(text) <= 2000 else text[:2000] + f" ... ({len(text):,} characters)"


def _run(args: argparse.Namespace, argv: list[str] | None) -> int:
    if args.command == "methods":
        _methods()
        return 0
    if args.command == "train":
        return _train(args)
    if args.command == "eval":
        return _eval(args)
    if args.command == "tiny-clip":
        return _tiny_clip(args)
    if args.command == "compare":
        from .compare.command import run_command as run_compare

        return run_compare(args, argv)
    if args.command == "analyze":
        from .analyze.command import run_command

        return run_command(args, argv)
    if args.command == "export":
        from .conversion.export import export_folder

        info = export_folder(args.src, args.out, export_class=args.export_class, overwrite=args.overwrite)
        print(dumps(info))
        print(f"wrote {args.out}: loads with transformers.AutoModelForCausalLM.from_pretrained")
        return 0
    return _convert(args)


def _convert(args: argparse.Namespace) -> int:
    from .conversion.converter import convert

    if args.quiet:
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
    cfg = convert_config(args)
    if args.dry_run and cfg.sources.experts:
        raise UpcycleError("--dry-run does not plan a merge of several sources yet")
    if args.dry_run:
        from .conversion.plan import describe, dry_run

        report = dry_run(cfg)
        print(describe(report))
        print(dumps(report))
        return 0
    if args.out is None:
        raise UpcycleError("convert needs an output folder OUT (or --dry-run)")
    result = convert(cfg, args.out, overwrite=bool(args.overwrite), progress=not args.quiet, recipe=args.config)
    r = result.report
    summary = {k: r[k] for k in ("method", "num_moe_layers", "num_experts", "top_k", "max_abs_logit_diff",
                                 "kl_to_dense")}
    summary["parameters"] = r["parameters"]
    summary["preservation_passed"] = r["preservation"]["passed"]
    summary["export"] = r["export"]
    print(dumps(summary))
    print(f"wrote {args.out} (report: {args.out}/upcycle_report.json)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

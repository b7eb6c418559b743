"""The `upcycle` command line: a thin layer over convert, train, evaluate and the method registry.

Configuration precedence (DESIGN principle 8): dataclass defaults < `--config recipe.yaml` < explicit flags
< `--set key=value` (repeatable, dotted keys, YAML values).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys

from .config import ConvertConfig, TrainConfig, build, load_recipe, refuse_overwrite_key, set_override
from .errors import UpcycleError


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="upcycle", description="Upcycle dense transformers into Mixture-of-Experts.")
    sub = parser.add_subparsers(dest="command", required=True)

    c = sub.add_parser("convert", help="convert a dense model to an MoE model and write it to OUT")
    c.add_argument("model", help="'default' (embedded SmolLM2-135M), a Hugging Face id, or a local folder")
    c.add_argument("out", help="output folder (written atomically; must not exist unless --overwrite)")
    c.add_argument("--method", help="initialization method (see `upcycle methods`); default copy")
    c.add_argument("--num-experts", type=int, dest="num_experts", help="routed experts per MoE layer (default 8)")
    c.add_argument("--top-k", type=int, dest="top_k", help="experts per token (default 2)")
    c.add_argument("--every", type=int, help="make every n-th block MoE: block i when (i+1) %% n == 0")
    c.add_argument("--layers", type=_int_list, help="explicit block indices, e.g. 1,3,5 (negative from the end)")
    c.add_argument("--towers", help="for CLIP: text, vision, or text,vision")
    c.add_argument("--seed", type=int, help="seed of every random draw (default 0): same seed, same bytes")
    c.add_argument("--dtype", help="float32 (default), bfloat16 or float16")
    c.add_argument("--probe-text", dest="probe_text",
                   help="text or JSONL file for the preservation check (default: held-out Wikipedia)")
    c.add_argument("--calibration", help="text or JSONL ('text' field) file of calibration data for data-aware "
                   "methods (cluster); default on the embedded model: the Wikipedia train split")
    c.add_argument("--calibration-tokens", type=int, dest="calibration_tokens",
                   help="FFN-input tokens kept per layer (reservoir-sampled; default 65536)")
    c.add_argument("--config", help="YAML recipe with the same keys as the run config")
    c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config key, e.g. --set method_args.ratio=0.25 --set moe.capacity_factor_eval=2")
    c.add_argument("--export", choices=["upcycle", "hf"],
                   help="upcycle (default; any architecture) or hf: a stock transformers MoE class where one fits")
    c.add_argument("--export-class", dest="export_class", choices=["auto", "qwen2_moe", "qwen3_moe", "mixtral"],
                   help="with --export hf: auto (qwen2_moe, or qwen3_moe for Qwen3), or mixtral")
    c.add_argument("--overwrite", action="store_true", default=None, help="replace OUT if it exists")
    c.add_argument("--quiet", action="store_true", help="no progress bars")

    x = sub.add_parser("export", help="write an upcycle-format folder as a stock transformers checkpoint")
    x.add_argument("src", help="folder written by `upcycle convert`")
    x.add_argument("out", help="output folder (written atomically)")
    x.add_argument("--export-class", dest="export_class", default="auto",
                   choices=["auto", "qwen2_moe", "qwen3_moe", "mixtral"])
    x.add_argument("--overwrite", action="store_true")

    t = sub.add_parser("train", help="train a model (upcycled or dense) and write the run to OUT")
    t.add_argument("model", help="an upcycle folder, a dense transformers folder or id, or 'default'")
    t.add_argument("out", help="run folder: run_config.yaml, log.jsonl, checkpoints/, model/")
    t.add_argument("--task", choices=["causal_lm", "clip"], help="default: from the model (CLIP models: clip)")
    t.add_argument("--data", help="causal_lm: .txt/.jsonl text (default on the embedded model: Wikipedia train "
                   "split); clip: 'digits' (default), a JSONL of image/caption, or an image folder")
    t.add_argument("--eval-data", dest="eval_data", help="held-out data of the same kind (default: the held-out "
                   "Wikipedia split / the digits test split)")
    t.add_argument("--steps", type=int, help="optimizer steps (default 100)")
    t.add_argument("--batch-size", type=int, dest="batch_size", help="global rows per optimizer step (default 8)")
    t.add_argument("--grad-accum", type=int, dest="grad_accum", help="micro-batches per step and process")
    t.add_argument("--sequence-length", type=int, dest="sequence_length", help="packed row length (default 256)")
    t.add_argument("--lr", type=float, help="peak learning rate (default 5e-5)")
    t.add_argument("--schedule", choices=["linear", "cosine", "constant"], help="decay after warmup")
    t.add_argument("--warmup", type=float, help="fraction of the steps with linear warmup (default 0.02)")
    t.add_argument("--weight-decay", type=float, dest="weight_decay", help="AdamW weight decay (default 0)")
    t.add_argument("--train", help="what trains: comma-separated groups or globs (all, moe, routed, router, "
                   "experts, dense, ...)")
    t.add_argument("--checkpoint-every", type=int, dest="checkpoint_every", help="steps between checkpoints")
    t.add_argument("--eval-every", type=int, dest="eval_every", help="steps between evaluations")
    t.add_argument("--mixed-precision", dest="mixed_precision", choices=["auto", "no", "bf16", "fp16"])
    t.add_argument("--seed", type=int)
    t.add_argument("--config", help="YAML training recipe (configs/train/)")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any key, e.g. --set regularizers.load_balance=0.01")
    t.add_argument("--resume", action="store_true", help="continue the run in OUT from its latest checkpoint")
    t.add_argument("--stop-after", type=int, dest="stop_after",
                   help="checkpoint and exit after this step (resume later to finish the schedule)")
    t.add_argument("--overwrite", action="store_true", default=None,
                   help="replace an existing OUT, once the new run holds its first checkpoint (never an input, a "
                   "folder holding one, or the current directory)")
    t.add_argument("--quiet", action="store_true", help="no progress bar")

    e = sub.add_parser("eval", help="held-out perplexity (causal LMs) or zero-shot + retrieval (CLIP), as JSON")
    e.add_argument("model", help="a model folder, a training run folder (its model/), or 'default'")
    e.add_argument("--data", help="held-out data (default: held-out Wikipedia / the digits test split)")
    e.add_argument("--tokens", type=int, default=32768, help="causal LMs: held-out tokens (default 32768)")
    e.add_argument("--sequence-length", type=int, default=256, dest="sequence_length")
    e.add_argument("--out", help="also write the JSON to this file")

    k = sub.add_parser("tiny-clip", help="write a small random dense CLIP (and caption tokenizer) to pretrain")
    k.add_argument("out", help="output folder (written atomically)")
    k.add_argument("--data", default="digits", help="captions to build the tokenizer from (default digits)")
    k.add_argument("--image-size", type=int, default=16, dest="image_size")
    k.add_argument("--patch-size", type=int, default=4, dest="patch_size")
    k.add_argument("--hidden-size", type=int, default=64, dest="hidden_size")
    k.add_argument("--layers", type=int, default=4)
    k.add_argument("--max-length", type=int, default=16, dest="max_length", help="caption tokens")
    k.add_argument("--seed", type=int, default=0)
    k.add_argument("--overwrite", action="store_true")

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


def convert_config(args: argparse.Namespace) -> ConvertConfig:
    data = load_recipe(args.config)
    refuse_overwrite_key(data, f"recipe {args.config}")
    flags = {"method": args.method, "seed": args.seed, "dtype": args.dtype,
             "export": args.export, "export_class": args.export_class,
             "moe.num_experts": args.num_experts, "moe.top_k": args.top_k, "placement.every": args.every,
             "placement.layers": args.layers, "check.text": args.probe_text,
             "calibration.data": args.calibration, "calibration.tokens": args.calibration_tokens,
             "placement.towers": args.towers.split(",") if args.towers else None}
    data["model"] = args.model
    _nested(data, flags)
    _apply_sets(data, args.set)
    return build(ConvertConfig, data)


def _apply_sets(data: dict, assignments: list[str]) -> None:
    for assignment in assignments:
        refuse_overwrite_key({assignment.split("=", 1)[0].strip(): None}, f"--set {assignment}")
        set_override(data, assignment)


def train_config(args: argparse.Namespace) -> TrainConfig:
    if args.resume and args.config is None:   # the run's own config, with any flags on top (which must agree)
        from pathlib import Path

        from .train.trainer import saved_config

        data = saved_config(Path(args.out))
    else:
        data = load_recipe(args.config)
        refuse_overwrite_key(data, f"recipe {args.config}")
    data["model"] = args.model
    names = ("task", "data", "eval_data", "steps", "batch_size", "grad_accum", "sequence_length", "lr", "schedule",
             "warmup", "weight_decay", "checkpoint_every", "eval_every", "mixed_precision", "seed")
    flags = {name: getattr(args, name) for name in names}
    flags["train"] = [x for x in args.train.split(",") if x] if args.train else None
    _nested(data, flags)
    _apply_sets(data, args.set)
    return build(TrainConfig, data)


def _train(args: argparse.Namespace) -> int:
    from .train.trainer import train

    cfg = train_config(args)
    summary = train(cfg, args.out, resume=args.resume, overwrite=bool(args.overwrite), stop_after=args.stop_after,
                    progress=not args.quiet)
    if summary["interrupted"]:
        print(f"upcycle: interrupted at step {summary['step']}; checkpoint {summary['checkpoint']} "
              f"(continue with --resume)", file=sys.stderr)
        return 130
    print(json.dumps(summary, indent=2))
    return 0


def _eval(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .train.evaluate import evaluate_model

    path = Path(args.model)
    if (path / "model").is_dir():      # a training run folder
        path = path / "model"
    if args.out:                       # found before the evaluation runs, not after
        target = Path(args.out)
        if target.is_dir():
            raise UpcycleError(f"--out {args.out} is a folder; give a file name for the JSON")
        if not target.parent.is_dir():
            raise UpcycleError(f"--out {args.out}: the folder {target.parent} does not exist")
    result = evaluate_model(str(path) if path.exists() else args.model, data=args.data, tokens=args.tokens,
                            sequence_length=args.sequence_length)
    text = json.dumps(result, indent=2)
    if args.out:
        tmp = Path(args.out).with_name(f".{Path(args.out).name}.tmp")
        tmp.write_text(text + "\n")
        tmp.replace(args.out)
    print(text)
    return 0


def _tiny_clip(args: argparse.Namespace) -> int:
    from .data.clip_pairs import caption_tokenizer, load_pairs
    from .data.tiny_clip import tiny_clip
    from .files import atomic_directory, check_output_location

    check_output_location(args.out, overwrite=args.overwrite)

    pairs = load_pairs(args.data, split="train")
    tokenizer = caption_tokenizer(pairs.captions, max_length=args.max_length)
    model = tiny_clip(tokenizer, image_size=args.image_size, patch_size=args.patch_size,
                      hidden_size=args.hidden_size, layers=args.layers, max_length=args.max_length, seed=args.seed)
    with atomic_directory(args.out, overwrite=args.overwrite) as tmp:
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
    args = _parser().parse_args(argv)
    # SIGTERM becomes SystemExit so the atomic writer removes its temporary folder on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        if args.command == "methods":
            _methods()
            return 0
        if args.command == "train":
            return _train(args)
        if args.command == "eval":
            return _eval(args)
        if args.command == "tiny-clip":
            return _tiny_clip(args)
        if args.command == "export":
            from .conversion.export import export_folder

            info = export_folder(args.src, args.out, export_class=args.export_class, overwrite=args.overwrite)
            print(json.dumps(info, indent=2))
            print(f"wrote {args.out}: loads with transformers.AutoModelForCausalLM.from_pretrained")
            return 0
        from .conversion.converter import convert

        if args.quiet:
            from transformers.utils import logging as hf_logging
            hf_logging.disable_progress_bar()
        cfg = convert_config(args)
        result = convert(cfg, args.out, overwrite=bool(args.overwrite), progress=not args.quiet)
    except UpcycleError as e:
        print(f"upcycle: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:     # train says what OUT holds; elsewhere outputs are written atomically
        print(f"upcycle: interrupted; {e or 'nothing was written'}", file=sys.stderr)
        return 130
    r = result.report
    summary = {k: r[k] for k in ("method", "num_moe_layers", "num_experts", "top_k", "max_abs_logit_diff",
                                 "kl_to_dense")}
    summary["parameters"] = r["parameters"]
    summary["preservation_passed"] = r["preservation"]["passed"]
    summary["export"] = r["export"]
    print(json.dumps(summary, indent=2))
    print(f"wrote {args.out} (report: {args.out}/upcycle_report.json)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The `upcycle` command line: a thin layer over `upcycle.convert` and the method registry.

Configuration precedence (DESIGN principle 8): dataclass defaults < `--config recipe.yaml` < explicit flags
< `--set key=value` (repeatable, dotted keys, YAML values).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys

from .config import ConvertConfig, build, load_recipe, set_override
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

    sub.add_parser("methods", help="list the upcycling methods, their arguments and papers")
    return parser


def convert_config(args: argparse.Namespace) -> ConvertConfig:
    data = load_recipe(args.config)
    flags = {"method": args.method, "seed": args.seed, "dtype": args.dtype, "overwrite": args.overwrite,
             "export": args.export, "export_class": args.export_class,
             "moe.num_experts": args.num_experts, "moe.top_k": args.top_k, "placement.every": args.every,
             "placement.layers": args.layers, "check.text": args.probe_text,
             "calibration.data": args.calibration, "calibration.tokens": args.calibration_tokens,
             "placement.towers": args.towers.split(",") if args.towers else None}
    data["model"] = args.model
    for key, value in flags.items():
        if value is not None:
            node = data
            *parents, leaf = key.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
    for assignment in args.set:
        set_override(data, assignment)
    return build(ConvertConfig, data)


def _methods() -> None:
    from .methods import METHODS

    for method in METHODS.values():
        print(f"{method.name}: {method.summary}")
        print(f"    paper: {method.paper}")
        print(f"    needs calibration data: {'yes' if method.needs_calibration else 'no'}")
        for arg in method.args.values():
            print(f"    --set method_args.{arg.name}=<{arg.type.__name__}>   (default {arg.default!r})")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # SIGTERM becomes SystemExit so the atomic writer removes its temporary folder on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        if args.command == "methods":
            _methods()
            return 0
        if args.command == "export":
            from .export import export_folder

            info = export_folder(args.src, args.out, export_class=args.export_class, overwrite=args.overwrite)
            print(json.dumps(info, indent=2))
            print(f"wrote {args.out}: loads with transformers.AutoModelForCausalLM.from_pretrained")
            return 0
        from .convert import convert

        if args.quiet:
            from transformers.utils import logging as hf_logging
            hf_logging.disable_progress_bar()
        cfg = convert_config(args)
        result = convert(cfg, args.out, progress=not args.quiet)
    except UpcycleError as e:
        print(f"upcycle: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("upcycle: interrupted; nothing was written", file=sys.stderr)
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

"""`upcycle convert MODEL OUT`: a dense model upcycled into an MoE model, checked, and written to OUT."""

from __future__ import annotations

import argparse

from ..config import STORAGE_DTYPES, ConvertConfig
from ..config_reader import build, load_recipe, recipe_names, recipe_path, refuse_overwrite_key
from ..errors import UpcycleError
from .flags import ConfigFlag, add_config_flags, apply_sets, dumps, flag_values, nested, quiet_transformers


def _export_classes() -> tuple[str, ...]:
    from ..export.registry import STOCK_CLASSES

    return ("auto", *STOCK_CLASSES)


CONFIG_FLAGS = (
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
               "or a class by name", choices=_export_classes),
    ConfigFlag("--router", "sources.router", "with --expert: the router's rows from random draws, the sources' "
               "prompts, or the centroid of each source's data"),
    ConfigFlag("--non-ffn", "sources.non_ffn", "with --expert: attention, embeddings and norms from the base, or "
               "the sources' average"),
)
# Flags (by dest) that are about the run, not a config key; `model` is the positional that sets the key `model`.
RUN_FLAGS = {"help", "out", "config", "set", "overwrite", "quiet", "dry_run", "expert"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="'default' (embedded SmolLM2-135M), a Hugging Face id, or a local folder")
    parser.add_argument("out", nargs="?", help="output folder (written atomically; must not exist unless --overwrite)")
    add_config_flags(parser, ConvertConfig, CONFIG_FLAGS)
    parser.add_argument("--config", help=f"YAML recipe with the same keys as the run config: a file, or a packaged "
                                         f"recipe by name ({', '.join(recipe_names('convert'))})")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override any config key, e.g. --set method_args.ratio=0.25 "
                             "--set moe.capacity_factor_eval=2")
    parser.add_argument("--expert", action="append", metavar="MODEL[=DATA]",
                        help="a fine-tune of MODEL whose FFNs become a routed expert, with its text file (repeat "
                             "for each source; replaces the recipe's sources.experts): MODEL is then the base of the "
                             "merge")
    parser.add_argument("--overwrite", action="store_true", default=None,
                        help="replace OUT if upcycle wrote it (never an input, or a folder of yours)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.add_argument("--dry-run", dest="dry_run", action="store_true",
                        help="print the plan (placement, parameters, output size, estimated peak memory) from the "
                             "model's config.json alone; reads no weights, writes nothing")


def convert_config(args: argparse.Namespace) -> ConvertConfig:
    data = load_recipe(recipe_path(args.config, "convert"))
    refuse_overwrite_key(data, f"recipe {args.config}")
    data["model"] = args.model
    if args.expert:
        experts = [dict(zip(("model", "data"), text.split("=", 1), strict=False)) for text in args.expert]
        data.setdefault("sources", {})["experts"] = experts
    nested(data, flag_values(args, CONFIG_FLAGS))
    apply_sets(data, args.set)
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


def run(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    from ..conversion.pipeline import convert

    if args.quiet:
        quiet_transformers()
    cfg = convert_config(args)
    if args.dry_run and cfg.sources.experts:
        raise UpcycleError("--dry-run does not plan a merge of several sources yet")
    # the recipe's file (a packaged one for a name) is an input, which OUT must not be
    recipe = None if args.config is None else str(recipe_path(args.config, "convert"))
    if args.dry_run:
        from ..conversion.dry_run import dry_run
        from ..conversion.plan import make_plan

        text, report = dry_run(make_plan(cfg, writing=True, build=False, recipe=recipe), args.out,
                               overwrite=bool(args.overwrite))
        print(text)
        print(dumps(report))
        return 0
    if args.out is None:
        raise UpcycleError("convert needs an output folder OUT (or --dry-run)")
    report = convert(cfg, args.out, overwrite=bool(args.overwrite), progress=not args.quiet,
                     recipe=recipe).report.to_dict()
    summary = {k: report[k] for k in ("method", "num_moe_layers", "num_experts", "top_k", "max_abs_logit_diff",
                                      "kl_to_dense")}
    summary["parameters"] = report["parameters"]
    summary["preservation_passed"] = report["preservation"]["passed"]
    summary["export"] = report["export"]
    print(dumps(summary))
    print(f"wrote {args.out} (report: {args.out}/upcycle_report.json)")
    return 0

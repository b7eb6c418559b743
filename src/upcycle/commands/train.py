"""`upcycle train MODEL OUT`: train a model (upcycled or dense) and write the run to OUT (or resume it)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..config import TrainConfig
from ..config_reader import build, load_recipe, recipe_names, recipe_path, refuse_overwrite_key
from .flags import ConfigFlag, add_config_flags, apply_sets, dumps, flag_values, nested, whole_number

CONFIG_FLAGS = (
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
    ConfigFlag("--report-to", "report_to", "also send every log line to TensorBoard (OUT/tensorboard/) or "
               "Weights & Biases (OUT/wandb/; WANDB_MODE=offline needs no network)"),
    ConfigFlag("--mixed-precision", "mixed_precision", "auto: bf16 where the GPU has it, else no"),
    ConfigFlag("--activation-checkpointing", "activation_checkpointing", "recompute activations in the backward "
               "pass: none, full (every block) or moe (upcycle's MoE layers)"),
    ConfigFlag("--memory-budget", "memory_budget", "bytes each process may take (e.g. 70GB; auto: the device's "
               "memory), checked by the memory plan before the weights load"),
    ConfigFlag("--seed", "seed", "seed of the run"),
)
# Flags (by dest) that are about the run, not a config key; `model` is the positional that sets the key `model`.
RUN_FLAGS = {"help", "out", "config", "set", "resume", "stop_after", "overwrite", "quiet", "dry_run"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="an upcycle folder, a dense transformers folder or id, or 'default'")
    parser.add_argument("out", help="run folder: run_config.yaml, log.jsonl, checkpoints/, model/")
    add_config_flags(parser, TrainConfig, CONFIG_FLAGS)
    parser.add_argument("--config", help=f"YAML training recipe: a file, or a packaged recipe by name "
                                         f"({', '.join(recipe_names('train'))})")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override any key, e.g. --set regularizers.load_balance=0.01")
    parser.add_argument("--resume", action="store_true", help="continue the run in OUT from its latest checkpoint")
    parser.add_argument("--stop-after", type=whole_number, dest="stop_after",
                        help="checkpoint and exit after this step (resume later to finish the schedule)")
    parser.add_argument("--overwrite", action="store_true", default=None,
                        help="replace an existing OUT that upcycle wrote, once the new run holds its first "
                             "checkpoint (never an input, a folder holding one, or the current directory)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--dry-run", "--plan", dest="dry_run", action="store_true",
                        help="print the run's plan and its memory per device (parameters, gradients, optimizer, "
                             "activations with and without checkpointing) from the model's config, and exit; writes "
                             "nothing")


def train_config(args: argparse.Namespace) -> TrainConfig:
    if args.resume and args.config is None:   # the run's own config, with any flags on top (which must agree)
        from ..training.run.folder import saved_config

        data = saved_config(Path(args.out))
    else:
        data = load_recipe(recipe_path(args.config, "train"))
        refuse_overwrite_key(data, f"recipe {args.config}")
    data["model"] = args.model
    nested(data, flag_values(args, CONFIG_FLAGS))
    apply_sets(data, args.set)
    return build(TrainConfig, data)


def run(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    from ..training.trainer import train

    cfg = train_config(args)
    if args.dry_run:
        import os

        from ..outputs.job import dry_run_job
        from ..training.run_plan import make_train_plan

        # OUT's refusal, and a plan that does not fit, are lines of the plan printed (`make_train_plan`'s printing)
        plan = make_train_plan(cfg, args.out, resume=args.resume, overwrite=bool(args.overwrite),
                               stop_after=args.stop_after, printing=True)
        text = dry_run_job(plan, None)
        if os.environ.get("RANK", "0") == "0":     # under `accelerate launch`, one process says it
            print(text)
        return 0
    summary = train(cfg, args.out, resume=args.resume, overwrite=bool(args.overwrite), stop_after=args.stop_after,
                    progress=not args.quiet,
                    recipe=None if args.config is None else str(recipe_path(args.config, "train")))
    if summary["interrupted"]:
        print(f"upcycle: interrupted at step {summary['step']}; checkpoint {summary['checkpoint']} "
              f"(continue with --resume)", file=sys.stderr)
        return 130
    print(dumps(summary))
    return 0

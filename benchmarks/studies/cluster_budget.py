"""Cluster-aware Upcycling beyond the paper: how the calibration budget and the seed change the
cluster conversion of the embedded SmolLM2-135M (8 experts, top-2, every other block, as in the method study).

For each budget (FFN-input tokens per layer: 4,096, 16,384, 65,536) and seed:
  - held-out perplexity right after conversion (the trainer's evaluation: the first 16,384 tokens of the
    embedded Wikipedia held-out split, as the `smollm2-copy` train recipe evaluates);
  - damped clusters (clusters whose X_i^T X_i needed damping to be whitened) per layer, summed over layers;
  - optionally (`--train T,...`) the same training as the method study's cells, and the perplexity after it.
Between the seeds of one budget, per MoE layer, on the same held-out tokens (the dense model's FFN inputs at
that layer, so both routers see identical inputs):
  - top-1 agreement after matching the two runs' experts one-to-one (Hungarian, on the 8x8 co-assignment
    counts), against chance: the same statistic with the second run's assignments shuffled over the tokens
    (the same expert loads, no relation), mean of 20 shuffles;
  - the adjusted Rand index of the two top-1 partitions (0 = chance by construction, 1 = identical).

    .venv/bin/python benchmarks/studies/cluster_budget.py                          # conversions only
    .venv/bin/python benchmarks/studies/cluster_budget.py --train 4096,16384      # + training at those budgets (seed 0)

writes benchmarks/results/cluster_budget.json (and .png). Where the method study (`--study`) has already run a
budget and seed with the same recorded conversion config, its results are read instead of run again: its
`conversions/cluster-seed-S/moe` model and report (the same weights: the conversion is deterministic on one
machine), and its finished `cluster-eesd-none-seed-S` cell, trained with this script's recipe, for the
perplexity after training (marked `from_method_study`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from pathlib import Path

import torch
import yaml
from scipy.optimize import linear_sum_assignment
from sklearn.metrics import adjusted_rand_score

from upcycle.checkpoint.loading import load_model
from upcycle.config import ConvertConfig, TrainConfig, to_dict
from upcycle.config_reader import build, load_recipe, recipe_path
from upcycle.conversion.pipeline import convert
from upcycle.core.moe import moe_layers
from upcycle.core.router import router_logits
from upcycle.machine import machine
from upcycle.scripts import output_file, output_folder
from upcycle.tasks.make import make_task
from upcycle.training.trainer import train

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
RECIPE = recipe_path("smollm2-copy", "train")
SHUFFLES = 20


def convert_config(tokens: int, seed: int) -> ConvertConfig:
    return build(ConvertConfig, {"model": "default", "method": "cluster", "seed": seed,
                                 "moe": {"num_experts": 8, "top_k": 2}, "placement": {"every": 2},
                                 "calibration": {"tokens": tokens}})


def same_conversion(recorded: dict, tokens: int, seed: int) -> bool:
    """Whether a recorded convert config is this script's conversion of `tokens` per layer at `seed`."""
    wanted = to_dict(convert_config(tokens, seed))
    return all(recorded.get(key) == wanted[key] for key in ("model", "method", "method_args", "moe", "placement",
                                                             "calibration", "seed", "sources"))


def study_conversion(study: Path, tokens: int, seed: int) -> tuple[torch.nn.Module, dict, float] | None:
    """The method study's conversion of this budget and seed, if it ran with the same config: (model, report,
    conversion seconds)."""
    folder = study / "conversions" / f"cluster-seed-{seed}"
    if not (folder / "conversion.json").is_file():      # written last: the conversion finished
        return None
    if not same_conversion(yaml.safe_load((folder / "moe" / "run_config.yaml").read_text()), tokens, seed):
        return None
    model, _ = load_model(str(folder / "moe"))
    report = json.loads((folder / "moe" / "upcycle_report.json").read_text())
    return model, report, json.loads((folder / "conversion.json").read_text())["seconds"]


def study_trained(study: Path, tokens: int, seed: int) -> dict | None:
    """The method study's finished cell `cluster-eesd-none-seed-S` of this budget and seed, if it converted the same
    way and trained with this script's recipe: its evaluations before and after training."""
    cell = study / "cells" / f"cluster-eesd-none-seed-{seed}"
    if not (cell / "cell.json").is_file():
        return None
    plan, done = json.loads((cell / "plan.json").read_text()), json.loads((cell / "cell.json").read_text())
    recipe = to_dict(train_config(plan["train"]["model"], seed))
    recipe["regularizers"]["eesd"] = 0.0                # the cell's EESD setting `none`
    if not same_conversion(plan["convert"], tokens, seed) or plan["train"] != recipe:
        return None
    return {"perplexity_before": done["evals"][0]["perplexity"], "perplexity_after": done["evals"][-1]["perplexity"],
            "train_seconds": done["train"]["seconds"], "from_method_study": True}


def train_config(model: str, seed: int) -> TrainConfig:
    return build(TrainConfig, {**load_recipe(RECIPE), "model": model, "seed": seed})


@torch.no_grad()
def dense_ffn_inputs(dense: torch.nn.Module, names: list[str], task) -> dict[str, torch.Tensor]:
    """The dense model's FFN inputs at the named modules on the held-out rows' real tokens: [T, D] per layer."""
    modules = dict(dense.named_modules())
    ids, mask = task.eval_rows
    keep = mask.reshape(-1).bool()
    captured: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    handles = [modules[n].register_forward_hook(lambda m, args, out, n=n: captured[n].append(
        args[0].reshape(-1, args[0].shape[-1]).float())) for n in names]
    dense.eval()
    for i in range(0, len(ids), 8):
        dense(input_ids=ids[i:i + 8], attention_mask=mask[i:i + 8])
    for handle in handles:
        handle.remove()
    return {n: torch.cat(v)[keep] for n, v in captured.items()}


def matched_agreement(a: torch.Tensor, b: torch.Tensor, experts: int) -> float:
    """Fraction of tokens whose top-1 expert agrees once b's experts are matched one-to-one to a's."""
    counts = torch.zeros(experts, experts, dtype=torch.long)
    counts.index_put_((a, b), torch.ones_like(a), accumulate=True)
    rows, cols = linear_sum_assignment(-counts.numpy())
    return float(counts[rows, cols].sum()) / len(a)


def stability(top1: dict[int, dict[str, torch.Tensor]], experts: int) -> dict:
    """Per pair of seeds and layer: matched top-1 agreement, its chance level and the adjusted Rand index."""
    generator = torch.Generator().manual_seed(0)
    pairs = {}
    for s, t in itertools.combinations(sorted(top1), 2):
        layers = {}
        for name in top1[s]:
            a, b = top1[s][name], top1[t][name]
            chance = [matched_agreement(a, b[torch.randperm(len(b), generator=generator)], experts)
                      for _ in range(SHUFFLES)]
            layers[name] = {"agreement": matched_agreement(a, b, experts), "chance": sum(chance) / len(chance),
                            "ari": float(adjusted_rand_score(a.numpy(), b.numpy()))}
        mean = {k: sum(v[k] for v in layers.values()) / len(layers) for k in ("agreement", "chance", "ari")}
        pairs[f"{s}-{t}"] = {"layers": layers, "mean": mean}
    return pairs


def trained_perplexity(work: Path, tokens: int, seed: int) -> dict:
    """Convert to a folder, train with the method study's recipe, return the evaluations before and after."""
    folder = work / f"cluster-{tokens}-seed-{seed}"
    convert(convert_config(tokens, seed), folder / "moe", overwrite=True, progress=False)
    started = time.perf_counter()
    summary = train(train_config(str(folder / "moe"), seed), folder / "run", overwrite=True, progress=False)
    return {"perplexity_before": summary["eval_before"]["perplexity"],
            "perplexity_after": summary["eval_after"]["perplexity"],
            "train_seconds": round(time.perf_counter() - started, 1)}


def save(result: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, path)


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = result["budgets"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for seed in result["seeds"]:
        axes[0].plot(budgets, [result["runs"][f"{b}-seed-{seed}"]["perplexity"] for b in budgets], "o-",
                     label=f"seed {seed}")
    for seed in result["seeds"]:
        trained = sorted((int(k.split("-")[0]), v["perplexity_after"]) for k, v in result["trained"].items()
                         if k.endswith(f"-seed-{seed}"))
        if trained:
            axes[0].plot(*zip(*trained, strict=True), "x", ms=9, color=f"C{seed}",
                         label=f"seed {seed} after training")
    axes[0].axhline(result["dense_perplexity"], color="k", ls="--", label="dense")
    axes[0].set(xscale="log", xlabel="calibration tokens per layer", ylabel="held-out perplexity",
                title="held-out perplexity")
    axes[0].legend()
    for key, ax, label in (("agreement", axes[1], "matched top-1 agreement"), ("ari", axes[2], "adjusted Rand index")):
        means = [sum(p["mean"][key] for p in result["stability"][str(b)].values()) / len(result["stability"][str(b)])
                 for b in budgets]
        ax.plot(budgets, means, "o-", label="between seeds")
        if key == "agreement":
            ax.plot(budgets, [sum(p["mean"]["chance"] for p in result["stability"][str(b)].values()) /
                              len(result["stability"][str(b)]) for b in budgets], "o--", color="grey", label="chance")
        else:
            ax.axhline(0.0, color="grey", ls="--", label="chance")
        ax.set(xscale="log", xlabel="calibration tokens per layer", ylabel=label, ylim=(-0.05, 1.05),
               title=f"assignment stability: {label}")
        ax.legend()
    for ax in axes:
        ax.set_xticks(budgets, [f"{b:,}" for b in budgets])
        ax.minorticks_off()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", default="4096,16384,65536")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--train", default="", help="budgets to train at seed 0 (comma-separated)")
    parser.add_argument("--work", type=output_folder, default=Path("/tmp/upcycle-cluster-budget"))
    parser.add_argument("--study", type=Path, default=Path("/tmp/upcycle-method-study/study"),
                        help="the method study's folder, whose finished cluster conversions are reused")
    parser.add_argument("--out", type=output_file, default=RESULTS / "cluster_budget.json")
    args = parser.parse_args()
    from upcycle.scripts import claim_work, clear

    args.work = claim_work(args.work)
    budgets = [int(b) for b in args.budgets.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    started = time.time()
    dense, tokenizer = load_model("default")
    task = make_task(train_config("default", 0), dense, tokenizer)
    # a rerun with the same budgets and seeds keeps the conversions' results (`--train` adds to them)
    before = json.loads(args.out.read_text()) if args.out.is_file() else {}
    if before.get("budgets") == budgets and before.get("seeds") == seeds:
        result = before
    else:
        result = {"machine": machine(), "budgets": budgets, "seeds": seeds,
                  "held_out_tokens": int(task.eval_rows[1].sum()),
                  "dense_perplexity": task.evaluate(dense)["perplexity"], "runs": {}, "stability": {}, "trained": {}}
    inputs = None
    for tokens in [b for b in budgets if str(b) not in result["stability"]]:
        top1 = {}
        for seed in seeds:
            reused = study_conversion(args.study, tokens, seed)
            if reused is not None:
                model, report, seconds = reused
            else:
                t = time.perf_counter()
                conversion = convert(convert_config(tokens, seed), None, progress=False)
                seconds = time.perf_counter() - t
                model, report = conversion.model, conversion.report.to_dict()
                del conversion
            layers = moe_layers(model)
            if inputs is None:
                inputs = dense_ffn_inputs(dense, list(layers), task)
            with torch.no_grad():
                top1[seed] = {n: router_logits(layer.router, inputs[n]).argmax(1) for n, layer in layers.items()}
            damped = {layer["name"]: layer["damped_clusters"] for layer in report["layers"]}
            result["runs"][f"{tokens}-seed-{seed}"] = {
                "perplexity": task.evaluate(model)["perplexity"], "kl_to_dense": report["kl_to_dense"],
                "damped_clusters": sum(damped.values()), "damped_clusters_per_layer": damped,
                "clusters": 8 * len(layers), "conversion_seconds": round(seconds, 1),
                "from_method_study": reused is not None}
            print(tokens, seed, result["runs"][f"{tokens}-seed-{seed}"]["perplexity"],
                  result["runs"][f"{tokens}-seed-{seed}"]["damped_clusters"], flush=True)
            del model
        result["stability"][str(tokens)] = stability(top1, 8)
        save(result, args.out)          # each budget is kept if a later one is interrupted
        print(tokens, {k: v["mean"] for k, v in result["stability"][str(tokens)].items()}, flush=True)
    for tokens, seed in itertools.product(budgets, seeds):       # the method study's cells of the same runs
        if f"{tokens}-seed-{seed}" not in result["trained"]:
            if (done := study_trained(args.study, tokens, seed)) is not None:
                result["trained"][f"{tokens}-seed-{seed}"] = done
    for tokens in [int(b) for b in args.train.split(",") if b and f"{b}-seed-0" not in result["trained"]]:
        result["trained"][f"{tokens}-seed-0"] = trained_perplexity(args.work, tokens, 0)
        save(result, args.out)
        clear(args.work / f"cluster-{tokens}-seed-0", args.work)    # models and optimizer state
    result.setdefault("wall_seconds_per_invocation", []).append(round(time.time() - started))
    save(result, args.out)
    plot(result, args.out.with_suffix(".png"))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

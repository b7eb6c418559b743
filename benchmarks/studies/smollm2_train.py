"""Continued training of the embedded SmolLM2-135M upcycled with `copy` and with `spri`: does a short budget
lower held-out perplexity, and what do the router regularizers and routing statistics do meanwhile?

    .venv/bin/python benchmarks/studies/smollm2_train.py --run   # convert + train both (about 40 min on 2 CPU cores)
    .venv/bin/python benchmarks/studies/smollm2_train.py         # summarize existing runs in out/

Runs (each recipe's header has its command):
    upcycle convert default out/smollm2-moe  --method copy --num-experts 8 --top-k 2 --every 2
    upcycle convert default out/smollm2-spri --method spri --num-experts 8 --top-k 2 --every 2
    upcycle train out/smollm2-moe  out/train-copy --config smollm2-copy
    upcycle train out/smollm2-spri out/train-spri --config smollm2-spri
Writes benchmarks/results/smollm2_train.json and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

from upcycle.config_reader import recipe_path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
BIN = Path(sys.executable).parent
RUNS = {"copy": ("out/smollm2-moe", "out/train-copy", "smollm2-copy"),         # packaged recipes, by name
        "spri": ("out/smollm2-spri", "out/train-spri", "smollm2-spri")}


def run_all() -> None:
    for method, (model, run, recipe) in RUNS.items():
        subprocess.run([BIN / "upcycle", "convert", "default", model, "--method", method, "--num-experts", "8",
                        "--top-k", "2", "--every", "2", "--overwrite", "--quiet"], cwd=ROOT, check=True)
        subprocess.run([BIN / "upcycle", "train", model, run, "--config", recipe, "--overwrite"], cwd=ROOT,
                       check=True)


def summarize(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval" in r]
    names = sorted(steps[0]["loss"])
    layers = sorted(steps[0]["layers"])

    def layer_mean(row: dict, key: str) -> float:
        return statistics.fmean(row["layers"][name][key] for name in layers)

    return {
        "perplexity_before": evals[0]["eval"]["perplexity"], "perplexity_after": evals[-1]["eval"]["perplexity"],
        "eval_tokens": evals[0]["eval"]["tokens"], "steps": len(steps), "tokens": sum(r["tokens"] for r in steps),
        "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in steps),
        "train_seconds": round(sum(r["seconds"] for r in steps), 1),
        "loss_first_last": {n: [steps[0]["loss"][n], steps[-1]["loss"].get(n)] for n in names},
        "mean_over_layers_first_last": {k: [layer_mean(steps[0], k), layer_mean(steps[-1], k)]
                                        for k in ("entropy", "load_cov", "dropped")},
        "frozen_rule_steps": sum(1 for r in steps if r["frozen_rules"]),
        "curves": {"task": [r["loss"]["task"] for r in steps],
                   "load_balance": [r["loss"].get("load_balance") for r in steps],
                   "load_cov": [layer_mean(r, "load_cov") for r in steps]},
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for method, color in (("copy", "tab:blue"), ("spri", "tab:orange")):
        curves = result["runs"][method]["curves"]
        x = range(1, len(curves["task"]) + 1)
        for ax, key, label in zip(axes, ("task", "load_balance", "load_cov"),
                                  ("task loss (train batch)", "load-balance loss", "load CoV (mean over layers)"),
                                  strict=True):
            ax.plot(x, curves[key], color=color, label=method)
            ax.set(xlabel="step", title=label)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", action="store_true", help="convert and train first (about 40 minutes)")
    args = parser.parse_args()
    if args.run:
        run_all()
    result = {"runs": {m: summarize(ROOT / run) for m, (_, run, _) in RUNS.items()},
              "recipes": {m: recipe_path(recipe, "train").read_text() for m, (_, _, recipe) in RUNS.items()},
              "machine": {"platform": platform.platform(), "processor": platform.processor(),
                          "cpus": os.cpu_count()}}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "smollm2_train.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, RESULTS / "smollm2_train.png")
    for method, r in result["runs"].items():
        print(f"{method}: perplexity {r['perplexity_before']:.3f} -> {r['perplexity_after']:.3f} in {r['steps']} "
              f"steps ({r['tokens']:,} tokens, {r['median_tokens_per_s']:.0f} tokens/s)")


if __name__ == "__main__":
    main()

"""The CLIP-UP protocol in miniature, offline: pretrain a tiny dense CLIP on the digits image-caption task,
sparse-upcycle both towers (CLIP-UP placement: every other block, 8 experts top-2, capacity 2.0), continue
training with a 10x lower learning rate and lower weight decay plus per-modality load-balance and z-losses,
and compare with continuing the dense model for the same steps (the compute-matched baseline).

    .venv/bin/python benchmarks/studies/tiny_clip.py            # writes benchmarks/results/tiny_clip.{json,png}
    .venv/bin/python benchmarks/studies/tiny_clip.py --quick    # a CI-sized run (tests/commands/test_clip_protocol.py)

Metrics on the 359 held-out digits (every 5th image): zero-shot accuracy with class-name prompts, and
image->text / text->image Recall@1/5 over the distinct captions (upcycle.tasks.evaluate.clip_metrics).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from upcycle import ConvertConfig, MoEConfig, PlacementConfig, convert
from upcycle.config import TrainConfig
from upcycle.config_reader import RECIPES, build, load_recipe
from upcycle.data.clip_pairs import caption_tokenizer, digits_pairs
from upcycle.data.tiny_clip import tiny_clip
from upcycle.outputs.staging import atomic_directory
from upcycle.scripts import output_file
from upcycle.training.trainer import train

RESULTS = Path(__file__).parents[1] / "results"
FULL = {"pretrain_steps": 400, "continue_steps": 200, "batch_size": 128}
QUICK = {"pretrain_steps": 100, "continue_steps": 20, "batch_size": 64}


def run(root: Path, *, pretrain_steps: int, continue_steps: int, batch_size: int, seed: int = 0) -> dict:
    """Every stage's held-out metrics, time and parameter counts."""
    train_pairs, _ = digits_pairs()
    tokenizer = caption_tokenizer(train_pairs.captions)
    with atomic_directory(root / "init", overwrite=True) as tmp:
        tiny_clip(tokenizer, seed=seed).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    stages: dict[str, dict] = {}

    def stage(name: str, model: Path, steps: int, recipe: str, **changes) -> Path:
        data = {**load_recipe(RECIPES / "train" / recipe), **changes}
        data.update(model=str(model), steps=steps, batch_size=batch_size, seed=seed)
        cfg = build(TrainConfig, data)
        started = time.perf_counter()
        summary = train(cfg, root / name, overwrite=True, progress=False)
        log = [json.loads(line) for line in (root / name / "log.jsonl").read_text().splitlines()]
        stages[name] = {"steps": steps, "seconds": round(time.perf_counter() - started, 2),
                        "eval_before": summary["eval_before"], "eval_after": summary["eval_after"],
                        "loss_curve": [row["loss"]["task"] for row in log if "loss" in row]}
        return root / name / "model"

    # Dense pretraining: CLIP-UP's dense recipe shape (AdamW, weight decay 0.2, cosine with warmup).
    dense = stage("pretrain", root / "init", pretrain_steps, "tiny-clip-pretrain.yaml")
    # Upcycle both towers with CLIP-UP's placement (the `clip-up` convert recipe).
    started = time.perf_counter()
    conversion = convert(ConvertConfig(model=str(dense), method="copy", seed=seed,
                                       moe=MoEConfig(num_experts=8, top_k=2, capacity_factor_train=2.0,
                                                     capacity_factor_eval=2.0),
                                       placement=PlacementConfig(every=2, towers=("text", "vision"))),
                         root / "moe", overwrite=True, progress=False)
    report = conversion.report.to_dict()
    upcycled = {"seconds": round(time.perf_counter() - started, 2), "parameters": report["parameters"],
                "num_moe_layers": report["num_moe_layers"], "max_abs_logit_diff": report["max_abs_logit_diff"]}
    # Continue (the `clip-up` train recipe): learning rate 10x lower, weight decay 0.2 -> 0.05, fresh AdamW,
    # router losses per modality; the dense baseline takes the same recipe without router losses.
    stage("continue_moe", root / "moe", continue_steps, "clip-up.yaml")
    stage("continue_dense", dense, continue_steps, "clip-up.yaml", regularizers={})
    return {"stages": stages, "upcycle": upcycled}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = result["stages"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, color in (("continue_dense", "tab:gray"), ("continue_moe", "tab:blue")):
        ax1.plot(range(1, len(stages[name]["loss_curve"]) + 1), stages[name]["loss_curve"], color=color,
                 label=name.replace("_", " "))
    ax1.set(xlabel="step after the dense checkpoint", ylabel="contrastive loss (train batch)",
            title="Continued training")
    ax1.legend()
    rows = [("dense pretrained", stages["pretrain"]["eval_after"]),
            ("upcycled, before training", stages["continue_moe"]["eval_before"]),
            ("dense, continued", stages["continue_dense"]["eval_after"]),
            ("MoE, continued", stages["continue_moe"]["eval_after"])]
    metrics = [("zero-shot acc", lambda e: e["zero_shot"]["accuracy"]),
               ("I->T R@1", lambda e: e["image_to_text"]["R@1"]), ("T->I R@1", lambda e: e["text_to_image"]["R@1"]),
               ("I->T R@5", lambda e: e["image_to_text"]["R@5"])]
    width = 0.8 / len(rows)
    for i, (label, ev) in enumerate(rows):
        ax2.bar([m + i * width for m in range(len(metrics))], [f(ev) for _, f in metrics], width, label=label)
    ax2.set_xticks([m + 0.4 - width / 2 for m in range(len(metrics))], [name for name, _ in metrics])
    ax2.set(ylim=(0, 1.3), yticks=[0, 0.2, 0.4, 0.6, 0.8, 1.0], title="Held-out digits (359 images)")
    ax2.legend(fontsize=8, ncol=2, loc="upper center")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the CI-sized run (not written to results/)")
    parser.add_argument("--out", type=output_file, help="where to write the JSON (default benchmarks/results/)")
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL
    with tempfile.TemporaryDirectory() as tmp:
        result = run(Path(tmp), **sizes)
    result.update(sizes=sizes, machine={"platform": platform.platform(), "processor": platform.processor(),
                                        "cpus": os.cpu_count(), "torch": torch.__version__,
                                        "threads": torch.get_num_threads()})
    out = args.out or (RESULTS / ("tiny_clip_quick.json" if args.quick else "tiny_clip.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    if not args.quick:
        plot(result, out.with_suffix(".png"))
    for name, s in result["stages"].items():
        e = s["eval_after"]
        print(f"{name:15s} {s['seconds']:7.1f} s  zero-shot {e['zero_shot']['accuracy']:.3f}  "
              f"I->T R@1 {e['image_to_text']['R@1']:.3f}  T->I R@1 {e['text_to_image']['R@1']:.3f}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

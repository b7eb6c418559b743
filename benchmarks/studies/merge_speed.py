"""The three-source merge of the merging study (docs/merging.md), timed next to mergekit-moe 0.1.5 in one run.

The same setting as `btx_study.py`'s `data` router merge: three sources of SmolLM2-135M (Wikipedia prose, Python
source, arithmetic: its texts, 1,024 calibration and 1,024 held-out tokens per source in rows of 64, its three
prompts each), every block MoE, 3 experts, top-2, float32, the per-layer router-source agreement report kept.
The sources here are the base with a seeded perturbation of every FFN weight (`identical_outputs.perturbed_copy`)
instead of 30-step fine-tunes: a merge reads, computes and writes the same tensors whatever their values, so the
time is the fine-tunes' and the study's hours of fine-tuning are not needed to measure it. mergekit-moe merges the
same sources (`gate_mode: hidden`, the same prompts, float32, on the CPU) in its own environment
(`~/.cache/upcycle/mergekit-venv`, built once: `pip install torch==2.13.0 mergekit==0.1.5`).

Each round runs ours and then mergekit-moe, under GNU time (wall, CPU, peak RSS), and then, in a fresh process,
a plain transformers forward of the text our merge replays (`--forward`: the base `LlamaModel`, no LM head, over
the same calibration and held-out batches of the three sources, timed after the model is loaded), which is what
the replay would cost as the model's own forward, and upcycle's replay of the same batches in that process. The
medians over the rounds and the ratios go to benchmarks/results/merge_speed.json.

    .venv/bin/python benchmarks/studies/merge_speed.py [--rounds 3] [--work out/merge-speed]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from btx_study import SOURCES, machine, merge_mergekit, recipe, timed, write_data

from upcycle.scripts import claim_work, clear, output_folder, perturbed_copy

ROOT = Path(__file__).resolve().parents[2]
RESULT = ROOT / "benchmarks" / "results" / "merge_speed.json"


def ours(out: Path, config: Path) -> dict:
    clear(out, out.parent)                  # inside the claimed --work folder
    row = timed([sys.executable, "-m", "upcycle.cli", "convert", "default", out, "--config", config,
                 "--every", 1, "--top-k", 2, "--quiet", "--overwrite"])
    report = json.loads((out / "upcycle_report.json").read_text()) if row["exit_code"] == 0 else {}
    row["timings_s"] = {k: round(v, 2) for k, v in report.get("timings_s", {}).items()}
    row["agreement_layers"] = sum(1 for layer in report.get("layers", []) if layer.get("agreement"))
    return row


def forward_seconds(config: Path) -> None:
    """Print, as JSON, the seconds of a transformers forward (no LM head) over every batch the merge of `config`
    replays, and of upcycle's block-by-block replay of the same batches through the same model in the same
    process (`replay_block` with each group's reservoir, its batches joined and padding skipping the FFN, as the
    merge runs it, without reading or writing checkpoints), and the tokens in them (run in a fresh process by
    `forward`)."""
    import time

    import torch
    import yaml
    from transformers import AutoModelForCausalLM

    from upcycle.checkpoint.loading import load_tokenizer
    from upcycle.config import ConvertConfig
    from upcycle.config_reader import build
    from upcycle.conversion.calibration import Capture, Reservoir, first_block_inputs, join_batches, replay_block
    from upcycle.conversion.merge import needed_groups, source_batches
    from upcycle.conversion.plan import make_plan
    from upcycle.data.assets import default_model_path

    base = default_model_path()
    cfg = build(ConvertConfig, {**yaml.safe_load(config.read_text()), "model": str(base)})
    plan = make_plan(cfg)                     # the merge's plan: its sources opened (headers only)
    kinds = tuple(needed_groups(plan.sources, plan.method))
    tokenizer = load_tokenizer(str(base))
    groups = [group for i in range(len(plan.sources.experts))
              for group in source_batches(plan, tokenizer, i, kinds).values()]
    batches = [b for group in groups for b in group]
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    blocks = model.model.layers

    def forward_pass() -> None:
        for batch in batches:
            model.model(**batch, use_cache=False)

    def replay() -> None:
        joined = [join_batches(group) for group in groups]
        states = [first_block_inputs(model, {"text": blocks}, [j.batch for j in js])["text"] for js in joined]
        for block in blocks:
            for js, group_states in zip(joined, states, strict=True):
                sampler = Reservoir(cfg.calibration.tokens, torch.Generator().manual_seed(0))
                replay_block(block, group_states, [j.batch["attention_mask"] for j in js],
                             Capture(block.mlp, sampler, [j.rows for j in js]), padding_skips=block.mlp)

    def seconds(run) -> float:
        t = time.perf_counter()
        run()
        return round(time.perf_counter() - t, 2)

    with torch.no_grad():
        forward_s, replay_s = seconds(forward_pass), seconds(replay)
    print(json.dumps({"forward_s": forward_s, "replay_in_process_s": replay_s, "batches": len(batches),
                      "groups": sorted(kinds), "real_tokens": sum(int(b["attention_mask"].sum()) for b in batches),
                      "positions": sum(b["attention_mask"].numel() for b in batches)}))


def forward(config: Path) -> dict:
    done = subprocess.run([sys.executable, __file__, "--forward", str(config)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def theirs(out: Path, fts: dict[str, Path]) -> dict:
    clear(out, out.parent)                  # inside the claimed --work folder
    return merge_mergekit(out, fts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work", type=output_folder, default=ROOT / "out" / "merge-speed")
    parser.add_argument("--forward", type=Path, help=argparse.SUPPRESS)    # the baseline's own process
    args = parser.parse_args()
    if args.forward:
        return forward_seconds(args.forward)
    from upcycle.data.assets import default_model_path

    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    work = claim_work(args.work.resolve())
    files = write_data(work / "data")
    fts = {s: work / f"ft-{s}" for s in SOURCES}
    for seed, s in enumerate(SOURCES):
        if not (fts[s] / "model" / "model.safetensors").exists():
            perturbed_copy(default_model_path(), fts[s] / "model", seed)
    config = recipe(work / "data.yaml", fts, files, "data")
    rows = {"upcycle": [], "mergekit-moe": []}
    forwards = []
    for round_ in range(args.rounds):
        for name, run in (("upcycle", lambda: ours(work / "merge-upcycle", config)),
                          ("mergekit-moe", lambda: theirs(work / "merge-mergekit", fts))):
            row = run()
            print(f"round {round_ + 1} {name}: {row['wall_s']} s wall, {row['cpu_s']} s CPU "
                  f"(exit {row['exit_code']})", flush=True)
            if row["exit_code"]:
                sys.exit(f"{name} failed")
            rows[name].append(row)
        forwards.append(forward(config))
        print(f"round {round_ + 1} transformers forward of the replayed text: {forwards[-1]['forward_s']} s, "
              f"the replay in that process: {forwards[-1]['replay_in_process_s']} s", flush=True)
    replay = statistics.median(r["timings_s"]["calibration"] for r in rows["upcycle"])
    forward_s = statistics.median(f["forward_s"] for f in forwards)
    median = {name: {key: statistics.median(r[key] for r in runs) for key in ("wall_s", "cpu_s", "peak_rss_bytes")}
              for name, runs in rows.items()}
    result = {"machine": machine(), "setting": {"sources": list(SOURCES), "experts": 3, "top_k": 2, "every": 1,
                                                "dtype": "float32", "router": "data", "calibration_tokens": 1024,
                                                "sequence_length": 64, "mergekit": "gate_mode hidden",
                                                "rounds": args.rounds},
              "runs": rows, "median": median,
              "upcycle_over_mergekit": {key: round(median["upcycle"][key] / median["mergekit-moe"][key], 2)
                                        for key in ("wall_s", "cpu_s", "peak_rss_bytes")},
              # each round's two runs follow each other: their ratio is the least touched by the machine's drift
              "wall_ratio_by_round": [round(a["wall_s"] / b["wall_s"], 2)
                                      for a, b in zip(rows["upcycle"], rows["mergekit-moe"], strict=True)],
              # the replay (our report's `calibration` seconds) next to the model's own forward of the same text,
              # and the replay alone in the forward's process (no checkpoint read or written beside it)
              "replay": {"median_s": round(replay, 2), "transformers_forward_median_s": round(forward_s, 2),
                         "over_forward": round(replay / forward_s, 2),
                         "in_process_median_s": statistics.median(f["replay_in_process_s"] for f in forwards),
                         "text": {k: v for k, v in forwards[0].items() if not k.endswith("_s")},
                         "forward_rounds_s": [f["forward_s"] for f in forwards],
                         "in_process_rounds_s": [f["replay_in_process_s"] for f in forwards]},
              "upcycle_without_replay_s": round(median["upcycle"]["wall_s"] - replay, 1)}
    result["wall_ratio_by_round_median"] = statistics.median(result["wall_ratio_by_round"])
    RESULT.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["upcycle_over_mergekit"]), "by round:", result["wall_ratio_by_round"])


if __name__ == "__main__":
    main()

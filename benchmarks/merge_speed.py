"""The three-source merge of the merging study (docs/merging.md), timed next to mergekit-moe 0.1.5 in one run.

The same setting as `btx_study.py`'s `data` router merge: three sources of SmolLM2-135M (Wikipedia prose, Python
source, arithmetic: its texts, 1,024 calibration and 1,024 held-out tokens per source in rows of 64, its three
prompts each), every block MoE, 3 experts, top-2, float32, the per-layer router-source agreement report kept.
The sources here are the base with a seeded perturbation of every FFN weight (`identical_outputs.perturbed_copy`)
instead of 30-step fine-tunes: a merge reads, computes and writes the same tensors whatever their values, so the
time is the fine-tunes' and the study's hours of fine-tuning are not needed to measure it. mergekit-moe merges the
same sources (`gate_mode: hidden`, the same prompts, float32, on the CPU) in its own environment
(`~/.cache/upcycle/mergekit-venv`, built once: `pip install torch==2.13.0 mergekit==0.1.5`).

Each round runs ours and then mergekit-moe, under GNU time (wall, CPU, peak RSS); the medians over the rounds
and their ratio go to benchmarks/results/merge_speed.json.

    .venv/bin/python benchmarks/merge_speed.py [--rounds 3] [--work out/merge-speed]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from btx_study import SOURCES, machine, merge_mergekit, recipe, timed, write_data  # noqa: E402  (the path first)
from identical_outputs import perturbed_copy  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "merge_speed.json"


def ours(out: Path, config: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    row = timed([sys.executable, "-m", "upcycle.cli", "convert", "default", out, "--config", config,
                 "--every", 1, "--top-k", 2, "--quiet", "--overwrite"])
    report = json.loads((out / "upcycle_report.json").read_text()) if row["exit_code"] == 0 else {}
    row["timings_s"] = {k: round(v, 2) for k, v in report.get("timings_s", {}).items()}
    row["agreement_layers"] = sum(1 for layer in report.get("layers", []) if layer.get("agreement"))
    return row


def theirs(out: Path, fts: dict[str, Path]) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    return merge_mergekit(out, fts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work", type=Path, default=ROOT / "out" / "merge-speed")
    args = parser.parse_args()
    from upcycle.data.assets import default_model_path

    work = args.work.resolve()
    files = write_data(work / "data")
    fts = {s: work / f"ft-{s}" for s in SOURCES}
    for seed, s in enumerate(SOURCES):
        if not (fts[s] / "model" / "model.safetensors").exists():
            perturbed_copy(default_model_path(), fts[s] / "model", seed)
    config = recipe(work / "data.yaml", fts, files, "data")
    rows = {"upcycle": [], "mergekit-moe": []}
    for round_ in range(args.rounds):
        for name, run in (("upcycle", lambda: ours(work / "merge-upcycle", config)),
                          ("mergekit-moe", lambda: theirs(work / "merge-mergekit", fts))):
            row = run()
            print(f"round {round_ + 1} {name}: {row['wall_s']} s wall, {row['cpu_s']} s CPU "
                  f"(exit {row['exit_code']})", flush=True)
            if row["exit_code"]:
                sys.exit(f"{name} failed")
            rows[name].append(row)
    median = {name: {key: statistics.median(r[key] for r in runs) for key in ("wall_s", "cpu_s", "peak_rss_bytes")}
              for name, runs in rows.items()}
    result = {"machine": machine(), "setting": {"sources": list(SOURCES), "experts": 3, "top_k": 2, "every": 1,
                                                "dtype": "float32", "router": "data", "calibration_tokens": 1024,
                                                "sequence_length": 64, "mergekit": "gate_mode hidden",
                                                "rounds": args.rounds},
              "runs": rows, "median": median,
              "upcycle_over_mergekit": {key: round(median["upcycle"][key] / median["mergekit-moe"][key], 2)
                                        for key in ("wall_s", "cpu_s", "peak_rss_bytes")}}
    RESULT.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["upcycle_over_mergekit"]))


if __name__ == "__main__":
    main()

"""The LM method study through `upcycle compare`: the embedded SmolLM2-135M on the embedded
Wikipedia, 8 experts, top-2, every other block, each method trained with the budget of
the `smollm2-copy` train recipe (40 steps x 8 x 256 tokens), against the dense model continued the same way.

    .venv/bin/python benchmarks/studies/method_study.py                  # every part in turn, then --collect
    .venv/bin/python benchmarks/studies/method_study.py --part seed-0    # one part
    .venv/bin/python benchmarks/studies/method_study.py --collect        # the table and figures from the finished cells

The parts are these `upcycle compare` commands into one WORK/study (rerunning one resumes it: finished cells are
skipped, an interrupted one resumes from its checkpoint):

    seed-0:          upcycle compare default WORK/study --methods copy,cluster --eesd none,1.0 --seeds 0
                       --config smollm2-copy --num-experts 8 --top-k 2 --every 2 --quiet
    seed-1:          the same with --eesd none --seeds 1
    seed-1-eesd:     the same with --eesd 1.0 --seeds 1
    others-a:        upcycle compare default WORK/study --methods noise,drop,drop_svd --eesd none --seeds 0
                       --config ... (as above) --keep results
    others-b:        upcycle compare default WORK/study --methods spri,granular --eesd none --seeds 0
                       --method-config spri=smollm2-spri
                       --method-set granular.method_args.granularity=2 --method-set granular.moe.num_experts=16
                       --method-set granular.moe.top_k=4
                       --config ... (as above) --keep results
    eesd-small:      upcycle compare default WORK/study --methods cluster --eesd 0.0001 --seeds 0
                       --config ... (as above) --keep results

so copy and cluster run with and without EESD (coefficient 1.0) on two seeds, the dense baseline on both, and
the other methods once (seed 0, the dense baseline's first seed, so they see the same batches as its seed 0).
eesd-small reruns cluster + EESD with the coefficient at 1e-4: at 1.0 EESD's gradient norm at the first step was
about 10^4 times the task's (26,511 against 2.55), so 1e-4 puts the two about level.
Parts may run at the same time when they share no unfinished cell (the others-* parts list the dense seed-0
cell too); but a training cell holds 9-11 GB here (fp32 weights, gradients and AdamW state of 0.4B parameters,
plus the EESD teacher), so on a 24 GB machine run them one after the other, in the order listed.
SPRI trains with its two-stage recipe (the same steps, batch and sequence length). Granular splits each expert
in two (granularity 2) and so has 16 half-width experts, top-4: the same expert parameters, total and active.
Cluster is calibrated on the converter's default: 65,536 FFN-input tokens per layer of the embedded Wikipedia
train split.

`--collect` runs the seed-0 command once more (every cell finished: it only writes the table), then copies
comparison.json (machine, wall time of every invocation, every cell; plus each cell's median tokens/s over its
training steps, read from its log), comparison.md and the two figures into benchmarks/results/method_study/.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
from pathlib import Path

from upcycle.cli import main
from upcycle.runs.layout import LOG
from upcycle.runs.log import read_log
from upcycle.scripts import output_folder

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "method_study"
COMMON = ["--config", "smollm2-copy", "--num-experts", "8", "--top-k", "2", "--every", "2",
          "--quiet"]
# granular: 16 experts half as wide, top-4 (granularity 2): the same total and active parameters as 8 experts
# top-2 of the other methods (its default granularity 4 needs E and k multiples of 4)
GRANULAR = ["--method-set", "granular.method_args.granularity=2", "--method-set", "granular.moe.num_experts=16",
            "--method-set", "granular.moe.top_k=4"]


def parts(study: Path) -> dict[str, list[str]]:
    def compare(methods: str, eesd: str, seed: str, *extra: str) -> list[str]:
        return ["compare", "default", str(study), "--methods", methods, "--eesd", eesd, "--seeds", seed, *extra,
                *COMMON]

    return {
        "seed-0": compare("copy,cluster", "none,1.0", "0"),
        "seed-1": compare("copy,cluster", "none", "1"),
        "seed-1-eesd": compare("copy,cluster", "1.0", "1"),
        "others-a": compare("noise,drop,drop_svd", "none", "0", "--keep", "results"),
        "others-b": compare("spri,granular", "none", "0", "--method-config", "spri=smollm2-spri",
                            *GRANULAR, "--keep", "results"),
        "eesd-small": compare("cluster", "0.0001", "0", "--keep", "results"),
    }


def median_step_throughput(study: Path) -> dict[str, float]:
    """Each finished cell's median training tokens/s over its steps (from its run log). The table's tokens/s is
    the run's tokens over its wall time, which a process beside it, a pause or a resume inflates; the median
    step is what the cell runs at undisturbed."""
    medians = {}
    for log in sorted(study.glob(f"cells/*/run/{LOG}")):
        rows = map(json.loads, read_log(log, 1 << 62))        # the trainer's reader: a torn last line is dropped
        rates = [row["tokens_per_s"] for row in rows if "tokens_per_s" in row]
        if rates and (log.parents[1] / "cell.json").is_file():
            medians[log.parents[1].name] = round(statistics.median(rates), 1)
    return medians


def collect(study: Path) -> None:
    result = json.loads((study / "comparison.json").read_text())
    result["run"] = {"commands": {name: " ".join(["upcycle", *c]) for name, c in parts(study).items()}}
    result["median_step_tokens_per_s"] = median_step_throughput(study)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "comparison.json").write_text(json.dumps(result, indent=1) + "\n")
    for name in ("comparison.md", "metric_over_steps.png", "init_diagnostics.png"):
        shutil.copyfile(study / name, RESULTS / name)
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=output_folder, default=Path("/tmp/upcycle-method-study"))
    parser.add_argument("--part", choices=list(parts(Path())))
    parser.add_argument("--collect", action="store_true")
    args = parser.parse_args()
    os.chdir(ROOT)                      # the recipes are named relative to the repository, as in docs/results.md
    study = args.work / "study"
    commands = parts(study)
    for name in [args.part] if args.part else [] if args.collect else list(commands):
        assert main(commands[name]) == 0, name
    if args.collect or not args.part:
        assert main(commands["seed-0"]) == 0
        collect(study)

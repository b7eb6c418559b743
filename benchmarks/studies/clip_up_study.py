"""The CLIP-UP miniature through `upcycle compare`: on the tiny-CLIP protocol of `benchmarks/studies/tiny_clip.py`
(a 4-block dense CLIP pretrained on the digits image-caption task), upcycle both towers
with copy, drop and cluster (cluster calibrated on the training image-caption pairs), each with and without EESD,
3 seeds, continue each with CLIP-UP's recipe, against the dense model continued with the same recipe.

    .venv/bin/python benchmarks/studies/clip_up_study.py                 # -> benchmarks/results/clip_up_study/
    .venv/bin/python benchmarks/studies/clip_up_study.py --work DIR      # keep the models somewhere else (default /tmp)

It runs, and records, these commands (rerunning resumes: finished cells are skipped):

    upcycle tiny-clip WORK/init
    upcycle train WORK/init WORK/pre --config tiny-clip-pretrain --quiet
    upcycle compare WORK/pre/model WORK/study --methods copy,drop,cluster --eesd none,1.0 --seeds 0,1,2
        --config clip-up --convert-config clip-up
        --convert-set calibration.batch_size=128 --set eval_every=25 --keep results --quiet

It is a CPU protocol (float32; on a GPU machine run it with CUDA_VISIBLE_DEVICES= : there the recipes' `auto`
mixed precision would train in bf16). The committed results ran the compare step as three processes, one per
seed (`--seeds 0`, `--seeds 1`, `--seeds 2` into the same WORK/study), then the command above, which found every
cell finished and wrote the table: the same cells, in a third of the time.

then copies comparison.json (with the machine, the wall time and every cell), comparison.md and the two figures
into benchmarks/results/clip_up_study/.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

from upcycle.cli import main
from upcycle.scripts import output_folder

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "clip_up_study"


def commands(work: Path) -> list[list[str]]:
    return [
        ["tiny-clip", str(work / "init")],
        ["train", str(work / "init"), str(work / "pre"), "--config", "tiny-clip-pretrain",
         "--quiet"],
        ["compare", str(work / "pre" / "model"), str(work / "study"), "--methods", "copy,drop,cluster",
         "--eesd", "none,1.0", "--seeds", "0,1,2", "--config", "clip-up",
         "--convert-config", "clip-up", "--convert-set", "calibration.batch_size=128",
         "--set", "eval_every=25", "--keep", "results", "--quiet"],
    ]


def run(work: Path) -> None:
    os.chdir(ROOT)                      # the recipes are named relative to the repository, as in docs/results.md
    init, pre, study = commands(work)
    started = time.time()
    if not (work / "init").is_dir():
        assert main(init) == 0
    if not (work / "pre" / "model").is_dir():
        assert main(pre) == 0
    pretrain_s = time.time() - started
    assert main(study) == 0
    RESULTS.mkdir(parents=True, exist_ok=True)
    result = json.loads((work / "study" / "comparison.json").read_text())
    result["run"] = {"commands": [" ".join(["upcycle", *c]) for c in (init, pre, study)],
                     "wall_seconds": {"pretraining": round(pretrain_s), "total": round(time.time() - started)}}
    result["pretraining"] = {"steps": 400, "batch_size": 128,
                             "evals": [json.loads(line) for line in (work / "pre" / "log.jsonl").read_text()
                                       .splitlines() if '"eval"' in line]}
    (RESULTS / "comparison.json").write_text(json.dumps(result, indent=1) + "\n")
    for name in ("comparison.md", "metric_over_steps.png", "init_diagnostics.png"):
        shutil.copyfile(work / "study" / name, RESULTS / name)
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=output_folder, default=Path("/tmp/upcycle-clip-up-study"))
    run(parser.parse_args().work)

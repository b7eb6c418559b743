"""What delta experts cost in quality (docs/delta-experts.md): the copy-upcycled model trained with full experts,
with delta experts of rank 16 and 64 (base trained, and base frozen), and the dense model continued, through
`upcycle compare`, on the embedded SmolLM2-135M (causal LM, held-out perplexity) and the embedded all-MiniLM-L6-v2
(in-batch contrastive, pair retrieval MRR); then `upcycle compress` of each trained full-expert model at rank 16
and 64: the KL to it and the perplexity lost.

    .venv/bin/python benchmarks/studies/delta_study.py --task lm --seeds 0         # the runs (resumable)
    .venv/bin/python benchmarks/studies/delta_study.py --collect                   # JSON and figure from the records

Arms, each one `upcycle compare MODEL WORK/TASK/ARM --methods copy --seeds S --config RECIPE --set BUDGET
--num-experts 8 --top-k 2 --every 2 [--convert-set moe.experts=delta ...]` (compare adds the dense-continued
baseline to each; it is the same run in every arm, and the collection reads it from the full arm):
    full          full experts
    delta16       --convert-set moe.experts=delta --convert-set moe.delta_rank=16
    delta64       the same at rank 64
    delta16-frozen, delta64-frozen   and --convert-set moe.train_base=false
Budgets are those of the expert-count study (LM: 12 steps of 4 x 256 tokens; contrastive: 60 steps of 64 pairs x
64 tokens). A compressed model is evaluated as the cells end (`upcycle eval`: 4,096 held-out tokens in rows of 256;
512 held-out pairs), so its row reads beside theirs.

Each finished cell and compression leaves a small record in benchmarks/results/delta_study/records/ (its score,
parameters, distance, the command that made it), and the collection reads those records, not WORK: the study runs
for hours, so seeds run on different days and machines add up, and a seed already recorded is not run again.
Writes benchmarks/results/delta_study/ (delta_study.json, delta_study.png, the machines, every command).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

from study_commands import run_upcycle

from upcycle.machine import machine
from upcycle.scripts import note, output_folder

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "delta_study"
RECORDS = RESULTS / "records"
ARMS = {
    "full": [],
    "delta16": ["moe.experts=delta", "moe.delta_rank=16"],
    "delta64": ["moe.experts=delta", "moe.delta_rank=64"],
    "delta16-frozen": ["moe.experts=delta", "moe.delta_rank=16", "moe.train_base=false"],
    "delta64-frozen": ["moe.experts=delta", "moe.delta_rank=64", "moe.train_base=false"],
}
COMPRESS_RANKS = (16, 64)
TASKS = {
    "lm": {"model": "default", "recipe": "smollm2-copy", "steps": 12, "budget": ["batch_size=4", "eval_tokens=4096"]},
    "contrastive": {"model": "minilm", "recipe": "minilm-contrastive", "steps": 60,
                    "budget": ["sequence_length=64", "eval_pairs=512", "eval_every=60"]},
}
COMMANDS: list[str] = []


run = functools.partial(run_upcycle, COMMANDS)      # one upcycle command, in this process, recorded


def record_path(task: str, row: str, seed: int) -> Path:
    return RECORDS / task / f"{row.replace(' ', '-').replace(',', '')}-seed-{seed}.json"


def record(task: str, row: str, seed: int, **fields) -> None:
    """A finished cell's or compression's record, written once (a second run of the seed is skipped, not added)."""
    path = record_path(task, row, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"task": task, "row": row, "seed": seed, **fields, "machine": machine()}, indent=1)
                    + "\n")


def recorded(task: str, row: str, seed: int) -> bool:
    return record_path(task, row, seed).is_file()


def records(task: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((RECORDS / task).glob("*.json"))]


def compare(work: Path, task: str, arm: str, seed: int) -> None:
    """The arm's cells for one seed, recorded: the copy cell, and for the full arm the dense-continued one (compare
    runs it in every arm; one record of it is enough)."""
    if recorded(task, f"copy {arm}", seed):
        return
    spec = TASKS[task]
    if not (work / task).is_dir():          # the task's folder made and recorded as the study's
        (work / task).mkdir()
        note(work / task)
    sets = [flag for s in [*spec["budget"], f"steps={spec['steps']}"] for flag in ("--set", s)]
    converts = [flag for s in ARMS[arm] for flag in ("--convert-set", s)]
    run("compare", spec["model"], str(work / task / arm), "--methods", "copy", "--seeds", str(seed), "--config",
        spec["recipe"], *sets, *converts, "--num-experts", "8", "--top-k", "2", "--every", "2", "--keep", "models",
        "--quiet")
    for path in sorted((work / task / arm / "cells").glob(f"*-seed-{seed}/cell.json")):
        cell = json.loads(path.read_text())
        row = "dense" if cell["method"] == "dense" else f"copy {arm}"
        if cell.get("evals") and (row != "dense" or arm == "full"):
            record(task, row, seed, quality=score(task, cell["evals"][-1]), parameters=cell.get("parameters"),
                   command=COMMANDS[-1])


def trained(work: Path, task: str, arm: str, seed: int) -> Path:
    return work / task / arm / "cells" / f"copy-eesd-none-seed-{seed}" / "run" / "model"


def compress(work: Path, task: str, seed: int) -> None:
    """The seed's trained full-expert model compressed at each rank and evaluated as the cells end, recorded."""
    for rank in COMPRESS_RANKS:
        row = f"copy full, compressed r{rank}"
        if recorded(task, row, seed):
            continue
        source = trained(work, task, "full", seed)
        if not source.is_dir():
            sys.exit(f"{row}, seed {seed}: the trained full-expert model is not in {source} (the full arm was "
                     f"recorded on another machine); remove its record in {RECORDS / task} to run the arm again")
        out = work / task / "compress" / f"r{rank}-seed-{seed}"
        if not out.parent.is_dir():
            out.parent.mkdir(parents=True)
            note(out.parent)
        run("compress", str(source), str(out), "--rank", str(rank), "--overwrite", "--quiet")
        budget = ["--task", "contrastive", "--pairs", "512"] if task == "contrastive" else \
            ["--tokens", "4096", "--sequence-length", "256"]
        evaluation = out.with_suffix(".eval.json")
        run("eval", str(out), *budget, "--out", str(evaluation), "--overwrite", "--quiet")
        note(evaluation)
        report = json.loads((out / "compress_report.json").read_text())
        # an encoder's output is no distribution: its distance is the largest difference of the output
        record(task, row, seed, quality=score(task, json.loads(evaluation.read_text())),
               distance_to_source=report["kl_to_source"] if task == "lm" else report["max_abs_logit_diff"],
               command=COMMANDS[-2:])                  # the compress and the eval


def score(task: str, evaluation: dict) -> float:
    return evaluation["perplexity"] if task == "lm" else evaluation["query_to_document"]["MRR"]


def spread(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "values": values}


def paired(row: dict, full: dict | None, name: str) -> dict:
    """The row's quality minus the full-expert row's, seed by seed: a seed fixes the data order and the
    initialization of every row alike, so the seeds move the rows together and the paired difference is the
    comparison the seeds can settle (its spread is smaller than either row's)."""
    if full is None or name == "copy full":
        return {}
    by_seed = dict(zip(full["seeds"], full["end"], strict=True))
    differences = [q - by_seed[s] for s, q in zip(row["seeds"], row["end"], strict=True) if s in by_seed]
    return {"minus_copy_full": spread(differences)} if differences else {}


def collect() -> dict:
    """Every task's rows from the records: each row's seeds, its quality's mean, std and values, and for the
    compressed rows their distance to the source."""
    result = {"collected": time.strftime("%Y-%m-%d %H:%M:%S"), "machines": [], "tasks": {}}
    commands = []
    for task in TASKS:
        rows = {}
        for rec in sorted(records(task), key=lambda r: r["seed"]):
            row = rows.setdefault(rec["row"], {"seeds": [], "end": [], "kl": [], "parameters": rec.get("parameters")})
            row["seeds"].append(rec["seed"])
            row["end"].append(rec["quality"])
            if "distance_to_source" in rec:
                row["kl"].append(rec["distance_to_source"])
            kind = {k: v for k, v in rec["machine"].items() if k != "load_average"}   # the machine, not its moment
            if kind not in result["machines"]:
                result["machines"].append(kind)
            commands += [c for c in ([rec["command"]] if isinstance(rec["command"], str) else rec["command"])
                         if c not in commands]
        if rows:
            result["tasks"][task] = {
                "quality": "held-out perplexity (lower is better)" if task == "lm" else
                "pair retrieval MRR, query to document (higher is better)",
                "budget": {"recipe": TASKS[task]["recipe"], "set": TASKS[task]["budget"],
                           "steps": TASKS[task]["steps"]},
                "distance_to_source": "KL of the compressed model to the trained full-expert one (nats per token, the "
                                      "report's probe)" if task == "lm" else
                "max |difference| of the last hidden state from the trained full-expert model's (the report's probe)",
                "rows": {name: {"seeds": row["seeds"],
                                **({"parameters": row["parameters"]} if row["parameters"] else {}),
                                "quality": spread(row["end"]),
                                **({"distance_to_source": spread(row["kl"])} if row["kl"] else {}),
                                **paired(row, rows.get("copy full"), name)}
                         for name, row in rows.items()}}
    result["commands"] = commands
    return result


ORDER = ("dense", "copy full", *(f"copy {arm}" for arm in ARMS if arm != "full"),
         *(f"copy full, compressed r{rank}" for rank in COMPRESS_RANKS))


def figure(result: dict, path: Path) -> None:
    """Per task two panels: each row's seeds as dots and their mean ± std as a bar, the dense model's mean dashed;
    and each row minus the full-expert row, seed by seed (the comparison the seeds settle), zero dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(result["tasks"])
    fig, axes = plt.subplots(len(tasks), 2, figsize=(13, 4 * len(tasks)), squeeze=False)
    for (left, right), task in zip(axes, tasks, strict=True):
        rows = result["tasks"][task]["rows"]
        names = [n for n in ORDER if n in rows][::-1]
        for ax, key, line in ((left, "quality", rows.get("dense", {}).get("quality", {}).get("mean")),
                              (right, "minus_copy_full", 0.0)):
            for i, name in enumerate(names):
                if key in rows[name]:
                    q = rows[name][key]
                    ax.scatter(q["values"], [i] * len(q["values"]), color="#4c72b0", s=14, zorder=3)
                    ax.errorbar(q["mean"], i, xerr=q["std"], fmt="|", color="black", markersize=14, capsize=3,
                                zorder=2)
            if line is not None:
                ax.axvline(line, color="gray", ls="--", lw=1)
            ax.ticklabel_format(axis="x", useOffset=False)
        left.set_yticks(range(len(names)), [f"{n} ({len(rows[n]['quality']['values'])} seeds)" for n in names])
        right.set_yticks(range(len(names)), [""] * len(names))
        left.set_xlabel(result["tasks"][task]["quality"])
        right.set_xlabel("minus copy full, seed by seed")
        left.set_title({"lm": "SmolLM2-135M, causal LM", "contrastive": "all-MiniLM-L6-v2, contrastive"}[task])
        right.set_title("paired with the full-expert run of the same seed")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=output_folder, default=str(ROOT / "out" / "delta-study"))
    parser.add_argument("--task", choices=TASKS, nargs="+", default=list(TASKS))
    parser.add_argument("--arms", choices=ARMS, nargs="+", default=list(ARMS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--collect", action="store_true")
    args = parser.parse_args()
    if args.collect:
        result = collect()
        if not result["tasks"]:
            sys.exit(f"no records in {RECORDS}: run the study first")
        (RESULTS / "delta_study.json").write_text(json.dumps(result, indent=1) + "\n")
        figure(result, RESULTS / "delta_study.png")
        print(f"wrote {RESULTS}")
        return
    from upcycle.scripts import claim_work

    work = Path(args.work)
    claim_work(work)
    for seed in args.seeds:             # a seed of every task before the next seed: rows come in evenly
        for task in args.task:
            for arm in args.arms:
                compare(work, task, arm, seed)
                if arm == "full":       # compressed while the trained model is at hand
                    compress(work, task, seed)

if __name__ == "__main__":
    main()

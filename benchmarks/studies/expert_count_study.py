"""The expert count changed after training (docs/expert-count.md): trained upcycled models pruned 8 -> 6 and 8 -> 4
by REAP, routing frequency and a random draw, and grown 8 -> 12 / 16 by utility and by turn then trained on, against
the 8-expert model trained the same steps; for the embedded SmolLM2-135M (causal LM, held-out perplexity and KL to
the unpruned model) and the embedded all-MiniLM-L6-v2 (in-batch contrastive, pair retrieval MRR).

    .venv/bin/python benchmarks/studies/expert_count_study.py          # every part of both tasks, then --collect
    .venv/bin/python benchmarks/studies/expert_count_study.py --task lm --part prune   # one part
    .venv/bin/python benchmarks/studies/expert_count_study.py --collect   # the JSON and figure from WORK
    .venv/bin/python benchmarks/studies/expert_count_study.py --part grow   # the growth rows again (their copy
                                                     # model trained first), the pruning rows kept from the JSON

Parts, per task (rerunning one skips what is finished):
    train   upcycle compare MODEL WORK/TASK/compare --methods copy,cluster --seeds 0 --config RECIPE --set BUDGET
              --num-experts 8 --top-k 2 --every 2 --keep models      (the dense-continued row comes with it)
    prune   for each trained MoE (copy, cluster), N in 6, 4, --by in reap, frequency, random, seed in 0, 1, 2:
              upcycle prune TRAINED WORK/TASK/prune/METHOD-N-BY-SEED --num-experts N --by BY --seed SEED
            (each from the trained 8-expert model, so every report's KL is to the unpruned model; the seed draws the
            calibration tokens, and random's experts); contrastive: then upcycle eval --task contrastive on each
    grow    from the trained copy model, seed in 0, 1, 2: upcycle grow TRAINED G --num-experts N --by BY
              --perturb noise --seed SEED for (16, utility), (12, utility), (12, uniform), then
              upcycle train G RUN --config RECIPE --set GROW_BUDGET --seed SEED, and the 8-expert trained model
              trained the same way (row `8 (not grown)`)
            At 16 = 2 x 8 utility and uniform copy the same experts (each once), so 16 has one row; at 12 they
            pick different four.

Budgets are the packaged recipes (smollm2-copy, minilm-contrastive) shortened with --set to what 2 CPU cores run
in about an hour and a half (LM: 12 training steps of 4 x 256 tokens, then 8 after growth; contrastive: 60 steps of
64 pairs x 64 tokens, then 30); --steps / --grow-steps change them. Writes benchmarks/results/expert_count/
(expert_count.json, expert_count.png, the machine and every command).
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
RESULTS = ROOT / "benchmarks" / "results" / "expert_count"
METHODS = ("copy", "cluster")
PRUNE_TO = (6, 4)
PRUNE_BY = ("reap", "frequency", "random")
GROW = ((16, "utility"), (12, "utility"), (12, "uniform"))
SEEDS = (0, 1, 2)
TASKS = {
    "lm": {"model": "default", "recipe": "smollm2-copy", "steps": 12, "grow_steps": 8,
           "budget": ["batch_size=4", "eval_tokens=4096"]},
    "contrastive": {"model": "minilm", "recipe": "minilm-contrastive", "steps": 60, "grow_steps": 30,
                    "budget": ["sequence_length=64", "eval_pairs=512"]},
}
COMMANDS: list[str] = []


run = functools.partial(run_upcycle, COMMANDS)      # one upcycle command, in this process, recorded


def folder(path: Path) -> Path:
    """A folder of the claimed work folder made and recorded as the study's (so a rerun may continue in it)."""
    if not path.is_dir():
        path.mkdir(parents=True)
        note(path)
    return path


def evaluate(model: Path, out: Path) -> None:
    """Pair retrieval of `model` into the JSON file `out`, recorded as the study's."""
    if not out.is_file():
        run("eval", str(model), "--task", "contrastive", "--pairs", "512", "--out", str(out), "--quiet")
        note(out)


def keep_only(output: Path, wanted: str, as_name: Path) -> None:
    """`output`'s file `wanted` copied to `as_name` (recorded as the study's), then the output removed through its
    own ownership record: the models are gigabytes each (36 pruned, 21 grown or trained per task), the study needs
    their reports and logs."""
    import shutil

    from upcycle.outputs.ownership import remove_owned

    shutil.copyfile(output / wanted, as_name)
    note(as_name)
    left = remove_owned(output)
    if left:
        sys.exit(f"{output}: left {left} (not upcycle's)")


def budget(task: str, steps: int) -> list[str]:
    spec = TASKS[task]
    sets = [*spec["budget"], f"steps={steps}"] + ([f"eval_every={steps}"] if task == "contrastive" else [])
    return [flag for s in sets for flag in ("--set", s)]


def trained(work: Path, task: str, method: str) -> Path:
    return work / task / "compare" / "cells" / f"{method}-eesd-none-seed-0" / "run" / "model"


def part_train(work: Path, task: str, args: argparse.Namespace) -> None:
    spec = TASKS[task]
    folder(work / task)
    # growth starts from the copy model alone: a run of the grow part trains only what it needs
    methods = ("copy",) if args.part == "grow" else METHODS
    run("compare", spec["model"], str(work / task / "compare"), "--methods", ",".join(methods), "--seeds", "0",
        "--config", spec["recipe"], *budget(task, args.steps[task]), "--num-experts", "8", "--top-k", "2",
        "--every", "2", "--keep", "models", "--quiet")


def part_prune(work: Path, task: str, args: argparse.Namespace) -> None:
    folder(work / task / "prune")
    for method in METHODS:
        source = trained(work, task, method)
        for n in PRUNE_TO:
            for by in PRUNE_BY:
                for seed in SEEDS:
                    out = work / task / "prune" / f"{method}-{n}-{by}-{seed}"
                    report = out.with_name(f"{out.name}.report.json")
                    if report.is_file():
                        continue
                    if not (out / "resize_report.json").is_file():
                        run("prune", str(source), str(out), "--num-experts", str(n), "--by", by, "--seed",
                            str(seed), "--quiet")
                    if task == "contrastive":
                        evaluate(out, out.parent / f"{out.name}.eval.json")
                    keep_only(out, "resize_report.json", report)
        if task == "contrastive":
            evaluate(source, work / task / "prune" / f"{method}-8.eval.json")


def default_texts(folder: Path) -> list[str]:
    """The embedded Wikipedia train and held-out splits, which compare's cells trained and evaluated on, as files
    (a grown folder, unlike the embedded model's conversions, does not name the embedded model as its source, so
    `upcycle train` needs its text given): the flags that give them."""
    from upcycle.data.text import wikipedia_split

    flags = []
    for split, texts in zip(("train", "held-out"), wikipedia_split(), strict=True):
        path = folder / f"wikipedia-{split}.jsonl"
        if not path.is_file():
            path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
            note(path)
        flags += ["--data", str(path)] if split == "train" else ["--set", f"eval_data={path}"]
    return flags


def part_grow(work: Path, task: str, args: argparse.Namespace) -> None:
    spec, source = TASKS[task], trained(work, task, "copy")
    folder(work / task / "grow")
    data = default_texts(work / task) if task == "lm" else []
    for seed in args.seeds:
        for n, by in (*GROW, (8, None)):
            name = f"{n}-{by}-{seed}" if by else f"8-{seed}"
            log = work / task / "grow" / f"{name}.log.jsonl"
            start = work / task / "grow" / f"{name}.model" if by is not None else source
            out = work / task / "grow" / f"{name}.run"
            grow = ["grow", str(source), str(start), "--num-experts", str(n), "--by", str(by), "--perturb", "noise",
                    "--seed", str(seed), "--quiet"]
            train = ["train", str(start), str(out), "--config", spec["recipe"], *budget(task, args.grow_steps[task]),
                     *data, "--seed", str(seed), "--overwrite", "--quiet"]
            if log.is_file():           # finished before: its commands recorded as they ran
                COMMANDS.extend("upcycle " + " ".join(argv) for argv in ([grow] if by else []) + [train])
                continue
            if by is not None and not (start / "resize_report.json").is_file():
                run(*grow)
            if not (out / "model").is_dir():
                run(*train)
            if by is not None:
                keep_only(start, "resize_report.json", start.with_name(f"{name}.report.json"))
            keep_only(out, "log.jsonl", log)


# ----------------------------------------------------------------------------------------------- collect
DISTANCE = {"lm": "KL of the new model to the trained 8-expert one (nats per token, the report's probe)",
            "contrastive": "max |difference| of the last hidden state from the trained 8-expert model's (the "
                           "report's probe; an encoder's output is no distribution to take a KL of)"}


def distance(task: str, report: dict) -> float:
    return report["kl_to_source"] if task == "lm" else report["max_abs_logit_diff"]


def score(task: str, evaluation: dict) -> float:
    return evaluation["perplexity"] if task == "lm" else evaluation["query_to_document"]["MRR"]


def spread(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "values": values}


def collect_prune(work: Path, task: str) -> dict:
    rows = {}
    for method in METHODS:
        base = None
        for n in PRUNE_TO:
            for by in PRUNE_BY:
                far, quality = [], []
                for seed in SEEDS:
                    folder = work / task / "prune" / f"{method}-{n}-{by}-{seed}"
                    report = json.loads(folder.with_name(f"{folder.name}.report.json").read_text())
                    far.append(distance(task, report))
                    if task == "lm":
                        quality.append(report["held_out_perplexity"]["after"])
                        base = report["held_out_perplexity"]["before"]
                    else:
                        quality.append(score(task, json.loads(folder.with_name(f"{folder.name}.eval.json")
                                                              .read_text())))
                rows[f"{method} 8->{n} {by}"] = {"method": method, "experts": n, "by": by, "distance": spread(far),
                                                 "quality": spread(quality)}
        if task == "contrastive":
            base = score(task, json.loads((work / task / "prune" / f"{method}-8.eval.json").read_text()))
        rows[f"{method} 8 (unpruned)"] = {"method": method, "experts": 8, "by": None, "quality": spread([base])}
    return rows


def final_eval(log: Path) -> dict:
    """The run's first and last evaluation, and its median step time (the same active compute per token: what
    the extra experts cost on this machine)."""
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    evals = [r["eval"] for r in rows if "eval" in r]
    return {"start": evals[0], "end": evals[-1],
            "step_seconds": statistics.median(r["seconds"] for r in rows if "loss" in r)}


def grown_seeds(work: Path, task: str, seeds: tuple[int, ...] = SEEDS) -> list[int]:
    """The seeds of `seeds` whose every growth row has finished (a task may have run fewer than another)."""
    names = [f"{n}-{by}" if by else "8" for n, by in (*GROW, (8, None))]
    return [s for s in seeds if all((work / task / "grow" / f"{name}-{s}.log.jsonl").is_file() for name in names)]


def collect_grow(work: Path, task: str, seeds: tuple[int, ...] = SEEDS) -> dict:
    rows = {}
    seeds = tuple(grown_seeds(work, task, seeds))
    if not seeds:
        raise SystemExit(f"{work / task / 'grow'}: no seed has every growth row finished")
    for n, by in (*GROW, (8, None)):
        start, end, far, seconds, reached = [], [], [], [], []
        for seed in seeds:
            name = f"{n}-{by}-{seed}" if by else f"8-{seed}"
            evals = final_eval(work / task / "grow" / f"{name}.log.jsonl")
            start.append(score(task, evals["start"]))
            end.append(score(task, evals["end"]))
            seconds.append(evals["step_seconds"])
            if by is not None:
                report = json.loads((work / task / "grow" / f"{name}.report.json").read_text())
                far.append(distance(task, report))
                reached.append(min(min(layer["load_after"]) / (sum(layer["load_after"]) / len(layer["load_after"]))
                                   for layer in report["layers"].values() if layer.get("load_after")))
        rows[f"{n} {by}" if by else "8 (not grown)"] = {
            "experts": n, "by": by, "after_growth": spread(start), "after_training": spread(end),
            "distance": spread(far) if far else None, "median_step_seconds": spread(seconds),
            # the least-loaded expert's load on the probe right after growth, over the mean load (0: an expert
            # no token reaches; copies whose logits were shifted by -log n gave 0)
            "least_load_over_mean_after_growth": spread(reached) if reached else None,
            "change_in_training": spread([b - a for a, b in zip(start, end, strict=True)])}
    return rows


def beyond_spread(a: dict, b: dict) -> bool:
    """Whether two rows' means differ by more than twice the larger of their seed standard deviations (the rule
    the contrastive study states its differences by)."""
    return abs(a["mean"] - b["mean"]) > 2 * max(a["std"], b["std"])


def differences(data: dict) -> list[str]:
    """Every pair of pruning rules at one (method, N), and every grown row against the 8-expert one, whose
    difference exceeds the seed spread."""
    found = []
    for method in METHODS:
        for n in PRUNE_TO:
            rows = {by: data["prune"][f"{method} 8->{n} {by}"] for by in PRUNE_BY}
            for i, x in enumerate(PRUNE_BY):
                for y in PRUNE_BY[i + 1:]:
                    for key in ("distance", "quality"):
                        if beyond_spread(rows[x][key], rows[y][key]):
                            low, high = sorted((x, y), key=lambda by: rows[by][key]["mean"])
                            found.append(f"{method} 8->{n}, {key}: {low} lower than {high} "
                                         f"({rows[low][key]['mean']:.4g} vs {rows[high][key]['mean']:.4g})")
    base = data["grow"]["8 (not grown)"]["after_training"]
    for name, row in data["grow"].items():
        # one seed has no spread to judge a difference by
        if name != "8 (not grown)" and len(base["values"]) > 1 and beyond_spread(row["after_training"], base):
            found.append(f"grown {name} vs 8 after training: {row['after_training']['mean']:.4g} vs "
                         f"{base['mean']:.4g}")
    return found


def collect(work: Path, args: argparse.Namespace) -> None:
    result = {"machine": machine(), "collected": time.strftime("%Y-%m-%d %H:%M:%S"),
              "commands": json.loads((work / "commands.json").read_text()) if (work / "commands.json").is_file()
              else [], "tasks": {}}
    # a part run again alone (--part grow) replaces its rows; the other part's rows stay those of the last
    # collection, which the JSON names with its date
    earlier = json.loads((RESULTS / "expert_count.json").read_text()) if (RESULTS / "expert_count.json").is_file() \
        else {"tasks": {}}
    for task in TASKS:
        if not (work / task / "grow").is_dir():
            if task in earlier["tasks"]:          # not run this time: its rows as last collected
                result["tasks"][task] = earlier["tasks"][task]
            continue
        comparison = json.loads((work / task / "compare" / "comparison.json").read_text())
        before = earlier["tasks"].get(task, {})
        pruned = (work / task / "prune").is_dir()
        if not pruned and "prune" not in before:
            raise SystemExit(f"{work / task / 'prune'} is missing and no earlier results hold its rows")
        trained_now = {cell["name"]: cell["evals"][-1] if "evals" in cell else cell.get("eval")
                       for cell in comparison.get("cells", [])}
        result["tasks"][task] = {
            "quality": "held-out perplexity (lower is better)" if task == "lm" else
            "pair retrieval MRR, query to document (higher is better)", "distance": DISTANCE[task],
            "budget": {"recipe": TASKS[task]["recipe"], "set": TASKS[task]["budget"], "steps": args.steps[task],
                       "grow_steps": args.grow_steps[task], "grow_seeds": grown_seeds(work, task, args.seeds)},
            "trained": trained_now if pruned else {**before.get("trained", {}), **trained_now},
            "prune": collect_prune(work, task) if pruned else before["prune"],
            "measured": {"prune": result["collected"] if pruned else
                         before.get("measured", {}).get("prune", earlier.get("collected")),
                         "grow": result["collected"]},
            "grow": collect_grow(work, task, tuple(args.seeds))}
        if not pruned:             # the carried rows' commands, as the earlier collection recorded them
            result["commands"] += [c for c in earlier.get("commands", []) if f"/{task}/prune/" in c
                                   and c not in result["commands"]]
        result["tasks"][task]["differences_beyond_seed_spread"] = differences(result["tasks"][task])
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "expert_count.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, RESULTS / "expert_count.png")
    print(f"wrote {RESULTS / 'expert_count.json'} and expert_count.png")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(result["tasks"])
    fig, axes = plt.subplots(len(tasks), 3, figsize=(16, 3.8 * len(tasks)), squeeze=False)
    for row, task in zip(axes, tasks, strict=True):
        data = result["tasks"][task]
        label = "held-out perplexity (probe)" if task == "lm" else "retrieval MRR (q->d)"
        for method, marker in zip(METHODS, ("o", "s"), strict=True):
            base = data["prune"][f"{method} 8 (unpruned)"]["quality"]["mean"]
            for by, color in zip(PRUNE_BY, ("tab:blue", "tab:orange", "tab:gray"), strict=True):
                cells = [data["prune"][f"{method} 8->{n} {by}"] for n in PRUNE_TO]
                style = dict(marker=marker, color=color, capsize=3, linestyle="-" if method == "copy" else "--",
                             label=f"{method}, {by}")
                row[0].errorbar(PRUNE_TO, [c["distance"]["mean"] for c in cells],
                                yerr=[c["distance"]["std"] for c in cells], **style)
                row[1].errorbar([8, *PRUNE_TO], [base, *(c["quality"]["mean"] for c in cells)],
                                yerr=[0, *(c["quality"]["std"] for c in cells)], **style)
        row[0].set(title=f"{task}: pruned model against the unpruned", xlabel="experts per layer",
                   ylabel="KL (nats per token)" if task == "lm" else "max |hidden state difference|",
                   yscale="log", xticks=PRUNE_TO, xlim=(6.5, 3.5))
        row[1].set(title=f"{task}: pruned after training (mean, std over 3 seeds)", xlabel="experts per layer",
                   ylabel=label, xticks=[8, *PRUNE_TO], xlim=(8.5, 3.5))
        row[0].legend(fontsize=7)
        names = list(data["grow"])
        for i, name in enumerate(names):
            g = data["grow"][name]
            row[2].errorbar([i - 0.1], [g["after_growth"]["mean"]], yerr=[g["after_growth"]["std"]], marker="o",
                            color="tab:gray", capsize=3, label="after growth" if i == 0 else None)
            row[2].errorbar([i + 0.1], [g["after_training"]["mean"]], yerr=[g["after_training"]["std"]],
                            marker="o", color="tab:green", capsize=3, label="after training" if i == 0 else None)
        row[2].set_xticks(range(len(names)), names)
        seeds = len(data["budget"].get("grow_seeds", SEEDS))
        row[2].set(title=f"{task}: grown from 8 then trained ({seeds} seed{'s' * (seeds > 1)})",
                   ylabel=label.replace(" (probe)", ""))
        row[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=output_folder, default=str(ROOT / "out" / "expert-count"))
    parser.add_argument("--task", choices=(*TASKS, "all"), default="all")
    parser.add_argument("--part", choices=("train", "prune", "grow", "all"), default="all")
    parser.add_argument("--collect", action="store_true", help="only collect WORK into benchmarks/results/")
    parser.add_argument("--steps", type=int, help="training steps after conversion (default: the task's)")
    parser.add_argument("--grow-steps", type=int, dest="grow_steps", help="training steps after growth")
    parser.add_argument("--seeds", type=lambda text: tuple(int(x) for x in text.split(",")), default=SEEDS,
                        help="the growth rows' seeds (default 0,1,2)")
    args = parser.parse_args()
    args.steps = {t: args.steps or spec["steps"] for t, spec in TASKS.items()}
    args.grow_steps = {t: args.grow_steps or spec["grow_steps"] for t, spec in TASKS.items()}
    work = Path(args.work)
    if not args.collect:
        from upcycle.scripts import claim_work

        claim_work(work)
        recorded = work / "commands.json"
        COMMANDS.extend(json.loads(recorded.read_text()) if recorded.is_file() else [])
        parts = {"train": part_train, "prune": part_prune, "grow": part_grow}
        for task in TASKS if args.task == "all" else (args.task,):
            for name, part in parts.items():
                if args.part in (name, "all") or (args.part == "grow" and name == "train"):
                    part(work, task, args)
                    recorded.write_text(json.dumps(COMMANDS, indent=1) + "\n")
                    note(recorded)
    if args.collect or (args.task == "all" and args.part in ("all", "grow")):
        collect(work, args)


if __name__ == "__main__":
    main()

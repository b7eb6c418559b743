"""The method study on the contrastive task (docs/contrastive.md, "Study"): the embedded all-MiniLM-L6-v2
(`minilm`) upcycled to 8 experts, top-2, in every other block and in every block, trained with in-batch InfoNCE
on the packaged pairs, against the dense encoder continued the same way, through `upcycle compare`.

    .venv/bin/python benchmarks/studies/contrastive_study.py --part pilot         # dense + copy, seed 0, short: minutes
    .venv/bin/python benchmarks/studies/contrastive_study.py --part eesd-probe  # the EESD λ grid from step-1 grad norms
    .venv/bin/python benchmarks/studies/contrastive_study.py                       # every part in turn, then --collect
    .venv/bin/python benchmarks/studies/contrastive_study.py --part every-2-seed-1 # one part
    .venv/bin/python benchmarks/studies/contrastive_study.py --collect             # the table, curves, statement

Rows: dense-continued, copy, cluster, cluster + EESD at three λ, drop, spri; placements every-2 (blocks 2, 4, 6)
and every-1 (all six); seeds 0, 1, 2. The parts are `upcycle compare` invocations into WORK/every-2 and
WORK/every-1 (rerunning a part resumes it: finished cells are skipped, an interrupted one resumes from its
checkpoint; parts of different seeds may run at the same time):

    PLACEMENT-seed-S        upcycle compare minilm WORK/PLACEMENT --methods copy,cluster,drop,spri --eesd none
                              --seeds S --config minilm-contrastive --num-experts 8 --top-k 2 --every N --quiet
    PLACEMENT-eesd-seed-S   upcycle compare minilm WORK/PLACEMENT --methods cluster --eesd λ1,λ2,λ3 --seeds S ...

(seed 0 keeps the models, `--keep models`, so that `--part analyze` can run `upcycle analyze` on them; the other
seeds keep JSON and logs only). The budget every cell trains with is a packaged recipe (minilm-contrastive, and
minilm-contrastive-gpu / -gpu-long with --gpu / --long): the study is that recipe run through `upcycle compare`;
--steps, --batch-size, --eval-pairs, --eval-every, --sequence-length and --lr change it with `--set`, the same for
every part; a part run with another budget into the same WORK is refused by `upcycle compare` (the cells were
planned otherwise). What this script adds to compare's own results: the EESD probe, the analysis of seed 0's runs,
and the collection of both placements with the differences beyond the seed spread.

EESD's λ: at λ = 1 the LM study's EESD gradient was ~10^4 times the task's, so λ is chosen from this model's own
first step. `--part eesd-probe` trains the seed-0 every-2 cluster conversion (made by part every-2-seed-0) one
step with EESD off and one with λ = 1 and reads the gradient norms g0 and g1 of their logs; the EESD gradient is
then about sqrt(g1² - g0²), λ* = g0 / that puts the two level, and the grid is λ* × (0.1, 1, 10) at one
significant digit (WORK/eesd_lambdas.json; --eesd overrides it).

`--part pilot`: the dense and copy rows on seed 0 with a short budget (--pilot-steps at the study's batch size and
sequence length; WORK/pilot), one timed cluster conversion of minilm (every 2, calibrated as compare calibrates:
texts of the training pairs), and each run's median step time and tokens/s, written to
benchmarks/results/contrastive_study/pilot/ (labelled pilot: the budget is not the study's).

`--part analyze`: `upcycle analyze` on the seed-0 run of every MoE row (its conversion = step 0, and the trained
model), on the held-out pairs by source and role; the per-layer mean specialization (NMI) and its shuffled
baseline go into the collected JSON.

`--collect` merges WORK/*/comparison.json into benchmarks/results/contrastive_study/: comparison.json (machine,
commands, wall time of every invocation, median tokens/s of each cell, every cell), comparison.md (per placement
and row: retrieval right after conversion and at the end, mean ± std over seeds; expert similarity and routing
entropy at init → end; tokens/s; specialization; the statement of which differences exceed the seed spread:
|mean difference| > 2 × the larger of the two standard deviations, needing ≥ 2 seeds in both rows) and
curves.png (Q→D MRR over the steps, and the routing entropy / log E over the steps from the run logs).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from upcycle.cli import main
from upcycle.config_reader import load_recipe, recipe_path
from upcycle.machine import machine
from upcycle.runs.layout import LOG
from upcycle.runs.log import read_log
from upcycle.scripts import output_folder

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "contrastive_study"
RESULTS_GPU = ROOT / "benchmarks" / "results" / "contrastive_study_gpu"
RESULTS_GPU_LONG = ROOT / "benchmarks" / "results" / "contrastive_study_gpu_long"
PLACEMENTS = {"every-2": "2", "every-1": "1"}
# The budget of every cell is a packaged training recipe (src/upcycle/recipes/train/): CPU, the 2-core protocol
# (float32); GPU, the whole design in one call of the device tool (a few minutes), the large-batch regime of
# contrastive training (sentence-transformers trains MiniLM at hundreds of pairs a batch; the paper's CLIP runs at
# tens of thousands), evaluated often enough that the curves give the budget at which rows part; --long, the GPU
# budget's rows that answer the question (dense, copy, cluster) at 10x the pairs, in a second call.
RECIPES = {"cpu": "minilm-contrastive", "gpu": "minilm-contrastive-gpu", "gpu-long": "minilm-contrastive-gpu-long"}
BUDGET_KEYS = ("steps", "batch_size", "sequence_length", "eval_pairs", "eval_every", "lr")


def packaged(name: str) -> dict:
    return load_recipe(recipe_path(name, "train"))


BUDGETS = {budget: {key: packaged(name)[key] for key in BUDGET_KEYS} for budget, name in RECIPES.items()}
SEEDS = (0, 1, 2)
METHODS = "copy,cluster,drop,spri"
MAIN = ("qd_mrr", ("query_to_document", "MRR"))


def recipe_flags(args: argparse.Namespace, **budget) -> list[str]:
    """`--config RECIPE` and a `--set` for each budget key (this invocation's, or `budget`'s) that the packaged
    recipe does not already hold: the study is its recipe, run through `upcycle compare`."""
    base = packaged(args.recipe)
    flags = ["--config", args.recipe]
    for key in BUDGET_KEYS:
        value = budget.get(key, getattr(args, key))
        if value != base[key]:
            flags += ["--set", f"{key}={value!r}"]
    return flags


def study_recipe(args: argparse.Namespace, **budget) -> dict:
    """The training recipe every cell ran with: the packaged one with the budget's keys (for the records)."""
    return {**packaged(args.recipe), **{key: budget.get(key, getattr(args, key)) for key in BUDGET_KEYS}}


def compare_command(folder: Path, every: str, methods: str, eesd: str, seed: int, recipe: list[str],
                    keep: str) -> list[str]:
    return ["compare", "minilm", str(folder), "--methods", methods, "--eesd", eesd, "--seeds", str(seed), *recipe,
            "--num-experts", "8", "--top-k", "2", "--every", every, "--keep", keep, "--quiet"]


def lambdas(work: Path, given: str | None) -> str | None:
    """The EESD grid: --eesd's, else the probe's; 'none' for a design without EESD cells."""
    if given:
        return given
    path = work / "eesd_lambdas.json"
    return ",".join(f"{v:g}" for v in json.loads(path.read_text())["grid"]) if path.is_file() else None


def parts(work: Path, args: argparse.Namespace) -> dict[str, list[str]]:
    recipe = recipe_flags(args)
    grid = lambdas(work, args.eesd)
    out = {}
    for placement, every in args.placements.items():
        for seed in args.seeds:
            # seed 0 keeps its models: the EESD probe trains its cluster conversion, --part analyze its runs; on
            # the GPU every seed does (its EESD cells reuse its cluster conversion; only JSON comes back)
            keep = "models" if seed == 0 or args.gpu else "results"
            out[f"{placement}-seed-{seed}"] = compare_command(work / placement, every, args.methods, "none", seed,
                                                              recipe, keep)
            if grid and grid != "none":
                out[f"{placement}-eesd-seed-{seed}"] = compare_command(work / placement, every, "cluster", grid,
                                                                       seed, recipe, keep)
    return out


def step_timing(cell: dict) -> dict | None:
    """A cell's median step seconds and tokens/s (compare's, from the run's log: undisturbed by evaluations)."""
    train = cell.get("train") or {}
    if not train.get("steps"):
        return None
    return {"steps": train["steps"], "median_step_seconds": round(train["median_step_seconds"], 3),
            "median_tokens_per_s": round(train["median_tokens_per_s"], 1)}


def entropy_ratio_curve(cell: dict) -> dict[int, float]:
    """Step -> the routing entropy / log E over the steps (8 experts), from compare's per-step curves."""
    curves = cell.get("curves") or {}
    return {step: value / math.log(8) for step, value in zip(curves.get("step", []),
                                                             curves.get("routing_entropy", []), strict=True)
            if value is not None}


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


# ---------------------------------------------------------------- pilot
def pilot(work: Path, args: argparse.Namespace) -> None:
    folder = work / "pilot"
    budget = {"steps": args.pilot_steps, "eval_pairs": args.pilot_eval_pairs,
              "eval_every": max(1, args.pilot_steps // 2)}
    command = compare_command(folder / "study", "2", "copy", "none", 0, recipe_flags(args, **budget), "models")
    load_before = load_average()
    assert main(command) == 0              # a rerun skips the finished cells: the wall times are the first run's
    cluster = cluster_conversion(folder, args)
    study = folder / "study"
    result = json.loads((study / "comparison.json").read_text())
    compare_s = result["seconds_all_invocations"]
    runs = {c["name"]: step_timing(c) for c in result["cells"]
            if c["name"] in ("dense-seed-0", "copy-eesd-none-seed-0")}
    record = {"label": "PILOT: a short budget to test the script end to end and to time a step; not the study",
              "machine": machine(), "load_average_before": load_before, "load_average_after": load_average(),
              "recipe": study_recipe(args, **budget),
              "commands": [" ".join(["upcycle", *command]), cluster["command"]],
              "wall_seconds": {"compare": round(compare_s, 1), "cluster_conversion": cluster["seconds"]},
              "step_timing": runs, "cluster_conversion": cluster,
              "estimate": estimate(args, runs, cluster, result),
              "comparison": result}
    out = args.results / "pilot"
    out.mkdir(parents=True, exist_ok=True)
    (out / "pilot.json").write_text(json.dumps(record, indent=1) + "\n")
    md = (study / "comparison.md").read_text().replace("# upcycle compare:", "# PILOT (short budget) upcycle compare:")
    (out / "comparison.md").write_text(md)
    for name in ("metric_over_steps.png", "init_diagnostics.png"):
        shutil.copyfile(study / name, out / name)
    print(json.dumps({k: record[k] for k in ("step_timing", "wall_seconds", "estimate")}, indent=1))
    print(f"wrote {out}")


def cluster_conversion(folder: Path, args: argparse.Namespace) -> dict:
    """One cluster conversion of minilm (8 experts, top-2, every 2), calibrated on the training pairs' texts as
    `upcycle compare` makes them (`upcycle.compare.text_calibration`), timed by its own report."""
    from upcycle.compare.text_calibration import TextCalibration, write_text_calibration

    calibration = TextCalibration(folder / "train_texts.safetensors", None, None, args.sequence_length, 65536)
    out = folder / "cluster-moe"
    command = ["convert", "minilm", str(out), "--method", "cluster", "--num-experts", "8", "--top-k", "2",
               "--every", "2", "--calibration", str(calibration.path), "--overwrite", "--quiet"]
    wall = folder / "cluster-wall.json"
    if not wall.is_file() or not (out / "upcycle_report.json").is_file():     # timed once; a rerun reads it
        started = time.time()
        write_text_calibration(calibration, "minilm", print)
        texts_s = time.time() - started
        started = time.time()
        assert main(command) == 0
        wall.write_text(json.dumps({"seconds": round(time.time() - started, 1),
                                    "calibration_file_seconds": round(texts_s, 1)}))
    report = json.loads((out / "upcycle_report.json").read_text())
    return {"command": " ".join(["upcycle", *command]), **json.loads(wall.read_text()),
            "timings_s": report["timings_s"], "calibration": report.get("calibration")}


def estimate(args: argparse.Namespace, runs: dict, cluster: dict, result: dict) -> dict:
    """What the full design costs at the study's budget, from the pilot's median steps (evaluations excluded)."""
    dense, copy = runs["dense-seed-0"], runs["copy-eesd-none-seed-0"]
    if not dense or not copy:
        return {}
    every1 = copy["median_step_seconds"] * 1.5          # twice the MoE layers of every-2; a rough factor
    rows_moe = 4 + 3                                    # copy, cluster, drop, spri + cluster with 3 λ
    # each placement's folder runs its own dense-continued cells (the same computation twice: a check that
    # compare is deterministic, and the price of one folder per placement)
    per_seed = args.steps * (2 * dense["median_step_seconds"] + rows_moe * (copy["median_step_seconds"] + every1))
    return {"study_steps": args.steps, "cells": len(args.seeds) * 2 * (1 + rows_moe),
            "training_hours_without_evaluations": round(len(args.seeds) * per_seed / 3600, 1),
            "assumes": "every-1 MoE step = 1.5 x every-2 (not measured); EESD and evaluations not included"}


# ---------------------------------------------------------------- EESD probe
def eesd_probe(work: Path, args: argparse.Namespace) -> None:
    moe = work / "every-2" / "conversions" / "cluster-seed-0" / "moe"
    if not moe.is_dir():
        sys.exit(f"{moe} is missing: run --part every-2-seed-0 first (it converts cluster on seed 0)")
    norms = {}
    for value in (0.0, 1.0):
        out = work / "eesd-probe" / f"eesd-{value:g}"
        if not (out / LOG).is_file() or not any("loss" in json.loads(line) for line in read_log(out / LOG, 1 << 62)):
            assert main(["train", str(moe), str(out), *recipe_flags(args), "--set", "steps=1", "--set",
                         "eval_pairs=1", "--set", f"regularizers.eesd={value}", "--overwrite", "--quiet"]) == 0
        rows = [json.loads(line) for line in read_log(out / LOG, 1 << 62)]
        norms[value] = next(r["grad_norm"] for r in rows if "grad_norm" in r)
    g0, g1 = norms[0.0], norms[1.0]
    eesd = math.sqrt(max(g1 * g1 - g0 * g0, 0.0))
    if eesd <= 0:
        sys.exit(f"EESD added no gradient at step 1 (g0 {g0}, g1 {g1}): choose λ with --eesd")
    level = g0 / eesd
    # the GPU design: the level λ and λ/10 (the CPU study found harm growing with λ); the CPU design adds 10 λ
    grid = [float(f"{level * f:.1g}") for f in ((0.1, 1.0) if args.gpu else (0.1, 1.0, 10.0))]
    record = {"grad_norm_eesd_off": g0, "grad_norm_eesd_1": g1, "eesd_grad_norm_estimate": eesd,
              "lambda_level": level, "grid": grid}
    (work / "eesd_lambdas.json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1))


# ---------------------------------------------------------------- analyze
def analyze_rows(work: Path, args: argparse.Namespace) -> None:
    for placement in args.placements:
        for cell in sorted((work / placement / "cells").glob("*-seed-0")):
            if cell.name.startswith("dense") or not (cell / "cell.json").is_file():
                continue
            out = work / "analysis" / placement / cell.name
            if not (out / "analysis.json").is_file():
                assert main(["analyze", str(cell / "run"), str(out), "--sequence-length", "128", "--quiet"]) == 0


def specialization(work: Path, placement: str, cell: str) -> dict | None:
    path = work / "analysis" / placement / cell / "analysis.json"
    if not path.is_file():
        return None
    out = {}
    for snapshot in json.loads(path.read_text())["snapshots"]:
        specs = [m["specialization"] for m in snapshot["layers"].values()]
        out[snapshot["label"]] = {"nmi": statistics.fmean(s["nmi"] for s in specs),
                                  "shuffled_max": statistics.fmean(s["nmi_baseline"]["max"] for s in specs)}
    return out


# ---------------------------------------------------------------- collect
def exceeding(table: list[dict], name: str, stage: str) -> list[str]:
    """Pairs of rows whose means differ by more than 2 x the larger std over seeds (both with >= 2 seeds)."""
    lines = []
    for i, a in enumerate(table):
        for b in table[i + 1:]:
            sa, sb = a["metrics"][name][stage], b["metrics"][name][stage]
            if sa["std"] is None or sb["std"] is None:
                continue
            diff = sa["mean"] - sb["mean"]
            spread = 2 * max(sa["std"], sb["std"])
            if abs(diff) > spread:
                lines.append(f"{label(a)} {'>' if diff > 0 else '<'} {label(b)}: {sa['mean']:.4f} vs "
                             f"{sb['mean']:.4f} (|diff| {abs(diff):.4f} > 2 × std {spread / 2:.4f})")
    return lines


def label(row: dict) -> str:
    if row["method"] == "dense":
        return "dense"
    return row["method"] if row["eesd"] == "none" else f"{row['method']}+EESD {row['eesd']}"


def fmt(s: dict, digits: int = 3) -> str:
    if s["mean"] is None:
        return "–"
    return f"{s['mean']:.{digits}f}" + ("" if s["std"] is None else f" ± {s['std']:.{digits}f}")


def against_dense_by_step(cells: list[dict], table: list[dict]) -> dict[str, list[dict]]:
    """Each MoE row against the dense row at every evaluation step both have: Q→D MRR mean ± std over seeds, the
    difference, and whether it exceeds the seed spread (|diff| > 2 × the larger std; ≥ 2 seeds in both rows), so
    that the budget at which a row parts from dense can be read off."""
    by_name = {c["name"]: c for c in cells}

    def series(row: dict) -> dict[int, list[float]]:
        out: dict[int, list[float]] = {}
        for name in row["cells"]:
            for e in by_name[name]["evals"] if name in by_name else []:
                out.setdefault(e["step"], []).append(e[MAIN[1][0]][MAIN[1][1]])
        return out

    dense = next((series(r) for r in table if r["method"] == "dense"), {})
    result = {}
    for row in table:
        if row["method"] == "dense":
            continue
        points = []
        for step, values in sorted(series(row).items()):
            base = dense.get(step)
            if not base:
                continue
            mean, base_mean = statistics.fmean(values), statistics.fmean(base)
            stds = [statistics.stdev(v) if len(v) > 1 else None for v in (values, base)]
            spread = 2 * max(stds) if None not in stds else None
            points.append({"step": step, "seeds": len(values), "mean": mean, "dense_mean": base_mean,
                           "diff": mean - base_mean, "two_std": spread,
                           "beyond_spread": spread is not None and abs(mean - base_mean) > spread})
        result[label(row)] = points
    return result


def first_parting(points: list[dict]) -> int | None:
    """The first evaluation step from which a row stays beyond the seed spread from dense to the end."""
    first = None
    for p in points:
        first = (first if first is not None else p["step"]) if p["beyond_spread"] else None
    return first


def collect(work: Path, args: argparse.Namespace) -> None:
    results = args.results
    results.mkdir(parents=True, exist_ok=True)
    # the machine the cells ran on (the GPU runner records it in WORK; collect may run on another machine)
    ran_on = json.loads((work / "machine.json").read_text()) if (work / "machine.json").is_file() else machine()
    merged = {"label": "the contrastive method study (docs/contrastive.md, Study)", "machine": ran_on,
              "collected_on": machine(), "budget": ("gpu-long" if args.long else "gpu") if args.gpu else "cpu",
              "recipe": study_recipe(args),
              # the design's parts (what --list prints); what ran is each placement's "invocations"
              "design_parts": {n: " ".join(["upcycle", *c]) for n, c in parts(work, args).items()},
              "eesd_probe": json.loads((work / "eesd_lambdas.json").read_text())
              if (work / "eesd_lambdas.json").is_file() else None, "placements": {}}
    lines = ["# The contrastive method study: all-MiniLM-L6-v2, 8 experts, top-2", ""]
    grid = [v for v in (lambdas(work, args.eesd) or "").split(",") if v != "none"]
    design = ["dense", *args.methods.split(","), *(f"cluster+EESD {v}" for v in grid if v)]   # every row label
    curves = {}
    for placement in args.placements:
        path = work / placement / "comparison.json"
        if not path.is_file():
            continue
        result = json.loads(path.read_text())
        table = result["table"]
        timing = {c["name"]: step_timing(c) for c in result["cells"]}
        entropy = {c["name"]: entropy_ratio_curve(c) for c in result["cells"]}
        spec = {row["cells"][0]: specialization(work, placement, row["cells"][0]) for row in table}
        statement = {stage: exceeding(table, MAIN[0], stage) for stage in ("after_conversion", "after_training")}
        by_step = against_dense_by_step(result["cells"], table)
        merged["placements"][placement] = {
            "complete": result["complete"], "unfinished": result["unfinished"],
            "wall_seconds_all_invocations": result["seconds_all_invocations"], "invocations": result["invocations"],
            "median_steps": timing, "specialization_seed_0": spec, "differences_beyond_seed_spread": statement,
            "against_dense_by_step": by_step,
            "first_step_beyond_spread_from_dense": {name: first_parting(p) for name, p in by_step.items()},
            "table": table, "cells": result["cells"]}
        curves[placement] = (result["cells"], table, entropy)
        state = "complete" if result["complete"] else "PARTIAL: not yet " + ", ".join(result["unfinished"])
        missing = [r for r in design if r not in {label(row) for row in table}]
        merged["placements"][placement]["rows_of_the_design_not_run"] = missing
        lines += [f"## {placement} ({state})",
                  "", "| row | seeds | Q→D MRR after conversion | Q→D MRR at the end | Q→D R@1 end | D→Q R@1 end | "
                  "expert similarity init → end | routing entropy / log E init → end | specialization (NMI, seed 0) "
                  "init → end [shuffled max] | median tokens/s |", "|---|---|---|---|---|---|---|---|---|---:|"]
        for row in table:
            m = row["metrics"]
            s = spec.get(row["cells"][0]) or {}
            first, last = (list(s.values())[0], list(s.values())[-1]) if s else (None, None)
            nmi = (f"{first['nmi']:.3f} → {last['nmi']:.3f} [{last['shuffled_max']:.3f}]" if s else "–")
            rates = [timing[c]["median_tokens_per_s"] for c in row["cells"] if timing.get(c)]
            lines.append(f"| {label(row)} | {','.join(map(str, row['seeds']))} | {fmt(m['qd_mrr']['after_conversion'])}"
                         f" | **{fmt(m['qd_mrr']['after_training'])}** | {fmt(m['qd_r1']['after_training'])} | "
                         f"{fmt(m['dq_r1']['after_training'])} | {fmt(row['init']['expert_similarity'])} → "
                         f"{fmt(row['end']['expert_similarity'])} | {fmt(row['init']['entropy_ratio'])} → "
                         f"{fmt(row['end']['entropy_ratio'])} | {nmi} | "
                         f"{statistics.median(rates) if rates else float('nan'):,.0f} |")
        if missing:
            lines += ["", f"Rows of the design not run in {placement}: {', '.join(missing)}."]
        lines += ["", "Differences of Q→D MRR beyond the seed spread (|mean diff| > 2 × the larger std):", ""]
        for stage, found in statement.items():
            lines.append(f"- {stage.replace('_', ' ')}: " + ("; ".join(found) if found else
                                                               "none (or fewer than 2 seeds per row)"))
        steps = sorted({p["step"] for points in by_step.values() for p in points})
        lines += ["", "Q→D MRR minus dense's at every evaluation step (mean over seeds; * = beyond the seed spread, "
                  "|diff| > 2 × the larger std):", "", "| row | " + " | ".join(f"step {s}" for s in steps) + " |",
                  "|---|" + "---:|" * len(steps)]
        for name, points in by_step.items():
            at = {p["step"]: p for p in points}
            lines.append(f"| {name} | " + " | ".join(
                f"{at[s]['diff']:+.4f}{'*' if at[s]['beyond_spread'] else ''}" if s in at else "–" for s in steps)
                + " |")
        lines += ["", f"Invocations into WORK/{placement} (wall seconds):", ""]
        lines += [f"- `{i['command']}`: {i['seconds']:,.0f} s" for i in result["invocations"]]
        lines.append("")
    merged["seconds_all_invocations"] = round(sum(p["wall_seconds_all_invocations"]
                                                  for p in merged["placements"].values()), 1)
    (results / "comparison.json").write_text(json.dumps(merged, indent=1) + "\n")
    (results / "comparison.md").write_text("\n".join(lines) + "\n")
    if curves:
        draw_curves(curves, results / "curves.png")
    print(f"wrote {results}")


def draw_curves(curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(curves), figsize=(6.5 * len(curves), 8), squeeze=False)
    # one colour per row label in every panel, so that a method is the same colour in both placements
    labels = sorted({label(row) for _, table, _ in curves.values() for row in table} - {"dense"})
    colors = {name: plt.get_cmap("tab10")(i % 10) for i, name in enumerate(labels)} | {"dense": "black"}
    for col, (placement, (cells, table, entropy)) in enumerate(curves.items()):
        for row in table:
            color = colors[label(row)]
            members = [c for c in cells if c["name"] in row["cells"]]
            steps = sorted({e["step"] for c in members for e in c["evals"]})
            ys = []
            for step in steps:
                values = [e[MAIN[1][0]][MAIN[1][1]] for c in members for e in c["evals"] if e["step"] == step]
                ys.append((statistics.fmean(values), min(values), max(values)))
            ax = axes[0, col]
            ax.plot(steps, [y[0] for y in ys], marker="o", ms=3, color=color,
                    ls="--" if row["method"] == "dense" else "-", label=f"{label(row)} (n={len(members)})")
            ax.fill_between(steps, [y[1] for y in ys], [y[2] for y in ys], color=color, alpha=0.15, lw=0)
            if row["method"] != "dense":
                series = [entropy.get(c["name"], {}) for c in members]
                xs = sorted(set.intersection(*(set(s) for s in series))) if series else []
                axes[1, col].plot(xs, [statistics.fmean(s[x] for s in series) for x in xs], color=color, lw=1,
                                  label=label(row))
        axes[0, col].set(title=f"{placement}: held-out Q→D MRR (mean over seeds; band: range)", xlabel="step",
                         ylabel="Q→D MRR")
        axes[0, col].legend(fontsize=7)
        axes[1, col].set(title=f"{placement}: routing entropy / log E (training batches, layer mean)",
                         xlabel="step", ylim=(0, 1.05))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def budget_flags(args: argparse.Namespace) -> list[str]:
    """The flags that give this invocation's budget and design, for the per-seed processes of --gpu."""
    flags = ["--work", str(args.work), "--steps", str(args.steps), "--batch-size", str(args.batch_size),
             "--sequence-length", str(args.sequence_length), "--eval-pairs", str(args.eval_pairs),
             "--eval-every", str(args.eval_every), "--lr", repr(args.lr), "--placements", ",".join(args.placements),
             "--seeds", ",".join(map(str, args.seeds)), "--methods", args.methods]
    return flags + (["--gpu"] if args.gpu else []) + (["--eesd", args.eesd] if args.eesd else [])


def seed_parts(work: Path, args: argparse.Namespace, seed: int) -> None:
    """Every part of one seed in turn: its methods in each placement, then its EESD cells. The first seed's
    process runs the EESD probe (on its every-2 cluster conversion); the others wait for the probe's λ."""
    commands = parts(work, args)
    for placement in args.placements:
        assert main(commands[f"{placement}-seed-{seed}"]) == 0, f"{placement}-seed-{seed}"
    if args.eesd == "none":
        return
    failed = work / "eesd_probe_failed"
    if lambdas(work, args.eesd) is None:
        if seed == args.seeds[0]:
            failed.unlink(missing_ok=True)
            try:
                eesd_probe(work, args)
            except BaseException:
                failed.touch()                          # the other seeds stop waiting
                raise
        while lambdas(work, args.eesd) is None:         # the first seed's probe; Ctrl-C (the runner's) stops this
            if failed.exists():
                sys.exit("the EESD probe failed (see the first seed's log): no EESD cells")
            time.sleep(2)
    commands = parts(work, args)
    for placement in args.placements:
        assert main(commands[f"{placement}-eesd-seed-{seed}"]) == 0, f"{placement}-eesd-seed-{seed}"


def run_seeds_in_parallel(work: Path, args: argparse.Namespace) -> None:
    """The GPU design: one process per seed, all on the one GPU (the model is small: one process leaves most of
    the GPU idle between its kernels), each `--part seed-S`. Past --deadline seconds they get Ctrl-C: a cell
    stops with a checkpoint and compare records it as unfinished; a rerun with the same WORK continues."""
    import signal
    import subprocess

    (work / "machine.json").write_text(json.dumps(machine("cuda" if _cuda() else None), indent=1) + "\n")
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    started = time.time()
    procs = {}
    threads = str(max(1, (os.cpu_count() or 1) // len(args.seeds)))     # the cores shared, not each process's all
    for seed in args.seeds:
        with open(logs / f"seed-{seed}.log", "a") as log:
            procs[seed] = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *budget_flags(args),
                                            "--part", f"seed-{seed}"], stdout=log, stderr=subprocess.STDOUT,
                                           env=os.environ | {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": threads},
                                           cwd=work)
    deadline = started + args.deadline if args.deadline else None
    stopped = None
    try:
        while any(p.poll() is None for p in procs.values()):
            if deadline and time.time() > deadline:
                stopped = f"deadline of {args.deadline:g} s"
                break
            time.sleep(1)
    except KeyboardInterrupt:
        stopped = "Ctrl-C"
    if stopped:
        print(f"{stopped}: stopping the seeds' processes (a rerun with this WORK continues)", flush=True)
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in procs.values():
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
    record = {"seconds": round(time.time() - started, 1), "exit_codes": {s: p.poll() for s, p in procs.items()},
              "deadline": args.deadline, "stopped": stopped}
    with open(work / "runner.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    print(json.dumps(record))


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def cli() -> None:
    # Ctrl-C stops a part cleanly (a cell checkpoints, compare records it unfinished), also in a process started
    # in the background of a script, which inherits SIGINT ignored (the GPU runner stops its seeds with it)
    import signal

    signal.signal(signal.SIGINT, signal.default_int_handler)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=output_folder, default=Path("/tmp/upcycle-contrastive-study"))
    parser.add_argument("--methods", default=METHODS, help=f"the MoE rows (default {METHODS}); a part of the "
                        "design, for a short call")
    parser.add_argument("--part", help="pilot, eesd-probe, analyze, seed-S (every part of seed S), or a compare "
                                       "part (listed with --list)")
    parser.add_argument("--list", action="store_true", help="print the compare parts and their commands")
    parser.add_argument("--collect", action="store_true")
    parser.add_argument("--gpu", action="store_true",
                        help="the GPU design: the GPU budget, every other block, seeds in parallel processes on the "
                             "one GPU, JSON and logs kept (results in benchmarks/results/contrastive_study_gpu)")
    parser.add_argument("--long", action="store_true",
                        help="with --gpu: the long rows (dense, copy, cluster; no EESD) at 10x the GPU budget's pairs "
                             "(results in benchmarks/results/contrastive_study_gpu_long)")
    parser.add_argument("--deadline", type=float, help="--gpu: stop the seeds' processes after this many seconds")
    parser.add_argument("--results", type=output_folder, help="where --collect writes (default: benchmarks/results/"
                                                      "contrastive_study, or contrastive_study_gpu with --gpu)")
    help_budget = " (default: the CPU or --gpu budget, BUDGETS)"
    parser.add_argument("--steps", type=int, help="training steps of every cell" + help_budget)
    parser.add_argument("--batch-size", type=int, help="pairs per step (B - 1 in-batch negatives)" + help_budget)
    parser.add_argument("--sequence-length", type=int, help="tokens per text" + help_budget)
    parser.add_argument("--eval-pairs", type=int, help="held-out pairs per evaluation" + help_budget)
    parser.add_argument("--eval-every", type=int, help=help_budget)
    parser.add_argument("--lr", type=float, help=help_budget)
    parser.add_argument("--placements", help="comma-separated: every-2, every-1 (default: both; --gpu: every-2)")
    parser.add_argument("--seeds", type=lambda s: tuple(int(x) for x in s.split(",")), default=SEEDS)
    parser.add_argument("--eesd", help="comma-separated EESD λ, or none for no EESD cells (default: "
                                             "WORK/eesd_lambdas.json of eesd-probe; --long: none)")
    parser.add_argument("--pilot-steps", type=int, default=12)
    parser.add_argument("--pilot-eval-pairs", type=int, default=256)
    args = parser.parse_args()
    if args.long:
        if not args.gpu:
            parser.error("--long is a GPU design: give --gpu with it")
        args.methods = args.methods if args.methods != METHODS else "copy,cluster"
        args.eesd = args.eesd or "none"
    budget = ("gpu-long" if args.long else "gpu") if args.gpu else "cpu"
    args.recipe = RECIPES[budget]
    for key, value in BUDGETS[budget].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    names = (args.placements or ("every-2" if args.gpu else ",".join(PLACEMENTS))).split(",")
    if not set(names) <= set(PLACEMENTS):
        sys.exit(f"--placements takes {', '.join(PLACEMENTS)}, got {args.placements!r}")
    args.placements = {name: PLACEMENTS[name] for name in names}
    args.results = args.results or (RESULTS_GPU_LONG if args.long else RESULTS_GPU if args.gpu else RESULTS)
    if not args.gpu:
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")     # a CPU protocol (float32), as the other studies
    work = args.work = args.work.absolute()
    if args.part == "pilot":
        pilot(work, args)
        sys.exit(0)
    commands = parts(work, args)
    if args.list:                                       # lists only: the WORK is left as it is
        print("\n".join(f"{n}: upcycle {' '.join(c)}" for n, c in commands.items()))
        sys.exit(0)
    seed_part = args.part.removeprefix("seed-") if args.part and args.part.startswith("seed-") else None
    if args.part == "eesd-probe":
        eesd_probe(work, args)
    elif args.part == "analyze":
        analyze_rows(work, args)
    elif seed_part is not None:
        if not seed_part.isdigit() or int(seed_part) not in args.seeds:
            sys.exit(f"--part seed-S takes one of --seeds {args.seeds}, got {args.part!r}")
        seed_parts(work, args, int(seed_part))
    elif args.part:
        if args.part not in commands:
            sys.exit(f"unknown part {args.part!r} (the EESD parts need --part eesd-probe first); parts: "
                     f"{', '.join(['pilot', 'eesd-probe', 'analyze', *(f'seed-{s}' for s in args.seeds), *commands])}")
        assert main(commands[args.part]) == 0, args.part
    if not args.part and not args.collect:
        if args.gpu:
            run_seeds_in_parallel(work, args)
        else:
            assert main(commands["every-2-seed-0"]) == 0       # its cluster conversion is what the probe trains
            if lambdas(work, args.eesd) is None:
                eesd_probe(work, args)
            for name, command in parts(work, args).items():
                assert main(command) == 0, name
            analyze_rows(work, args)
    if args.collect or not args.part:
        collect(work, args)


if __name__ == "__main__":
    cli()

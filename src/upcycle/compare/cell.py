"""One cell of `upcycle compare`: convert, train (or resume), read the evaluations, diagnose, record.

    plan.json -> conversions/METHOD-seed-S/ moe/ + conversion.json (skipped when written, as by the other EESD
    setting of the same method and seed) -> run/ (a new run, or `--resume` of the trainer
    from its newest complete checkpoint; skipped when run/model exists) -> cell.json (written last)

Every stage is the project's own: `conversion.pipeline.convert`, `train.trainer.train` (its checkpoints,
resume and log), the evaluations the trainer logs (before the first step = right after conversion, every
`eval_every` steps, after the last), and `diagnostics.diagnose` on the converted and the trained model. A cell
stopped anywhere continues from the last stage that finished, and a resumed run computes what an uninterrupted
one computes (the trainer's guarantee), so a resumed cell ends with the same numbers.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Protocol

from ..checkpoint.loading import load_model
from ..conversion.pipeline import convert
from ..conversion.preservation import count_parameters
from ..files import json_text, parse_json, read_json_file
from ..outputs.ownership import record, remove_owned
from ..outputs.staging import atomic_write_text
from ..runs.checkpoint_format import newest_complete
from ..runs.layout import LOG, checkpoints
from ..runs.log import read_log
from ..tasks.make import make_task
from .diagnostics import diagnose, held_out_batches
from .plan import RESULT, Cell, Plan
from .request import DENSE


class Trainer(Protocol):
    """What runs a cell's training: `upcycle.train` (the commands pass it in, so that a comparison reads runs
    through `upcycle.runs` and never imports the trainer's package itself)."""

    def __call__(self, cfg, out: Path, *, resume: bool, overwrite: bool, stop_after: int | None,
                 progress: bool) -> dict: ...


def write_json(path: Path, data: dict) -> None:
    """A JSON file written whole or not at all (a temporary sibling renamed)."""
    atomic_write_text(path, json_text(data, indent=1, where=path.name) + "\n")


def finished(plan: Plan, cell: Cell) -> dict | None:
    """The cell's recorded results, or None when it has not finished."""
    path = plan.folder(cell) / RESULT
    return read_json_file(path, "cell's results") if path.is_file() else None


def run_cell(plan: Plan, cell: Cell, *, train: Trainer, progress: bool = True, stop_after: int | None = None,
             say=lambda message: None) -> dict | None:
    """Run (or continue) `cell` with `train` (`upcycle.train`); its results, or None when the training run stopped
    before its last step."""
    folder = plan.folder(cell)
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / "plan.json").is_file():
        write_json(folder / "plan.json", cell.describe())
        _written(plan, folder / "plan.json")
    started = time.perf_counter()
    conversion = _convert(plan, cell, progress, say)
    run = folder / "run"
    if not (run / "model").is_dir():
        resume = bool(checkpoints(run)) and newest_complete(checkpoints(run), processes=1)[0] is not None
        say("resuming the training run from its checkpoint" if resume else "training")
        # a run folder without a complete checkpoint (a process killed before its first one) starts again
        summary = train(cell.train, run, resume=resume, overwrite=run.exists() and not resume,
                        stop_after=stop_after, progress=progress)
        if summary["step"] < cell.train.steps:
            return None
    say("diagnostics at init and after training")
    result = {"name": cell.name, "method": cell.method, "eesd": cell.eesd, "seed": cell.seed,
              "conversion": conversion, **_training(run), **_diagnostics(plan, cell, run)}
    result["seconds_this_session"] = round(time.perf_counter() - started, 2)
    write_json(folder / RESULT, result)
    _written(plan, folder / RESULT)
    prune(plan, cell)
    return result


def _written(plan: Plan, path: Path) -> None:
    """Record in the study's record a file this cell wrote."""
    record(plan.out, [path.relative_to(plan.out).as_posix()])


def _convert(plan: Plan, cell: Cell, progress: bool, say) -> dict | None:
    """The conversion's summary, converting first unless conversion.json records a finished one."""
    if cell.convert is None:
        return None
    folder = plan.conversion(cell)
    record_file = folder / "conversion.json"
    if record_file.is_file() and (folder / "moe").is_dir():   # (--keep results removes moe/ when its cells are done)
        return read_json_file(record_file, "conversion record")
    say(f"converting with {cell.method}")
    started = time.perf_counter()
    # overwrite: a moe/ without conversion.json is from a process stopped between the two writes
    report = convert(cell.convert, folder / "moe", overwrite=True, progress=progress).report.to_dict()
    summary = {"seconds": round(time.perf_counter() - started, 3), "parameters": report["parameters"],
               "max_abs_logit_diff": report["max_abs_logit_diff"], "kl_to_dense": report["kl_to_dense"],
               "preservation_passed": report["preservation"]["passed"], "calibration": report.get("calibration"),
               "timings_s": report["timings_s"], "num_moe_layers": report["num_moe_layers"]}
    write_json(record_file, summary)
    _written(plan, record_file)
    return summary


def _training(run: Path) -> dict:
    """From the run's log: the evaluations over the steps; throughput, in total and as the median over steps
    (which evaluations and checkpoints do not disturb); and the per-step curves: the task loss and the routing
    entropy (the mean over the MoE layers of what the run logged; None for a dense run)."""
    rows = [parse_json(line, f"{run / LOG}") for line in read_log(run / LOG, 1 << 62)]
    evals = [{"step": r["step"], **r["eval"]} for r in rows if "eval" in r and r["eval"] is not None]
    steps = [r for r in rows if "loss" in r]
    tokens = sum(r["tokens"] for r in steps)
    seconds = sum(r["seconds"] for r in steps)
    median = (lambda key: statistics.median(r[key] for r in steps) if steps else None)   # noqa: E731
    return {"evals": evals, "train": {"steps": len(steps), "tokens": tokens, "seconds": round(seconds, 3),
                                      "tokens_per_s": tokens / seconds if seconds else None,
                                      "median_step_seconds": median("seconds"),
                                      "median_tokens_per_s": median("tokens_per_s"),
                                      "final_task_loss": steps[-1]["loss"]["task"] if steps else None},
            "curves": {"step": [r["step"] for r in steps], "task_loss": [r["loss"]["task"] for r in steps],
                       "routing_entropy": [_mean_entropy(r) for r in steps]}}


def _mean_entropy(row: dict) -> float | None:
    """The mean over the MoE layers of the routing entropy a log line holds (None: no MoE layer logged one)."""
    values = [s["entropy"] for s in (row.get("layers") or {}).values() if s and s.get("entropy") is not None]
    return statistics.fmean(values) if values else None


def _diagnostics(plan: Plan, cell: Cell, run: Path) -> dict:
    """Parameters, and the analysis metrics of the model at init (as converted) and after training."""
    end, tokenizer = load_model(str(run / "model"))
    parameters = count_parameters(end)
    if cell.method == DENSE:
        return {"parameters": parameters, "diagnostics": {"init": None, "end": None}}
    batches = held_out_batches(make_task(cell.train, end, tokenizer))
    init, _ = load_model(cell.train.model)
    return {"parameters": parameters, "diagnostics": {"init": diagnose(init, batches), "end": diagnose(end, batches)}}


def prune(plan: Plan, cell: Cell) -> None:
    """What a finished cell keeps (--keep): all; models (the trained model, not the run's checkpoints with their
    optimizer state); results (the JSON files and the run's log only). A converted model is removed (results)
    once every cell of the plan that starts from it has finished."""
    if plan.keep == "all":
        return
    run = plan.folder(cell) / "run"
    # only what the run's and the conversion's records prove upcycle's goes (`ownership.remove_owned`)
    remove_owned(run, [rel for rel, _ in _below(run, "checkpoints")])
    if plan.keep == "results":
        remove_owned(run / "model")
        if cell.convert is not None and all(finished(plan, c) is not None for c in plan.cells
                                            if c.convert is not None and plan.conversion(c) == plan.conversion(cell)):
            remove_owned(plan.conversion(cell) / "moe")


def _below(folder: Path, top: str) -> list[tuple[str, Path]]:
    """(relative path, path) of `top` under `folder` and of everything below it."""
    base = folder / top
    if not base.exists():
        return []
    return [(top, base), *((p.relative_to(folder).as_posix(), p) for p in sorted(base.rglob("*")))]

"""`upcycle compare MODEL OUT --methods copy,drop,cluster --config TRAIN_RECIPE`: every method on the same model,
placement, E, k, recipe and token budget, against the dense model continued the same way.

    plan (every check; nothing written before it passes) -> OUT/study.json, OUT/invocations/ -> the cells not yet
    finished, one after the other (`cell.run_cell`: convert, train or resume, evaluate, diagnose) -> after each
    cell and at the end: comparison.json, comparison.md, metric_over_steps.png, init_diagnostics.png from every
    finished cell in OUT

Rerunning the same command skips finished cells and resumes an interrupted one from its checkpoint; a wider
grid (another method, EESD setting or seed) into the same OUT adds its cells to the same table. Invocations may
run at the same time into one OUT when their cells are disjoint (one seed each, say); two on the same cell would
both run it. Ctrl-C stops the running cell's training after its current step with a checkpoint (the trainer's
own stop), and the command exits with 130.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from ..data.clip_pairs import encode_captions, load_pairs, pixel_values
from ..data.token_ids import embedding_rows
from ..errors import UpcycleError
from ..files import read_json_file
from ..machine import machine
from ..outputs.job import run_job
from ..outputs.ownership import folder_lock, read_record, record, replaceable, write_marker
from ..outputs.staging import atomic_write, atomic_write_text, process_state, staged_directory
from ..version import __version__
from .cell import Trainer, finished, run_cell, write_json
from .plan import FORMAT, STUDY, Plan, make_plan
from .request import DENSE, CompareRequest
from .study_figures import write_figures
from .table import markdown, rows
from .text_calibration import write_text_calibration

VERSION = 1


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else \
        f"{seconds // 60}m{seconds % 60:02d}s"


def compare(request: CompareRequest, out: str | Path, *, train: Trainer, progress: bool = True,
            stop_after: int | None = None, command: str | None = None) -> dict:
    """Run every cell of the request that has not finished, training each with `train` (`upcycle.train`); returns
    {'cells', 'skipped', 'ran', 'interrupted', 'out'}. `progress`: the conversion's and the trainer's progress bars.
    `stop_after`: each cell's training stops at that step with a checkpoint (as an interruption would; run again to
    resume)."""
    plan = make_plan(request, out)
    return run_job(plan, plan.out, lambda claim: _compare(plan, train=train, progress=progress,
                                                          stop_after=stop_after, command=command))


def _compare(plan: Plan, *, train: Trainer, progress: bool, stop_after: int | None, command: str | None) -> dict:
    started = time.time()
    plan.out.mkdir(parents=True, exist_ok=True)
    if read_record(plan.out) is None:          # its record: what the study writes, as it writes it
        write_marker(plan.out, "compare", files=())
    theirs = [name for name in (STUDY, *SUMMARIES) if not replaceable(plan.out, name)]
    if theirs:
        raise UpcycleError(f"{plan.out} holds {', '.join(theirs)}, which upcycle did not write or which changed "
                           f"since, and the comparison writes files of those names; move them away")
    todo = [c for c in plan.cells if finished(plan, c) is None]
    invocation = _record_start(plan, command, started, todo)

    def say(message: str) -> None:     # the cell lines are printed with or without progress bars
        print(f"[upcycle compare] {message}", file=sys.stderr, flush=True)

    if plan.calibration_pairs is not None:
        _write_pairs(plan, say)
    if plan.calibration_texts is not None:
        if write_text_calibration(plan.calibration_texts, plan.model, say):
            written(plan, plan.calibration_texts.path)
    say(f"{len(plan.cells)} cells ({len(plan.methods)} method(s) + dense, seeds "
        f"{sorted({c.seed for c in plan.cells})}): {len(plan.cells) - len(todo)} finished before (skipped), "
        f"{len(todo)} to run")
    durations: list[float] = []
    interrupted = None
    for index, cell in enumerate(todo, 1):
        cell_started = time.perf_counter()
        left = len(todo) - index + 1
        estimate = (f"about {_duration(sum(durations) / len(durations) * left)} left" if durations else
                    "time left known after the first cell")

        def say_cell(message: str, index=index, cell=cell, estimate=estimate) -> None:
            say(f"cell {index}/{len(todo)} {cell.name}: {message} ({_duration(time.time() - started)} elapsed, "
                f"{estimate})")

        result = run_cell(plan, cell, train=train, progress=progress, stop_after=stop_after, say=say_cell)
        if result is None:
            interrupted = cell.name
            say(f"cell {cell.name} stopped before its last step; run the same command again to resume it")
            break
        durations.append(time.perf_counter() - cell_started)
        write_outputs(plan, invocation, started)
    outputs = write_outputs(plan, invocation, started, interrupted=interrupted, final=True)
    say(f"wrote {plan.out}: {', '.join(['comparison.json', 'comparison.md', *outputs])} "
        f"({_duration(time.time() - started)})")
    return {"cells": len(plan.cells), "skipped": len(plan.cells) - len(todo), "ran": len(durations),
            "interrupted": interrupted, "out": str(plan.out)}


def _record_start(plan: Plan, command: str | None, started: float, todo: list) -> Path:
    """study.json (the folder's model and task, written once) and this invocation's own record under
    invocations/ (its command, times, process and the cells and conversions it will write): one file per
    invocation, so invocations running at once into the same OUT, on disjoint cells (one per seed, say), do not
    overwrite each other's record. Under a lock on OUT itself, an invocation whose cells or conversions a running
    one holds is refused here, before it writes anything, not when it reaches the first of them."""
    import socket

    holds = {"cells": sorted(c.name for c in todo),
             "conversions": sorted({plan.conversion(c).name for c in todo if c.method != DENSE})}
    invocation = plan.out / "invocations" / f"{int(started * 1000)}-{os.getpid()}.json"
    with folder_lock(plan.out):
        for other, shared in _running_overlaps(plan, holds):
            raise UpcycleError(f"{plan.out}: another `upcycle compare` ({other}) is running {', '.join(shared[:4])}"
                               f"{', ...' if len(shared) > 4 else ''} of this one; wait for it, or give cells it "
                               f"does not run (other --seeds or --methods)")
        if not (plan.out / STUDY).is_file():
            write_json(plan.out / STUDY, {"format": FORMAT, "version": VERSION, "model": plan.model,
                                          "task": plan.task})
        invocation.parent.mkdir(exist_ok=True)
        write_json(invocation, {"command": command, "started": started, "upcycle": __version__, "seconds": 0.0,
                                "process": {"pid": os.getpid(), "host": socket.gethostname()}, **holds,
                                "ended": None})
    written(plan, plan.out / STUDY, invocation)
    return invocation


def _running_overlaps(plan: Plan, holds: dict) -> list[tuple[str, list[str]]]:
    """(who, what of `holds` it holds) for each invocation recorded in OUT that is running now (not ended, and its
    process alive on this host or on another host, which cannot be asked) and holds a cell or a conversion of
    `holds`."""
    import socket

    found = []
    for path in sorted((plan.out / "invocations").glob("*.json")):
        try:
            record = read_json_file(path, "invocation record")
        except UpcycleError:
            continue
        process = record.get("process") if isinstance(record, dict) else None
        if not isinstance(process, dict) or record.get("ended") is not None:
            continue                # an invocation of an earlier version, or one that ended
        pid, host = process.get("pid"), process.get("host")
        if not isinstance(pid, int) or (host == socket.gethostname() and process_state(pid) in ("gone", "mine")):
            continue
        shared = [f"cell {n}" for n in holds["cells"] if n in (record.get("cells") or [])] + \
                 [f"conversion {n}" for n in holds["conversions"] if n in (record.get("conversions") or [])]
        if shared:
            found.append((f"process {pid} on {host}", shared))
    return found


# The files a comparison writes under fixed names in OUT (each replaced as the study goes on).
SUMMARIES = ("comparison.json", "comparison.md", "metric_over_steps.png", "init_diagnostics.png")


def written(plan: Plan, *paths: Path) -> None:
    """Record in OUT's record the files the study just wrote (`ownership.record`)."""
    record(plan.out, [p.relative_to(plan.out).as_posix() for p in paths])


def _write_pairs(plan: Plan, say) -> None:
    """CLIP: the recipe's training image-caption pairs as model inputs, the calibration of data-aware methods."""
    from ..checkpoint.loading import dense_config, load_tokenizer

    path, source = plan.calibration_pairs
    if path.is_file():
        return
    from safetensors.torch import save_file

    model_path, config = dense_config(plan.model)
    tokenizer = load_tokenizer(model_path)
    if tokenizer is None:
        raise UpcycleError(f"{plan.model} has no caption tokenizer to encode the calibration captions with")
    pairs = load_pairs(source, split="train", image_size=config.vision_config.image_size)
    tensors = {**encode_captions(tokenizer, pairs.captions, config.text_config.max_position_embeddings,
                                 embedding_rows(config), f"calibration image-caption pairs {source}"),
               "pixel_values": pixel_values(pairs.images, config.vision_config.image_size)}
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp)))
    written(plan, path)
    say(f"calibration for data-aware methods: the {len(pairs)} training image-caption pairs ({path})")


def finished_cells(out: Path) -> list[dict]:
    """Every finished cell in OUT (of this invocation's grid or an earlier one)."""
    return [read_json_file(p, "cell's results") for p in sorted((out / "cells").glob("*/cell.json"))]


def write_outputs(plan: Plan, invocation: Path, started: float, *, interrupted: str | None = None,
                  final: bool = False) -> list[str]:
    """comparison.json, comparison.md and the figures from every finished cell; the figures' names. Until every
    cell of the plan has finished they say so: `complete` false and the `unfinished` cells in the JSON, a line
    at the top of the table."""
    cells = finished_cells(plan.out)
    table = rows(cells, plan.task, plan.methods)
    done = {cell.get("name") for cell in cells}
    unfinished = [cell.name for cell in plan.cells if cell.name not in done]
    mine = read_json_file(invocation, "invocation record")
    write_json(invocation, {**mine, "seconds": round(time.time() - started, 1),
                            "ended": time.time() if final else None})
    invocations = sorted((read_json_file(p, "invocation record") for p in (plan.out / "invocations").glob("*.json")),
                         key=lambda i: i["started"])
    # summed: invocations that ran at the same time each count their own wall time
    result = {"format": FORMAT, "version": VERSION, "model": plan.model, "task": plan.task, "machine": machine(),
              "seconds_all_invocations": round(sum(i["seconds"] for i in invocations), 1),
              "invocations": invocations, "complete": not unfinished, "unfinished": unfinished,
              "interrupted": interrupted, "table": table, "cells": cells}
    write_json(plan.out / "comparison.json", result)
    partial = (f"**Partial**: {len(plan.cells) - len(unfinished)} of {len(plan.cells)} cells finished; not yet: "
               f"{', '.join(unfinished)}. Run the same command again to finish them.\n\n" if unfinished else "")
    text = f"# upcycle compare: {plan.model}\n\n{partial}" + (markdown(table, plan.task) if table else
                                                             "No finished cell yet.\n")
    atomic_write_text(plan.out / "comparison.md", text)
    written(plan, invocation, plan.out / "comparison.json", plan.out / "comparison.md")
    if not table:
        return []
    with staged_directory(plan.out, into=True) as figures:      # drawn aside, then moved in
        names = write_figures(cells, table, plan.task, figures)
    written(plan, *(plan.out / name for name in names))
    return names

"""A training run's curves, read from its log.jsonl: what `upcycle analyze RUN` stores as analysis.json's
"training" section and draws as training.png (`upcycle.figures.plots.training_figure`, docs/training.md,
"Watching a run").

    steps                    the steps that updated the weights (x axis of every per-step series)
    lr, tokens_per_s, grad_norm, loss[term], routing[layer][entropy|load_cov|dropped]
                             one value per step, null where a step did not log it (a router loss after
                             router_until, a layer without a record)
    skipped                  steps that did not update the weights (on_nonfinite: skip)
    eval                     {"steps": [...], "metrics": {name: [...]}}: every evaluation (before training, every
                             eval_every steps, after), its numeric results flattened ("zero_shot/accuracy")

The values are the log's own numbers, unchanged, so a point of the figure is a number of the file.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from ..files import parse_json
from ..runs.layout import LOG
from ..runs.log import flatten_numbers, read_log

STEP_SERIES = ("lr", "tokens_per_s", "grad_norm")
ROUTING_STATS = ("entropy", "load_cov", "dropped")


def _number(value) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return value if ok else None


def _series(rows: list[dict], read) -> list:
    return [_number(read(row)) for row in rows]


def run_curves(run: Path) -> dict | None:
    """The curves of the run in folder `run` (module docstring), or None when it has no log."""
    path = Path(run) / LOG
    if not path.is_file():
        return None
    records = []
    for line in read_log(path, upto=sys.maxsize):
        record = parse_json(line, str(path))
        if isinstance(record, dict):
            records.append(record)
    steps = [r for r in records if isinstance(r.get("loss"), dict)]
    evals = [r for r in records if isinstance(r.get("eval"), dict)]
    terms = list(dict.fromkeys(term for r in steps for term in r["loss"]))
    layers = list(dict.fromkeys(name for r in steps for name, stats in (r.get("layers") or {}).items() if stats))
    flat_evals = []
    for r in evals:
        found: dict = {}
        flatten_numbers(r["eval"], "", found)
        flat_evals.append(found)
    metrics = list(dict.fromkeys(name for found in flat_evals for name in found))
    return {
        "log": str(path),
        "steps": [r["step"] for r in steps],
        **{key: _series(steps, lambda r, key=key: r.get(key)) for key in STEP_SERIES},
        "loss": {term: _series(steps, lambda r, term=term: r["loss"].get(term)) for term in terms},
        "routing": {name: {stat: _series(steps, lambda r, name=name, stat=stat:
                                         ((r.get("layers") or {}).get(name) or {}).get(stat))
                           for stat in ROUTING_STATS} for name in layers},
        "skipped": [r["step"] for r in records if isinstance(r.get("skipped"), str)],
        "eval": {"steps": [r["step"] for r in evals],
                 "metrics": {name: [found.get(name) for found in flat_evals] for name in metrics}},
    }

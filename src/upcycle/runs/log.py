"""A run's log, `OUT/log.jsonl`, as others read it: one JSON object per line, each with its step; a line a crash
cut off is dropped with a note (`read_log`), and a record's numbers flatten into named curves (`flatten_numbers`)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

from ..files import parse_json


def read_log(path: Path, upto: int) -> list[str]:
    """The log lines of steps <= `upto`; a torn line (a write cut off by a crash) is dropped, with a note."""
    kept = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            step = parse_json(line, f"{path}:{number}")["step"]
        except (ValueError, KeyError, TypeError):
            print(f"[upcycle] {path}: dropped unreadable line {number} (a torn write)", file=sys.stderr)
            continue
        if step <= upto:
            kept.append(line)
    return kept


def flatten_numbers(value, prefix: str, out: dict[str, float]) -> None:
    """The finite numbers of a nested dict into `out`, keyed by their '/'-joined path (what a curve is)."""
    if isinstance(value, dict):
        for key, item in value.items():
            flatten_numbers(item, f"{prefix}/{key}" if prefix else str(key), out)
    elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        out[prefix] = value          # lists (frozen_rules, templates), strings and non-finite values are not curves

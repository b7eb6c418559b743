"""A run's log: one JSON line per step and per evaluation in OUT/log.jsonl (main process), the same record to the
trackers of `report_to`. A resumed run first drops the lines written after its checkpoint, and torn lines."""

from __future__ import annotations

from pathlib import Path

from ...files import json_text
from ...runs.log import read_log
from .trackers import Trackers


class RunLog:
    def __init__(self, path: Path, trackers: Trackers, *, is_main: bool, resumed_at: int | None) -> None:
        self.trackers = trackers
        if is_main and resumed_at is not None and path.exists():
            path.write_text("".join(line + "\n" for line in read_log(path, resumed_at)))
        self.file = path.open("a") if is_main else None

    def write(self, record: dict) -> None:
        if self.file is not None:
            self.file.write(json_text(record) + "\n")
            self.file.flush()
        self.trackers.log(record)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()

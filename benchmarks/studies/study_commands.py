"""A study's steps as `upcycle` commands run in the study's own process, each recorded for its results (the
commands a study ran are part of what it reports), shared by the studies that run them."""

from __future__ import annotations

import sys
import time

from upcycle.cli import main


def run_upcycle(commands: list[str], *argv: str) -> None:
    """One `upcycle` command run in this process, appended to `commands` (the study's record of what it ran); a
    non-zero exit ends the script with the command named; its time printed when it returns."""
    commands.append("upcycle " + " ".join(argv))
    started = time.perf_counter()
    status = main(list(argv))
    if status != 0:
        sys.exit(f"upcycle {' '.join(argv)} exited {status}")
    print(f"[{time.perf_counter() - started:6.1f} s] upcycle {' '.join(argv[:3])} ...", flush=True)

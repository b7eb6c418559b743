"""A benchmark's scratch folder, under the command line's rules for outputs: a benchmark makes it (or takes one it
made before, which holds `MARKER`), never takes a folder that holds anything else, and removes only a folder it
made, never through a link. Every benchmark that deletes what it wrote takes its `--work` or `--out` folder from
`claim_work`, so that a mistyped path costs a message, not the user's files."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

MARKER = ".upcycle-benchmark-work"


def claim_work(path: Path) -> Path:
    """`path` made (with parents) and marked as a benchmark's; an existing one only when it is empty or a
    benchmark's. Anything else ends the script with one line, before any work."""
    path = Path(path)
    if path.is_symlink():
        sys.exit(f"{path} is a symbolic link; give the real location (a benchmark never writes through a link)")
    if path.exists():
        if not path.is_dir():
            sys.exit(f"{path} exists and is not a folder; give a folder for the benchmark's scratch files")
        if not (path / MARKER).is_file() and any(path.iterdir()):
            sys.exit(f"{path} holds files a benchmark did not make (no {MARKER}), and the benchmark deletes what "
                     f"is in its folder; give a new or empty folder")
    path.mkdir(parents=True, exist_ok=True)
    (path / MARKER).touch()
    return path


def clear(path: Path, work: Path) -> None:
    """Remove `path`, the claimed `work` folder itself or something inside it (never a link's target)."""
    path, work = Path(path), Path(work)
    if not (work / MARKER).is_file() or work.is_symlink():
        raise RuntimeError(f"{work} is not a claimed benchmark folder")          # a bug in the script: say so
    if path != work and work.resolve() not in path.resolve().parents and not path.is_symlink():
        raise RuntimeError(f"{path} is outside the benchmark's folder {work}")
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)

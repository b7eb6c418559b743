"""A benchmark's scratch folder, under the command line's rules for outputs (`upcycle.outputs.ownership`): a
benchmark makes it, or takes an empty one or one it made before (its record, kind "benchmark-work", proves it),
never one that holds anything it did not write, and removes only what its record lists: what it wrote, as it wrote
it (`note`; upcycle's own outputs inside carry their records), and the folder itself only when it made it.
Every benchmark that deletes what it wrote takes its `--work` or `--out` folder from `claim_work`, so that a
mistyped path costs a message, not the user's files."""

from __future__ import annotations

import sys
from pathlib import Path

from upcycle.outputs.ownership import MARKER, files_below, kind_of, read_record, record, remove_owned, why_not_own
from upcycle.outputs.ownership import write_marker as _write_record

KIND = "benchmark-work"
__all__ = ["MARKER", "claim_work", "clear", "note"]


def claim_work(path: Path) -> Path:
    """`path` made (with parents) and recorded as a benchmark's; an existing one only when it is empty or a
    benchmark's holding nothing else. Anything else ends the script with one line, before any work."""
    path = Path(path)
    if path.is_symlink():
        sys.exit(f"{path} is a symbolic link; give the real location (a benchmark never writes through a link)")
    if path.exists() and not path.is_dir():
        sys.exit(f"{path} exists and is not a folder; give a folder for the benchmark's scratch files")
    if path.is_dir() and any(path.iterdir()):
        if read_record(path) is None or kind_of(path) != KIND:
            sys.exit(f"{path} holds files a benchmark did not make (no record of a benchmark's there), and the "
                     f"benchmark deletes what is in its folder; give a new or empty folder")
        from upcycle.outputs.ownership import foreign_files

        if foreign_files(path):
            sys.exit(f"{path} holds files a benchmark did not make: {why_not_own(path)}; give a new or empty "
                     f"folder, or move them away")
        return path
    made = not path.exists()
    path.mkdir(parents=True, exist_ok=True)
    _write_record(path, KIND, files=(), made=made)
    return path


def note(*paths: Path) -> None:
    """Record what the benchmark just wrote: each path and, for a folder, everything in it (what a tool other than
    upcycle wrote, say), in the record of the nearest folder above it that has one (the claimed work folder, or an
    upcycle output inside it that the benchmark adds a file to), so that `clear` may remove it."""
    for path in map(Path, paths):
        owner = next((p for p in path.parents if read_record(p) is not None), None)
        if owner is None:
            raise RuntimeError(f"{path} is in no folder upcycle or a benchmark recorded")    # a bug in the script
        rel = path.relative_to(owner).as_posix()
        record(owner, files_below(owner, rel) if path.is_dir() and not path.is_symlink() else [rel])


def clear(path: Path, work: Path) -> None:
    """Remove what of `path` (the claimed `work` folder itself, or something inside it) the benchmark recorded
    writing; anything else there stays, and is named."""
    path, work = Path(path), Path(work)
    if work.is_symlink() or read_record(work) is None or kind_of(work) != KIND:
        raise RuntimeError(f"{work} is not a claimed benchmark folder")          # a bug in the script: say so
    if path != work and work.resolve() not in path.resolve().parents:
        raise RuntimeError(f"{path} is outside the benchmark's folder {work}")
    if not path.exists() and not path.is_symlink():
        return
    if path == work:
        left = remove_owned(work)
    else:
        rel = path.relative_to(work).as_posix()
        inside = [rel, *(f"{rel}/{p.relative_to(path).as_posix()}" for p in path.rglob("*"))] if path.is_dir() \
            and not path.is_symlink() else [rel]
        left = remove_owned(work, inside)
    if left:
        print(f"[benchmark] {path}: kept what the benchmark did not write ({', '.join(left[:5])})", file=sys.stderr)

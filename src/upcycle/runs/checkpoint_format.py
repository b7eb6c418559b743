"""A run's checkpoint folder as others read it: a manifest written last holds the size and SHA-256 of every file,
so a checkpoint is complete exactly when its files match it (`problem`), and `newest_complete` falls back past a torn
write. What the files hold and how a run restores them is `upcycle.training.run.state`'s."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..files import read_json_file

FORMAT = "upcycle-train-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(folder: Path, *, step: int, processes: int) -> None:
    """Record every file's size and hash; the checkpoint counts as complete from this write on."""
    files = {p.name: {"bytes": p.stat().st_size, "sha256": sha256(p)}
             for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}
    (folder / MANIFEST).write_text(json.dumps({"format": FORMAT, "version": VERSION, "step": step,
                                               "processes": processes, "files": files}, indent=1))


def problem(folder: Path, *, processes: int) -> str | None:
    """Why `folder` is not a complete checkpoint this run can resume, or None when it is."""
    manifest_file = folder / MANIFEST
    if not manifest_file.is_file():
        if any(folder.glob("*.pkl")):
            return "it is in Accelerate's pickle format (written by upcycle before 0.2), which is never unpickled"
        return "it has no manifest (it was not finished)"
    try:
        manifest = read_json_file(manifest_file, "checkpoint manifest")
        files = manifest["files"]
    except (ValueError, KeyError, TypeError):
        return "its manifest is not readable"
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        return f"its format is {manifest.get('format')} v{manifest.get('version')}, not {FORMAT} v{VERSION}"
    written = manifest.get("processes")
    if not isinstance(written, int) or written < processes:
        # the state is whole, but each process restores the RNG state of its rank, and only these ranks wrote one
        return f"it was written by {written} process(es); this run has {processes} process(es)"
    needed = {"model.safetensors", "optimizer.pt", "trainer.json", *(f"rng-{r}.json" for r in range(processes))}
    if missing := sorted(needed - set(files)):
        return f"it lacks {', '.join(missing)}"
    for name, facts in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != facts["bytes"]:
            return f"{name} has {path.stat().st_size} bytes, {facts['bytes']} were written"
        if sha256(path) != facts["sha256"]:
            return f"{name} does not have the hash recorded when it was written"
    return None


def step_of(folder: Path) -> int:
    """The step of a checkpoint folder `step-NNNNNNN`."""
    return int(folder.name.split("-", 1)[1])


def newest_complete(found: list[Path], *, processes: int) -> tuple[Path | None, list[str]]:
    """The newest checkpoint of `found` (oldest first) that verifies, and a message for each newer one skipped."""
    skipped = []
    for folder in reversed(found):
        why = problem(folder, processes=processes)
        if why is None:
            return folder, skipped
        skipped.append(f"skipped checkpoint {folder.name}: {why}")
    return None, skipped

"""Training checkpoints in formats that cannot execute code, verified before they are resumed.

A run folder may come from someone else (a shared cluster directory, a downloaded run), so everything in it is
data, never code. Accelerate's `save_state`/`load_state` unpickles `custom_checkpoint_*.pkl` and RNG files with
`weights_only=False`, which runs whatever a crafted file asks; this module writes and reads its own folder:

  model.safetensors      every weight and persistent buffer (aux-free selection biases too; tied tensors once)
  optimizer.pt           AdamW's state dict, read back with `torch.load(weights_only=True)` (tensors, numbers
                         and containers only; a pickle of anything else is refused without being run)
  teacher.safetensors    the EMA teacher of EESD, when the run has one
  trainer.json           step, tokens, the LR scheduler's counters
  rng-{rank}.json / .safetensors   each process's Python, NumPy and torch (CPU, CUDA) generator states
  manifest.json          written last: the size and SHA-256 of every file above

A checkpoint is complete when its manifest exists and every file has the recorded size and hash; `newest_complete`
skips (and names) the ones that are not, so a torn write falls back to the previous checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, load_model, save_file, save_model
from torch import nn

from ..errors import UpcycleError

FORMAT = "upcycle-train-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


def save_rng(folder: Path, rank: int) -> None:
    """This process's generator states (every process writes its own)."""
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    (folder / f"rng-{rank}.json").write_text(json.dumps({
        "python": [py_version, list(py_state), py_gauss],
        "numpy": [np_kind, np_keys.tolist(), int(np_pos), int(np_has_gauss), float(np_gauss)]}))
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda.{i}"] = state
    save_file(tensors, str(folder / f"rng-{rank}.safetensors"))


def load_rng(folder: Path, rank: int) -> None:
    states = json.loads((folder / f"rng-{rank}.json").read_text())
    version, state, gauss = states["python"]
    random.setstate((version, tuple(state), gauss))
    kind, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    tensors = load_file(str(folder / f"rng-{rank}.safetensors"))
    torch.set_rng_state(tensors["torch"])
    cuda = [tensors[f"cuda.{i}"] for i in range(torch.cuda.device_count()) if f"cuda.{i}" in tensors]
    if cuda:
        torch.cuda.set_rng_state_all(cuda)


def _flat_teacher(state: dict) -> dict[str, torch.Tensor]:
    return {f"{layer}::{key}": t.contiguous() for layer, sd in state["teachers"].items() for key, t in sd.items()}


def _nested_teacher(flat: dict[str, torch.Tensor]) -> dict:
    teachers: dict[str, dict] = {}
    for key, tensor in flat.items():
        layer, name = key.split("::", 1)
        teachers.setdefault(layer, {})[name] = tensor
    return {"teachers": teachers}


def save_main(folder: Path, *, model: nn.Module, optimizer, scheduler, step: int, tokens: int, teacher=None) -> None:
    """What one process writes for everyone (the model is identical on every process under DDP)."""
    save_model(model, str(folder / "model.safetensors"))
    torch.save(optimizer.state_dict(), folder / "optimizer.pt")
    if teacher is not None:
        save_file(_flat_teacher(teacher.state_dict()), str(folder / "teacher.safetensors"))
    scheduler_state = {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}
    (folder / "trainer.json").write_text(json.dumps({"format": FORMAT, "version": VERSION, "step": step,
                                                     "tokens": tokens, "scheduler": scheduler_state}))


def write_manifest(folder: Path, *, step: int, processes: int) -> None:
    """Record every file's size and hash; the checkpoint counts as complete from this write on."""
    files = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)}
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
        manifest = json.loads(manifest_file.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError):
        return "its manifest is not readable"
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        return f"its format is {manifest.get('format')} v{manifest.get('version')}, not {FORMAT} v{VERSION}"
    if manifest.get("processes") != processes:
        return f"it was written by {manifest.get('processes')} process(es); this run has {processes} process(es)"
    needed = {"model.safetensors", "optimizer.pt", "trainer.json", *(f"rng-{r}.json" for r in range(processes))}
    if missing := sorted(needed - set(files)):
        return f"it lacks {', '.join(missing)}"
    for name, facts in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != facts["bytes"]:
            return f"{name} has {path.stat().st_size} bytes, {facts['bytes']} were written"
        if _sha256(path) != facts["sha256"]:
            return f"{name} does not have the hash recorded when it was written"
    return None


def newest_complete(found: list[Path], *, processes: int) -> tuple[Path | None, list[str]]:
    """The newest checkpoint of `found` (oldest first) that verifies, and a message for each newer one skipped."""
    skipped = []
    for folder in reversed(found):
        why = problem(folder, processes=processes)
        if why is None:
            return folder, skipped
        skipped.append(f"skipped checkpoint {folder.name}: {why}")
    return None, skipped


def load(folder: Path, *, model: nn.Module, optimizer, scheduler, rank: int, device: torch.device,
         teacher=None) -> dict:
    """Restore a verified checkpoint into the (unwrapped) model, optimizer, scheduler and teacher; return the
    trainer state (step, tokens). Nothing here can run code from the folder."""
    state = json.loads((folder / "trainer.json").read_text())
    missing, unexpected = load_model(model, str(folder / "model.safetensors"), strict=False, device=str(device))
    if missing or unexpected:
        raise UpcycleError(f"checkpoint {folder} does not fit the model (missing {missing[:3]}, "
                           f"unexpected {unexpected[:3]})")
    try:
        optimizer_state = torch.load(folder / "optimizer.pt", map_location=device, weights_only=True)
    except Exception as e:        # weights_only refuses any pickle that is not plain tensors and containers
        raise UpcycleError(f"checkpoint {folder}: optimizer.pt is not plain tensor data, refused unread ({e})") \
            from None
    optimizer.load_state_dict(optimizer_state)
    scheduler.load_state_dict({**state["scheduler"], "lr_lambdas": [None] * len(scheduler.lr_lambdas)})
    if teacher is not None:
        if not (folder / "teacher.safetensors").is_file():
            raise UpcycleError(f"checkpoint {folder} has no EMA teacher, but this run distills from one")
        teacher.load_state_dict(_nested_teacher(load_file(str(folder / "teacher.safetensors"), device=str(device))))
    load_rng(folder, rank)
    return {"step": int(state["step"]), "tokens": int(state["tokens"])}

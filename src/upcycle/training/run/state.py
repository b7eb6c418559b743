"""A training run's resumable state (its checkpoints), in formats that cannot execute code, verified before resuming.

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

The state is whole whatever wrote it: one process, DDP (every process holds all of it), or FSDP (gathered by
`upcycle.training.parallel.sharding` and written by the main process in the same files). So a checkpoint resumes on the
same number of processes or fewer, sharded or not; every process needs the RNG state its rank wrote.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, load_model, save_file, save_model
from torch import nn

from ...errors import UpcycleError
from ...files import read_json_file
from ...runs.checkpoint_format import FORMAT, VERSION
from ..parallel import sharding


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
    states = read_json_file(folder / f"rng-{rank}.json", "checkpoint's random state")
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


class _TeacherLayers(Mapping):
    """The layers of an open teacher file, each read when asked for (one layer in memory at a time)."""

    def __init__(self, f) -> None:
        self.f, self.keys = f, {}
        for flat in f.keys():
            layer, name = flat.split("::", 1)
            self.keys.setdefault(layer, []).append(name)

    def __getitem__(self, layer: str) -> dict[str, torch.Tensor]:
        return {name: self.f.get_tensor(f"{layer}::{name}") for name in self.keys[layer]}

    def __iter__(self):
        return iter(self.keys)

    def __len__(self) -> int:
        return len(self.keys)


def save_main(folder: Path, *, model: nn.Module, optimizer_state: dict, scheduler, step: int, tokens: int,
              teacher_state: dict | None = None) -> None:
    """What one process writes for everyone: the model (whole: identical on every process under DDP, gathered
    under FSDP), `optimizer.state_dict()` and the teacher's state dict, whole as well."""
    save_model(model, str(folder / "model.safetensors"))
    with open(folder / "optimizer.pt", "wb") as f:     # through a Python file: a full disk stays an OSError, which
        torch.save(optimizer_state, f)                  # torch's own writer would turn into "unexpected pos"
    if teacher_state is not None:
        save_file(_flat_teacher(teacher_state), str(folder / "teacher.safetensors"))
    scheduler_state = {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}
    (folder / "trainer.json").write_text(json.dumps({"format": FORMAT, "version": VERSION, "step": step,
                                                     "tokens": tokens, "scheduler": scheduler_state}))


def load(folder: Path, *, model: nn.Module, optimizer, scheduler, rank: int, device: torch.device,
         teacher=None, sharded: bool = False) -> dict:
    """Restore a verified checkpoint into the (unwrapped) model, optimizer, scheduler and teacher; return the
    trainer state (step, tokens). `sharded`: the model is FSDP-sharded; each process keeps its part of every
    tensor (it reads the files itself, one tensor at a time for the model). Nothing here can run code from the
    folder."""
    state = read_json_file(folder / "trainer.json", "checkpoint's trainer state")
    weights = str(folder / "model.safetensors")
    if sharded:
        with safe_open(weights, "pt", device="cpu") as f:
            missing, unexpected = sharding.load_model_state(model, f.get_tensor, set(f.keys()))
    else:
        missing, unexpected = load_model(model, weights, strict=False, device=str(device))
    if missing or unexpected:
        raise UpcycleError(f"checkpoint {folder} does not fit the model (missing {missing[:3]}, "
                           f"unexpected {unexpected[:3]})")
    try:
        # sharded: memory-mapped, so each process reads only the parts it keeps
        optimizer_state = torch.load(folder / "optimizer.pt", map_location="cpu" if sharded else device,
                                     weights_only=True, mmap=sharded)
    except Exception as e:        # weights_only refuses any pickle that is not plain tensors and containers
        raise UpcycleError(f"checkpoint {folder}: optimizer.pt is not plain tensor data, refused unread ({e})") \
            from None
    if sharded:
        sharding.load_optimizer_state(optimizer, optimizer_state)
    else:
        optimizer.load_state_dict(optimizer_state)
    scheduler.load_state_dict({**state["scheduler"], "lr_lambdas": [None] * len(scheduler.lr_lambdas)})
    if teacher is not None:
        if not (folder / "teacher.safetensors").is_file():
            raise UpcycleError(f"checkpoint {folder} has no EMA teacher, but this run distills from one")
        path = str(folder / "teacher.safetensors")
        if sharded:
            with safe_open(path, "pt", device="cpu") as f:
                teacher.load_state_dict({"teachers": _TeacherLayers(f)})
        else:
            teacher.load_state_dict(_nested_teacher(load_file(path, device=str(device))))
    load_rng(folder, rank)
    return {"step": int(state["step"]), "tokens": int(state["tokens"])}

"""Safetensors checkpoints written one tensor at a time, in shards planned before any weight exists.

`ShardedWriter`: every output tensor's name, shape and dtype are known before any weight exists (from a
model built on the meta device), so the layout of every shard is planned up front: each file is created with its
final header and size, and a tensor is written at its offset the moment it is produced, in any order. Nothing is
buffered, so the writer's memory is the tensor being written. Shards fill in the plan's order up to
`max_shard_bytes`, as transformers' `save_pretrained` fills them, and the index maps each name to its file as
transformers reads it. The files are standard safetensors (format: https://github.com/huggingface/safetensors):
an 8-byte little-endian header length, a JSON header padded with spaces to 8 bytes, then the tensors' bytes back
to back in header order, larger element sizes first so that every tensor is aligned to its element size.

With `max_pending_bytes`, the writer writes on a background thread, so the disk works while the caller computes
the next block (a conversion otherwise waits on each in turn): `write` validates the tensor, queues it and
returns; it waits only while the queued bytes would exceed the limit, so the memory held by queued tensors stays
under it. A failed write is raised by the next `write` or by `close`.
"""

from __future__ import annotations

import json
import os
import struct
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import UpcycleError
from .reader import DTYPE_CODES, INDEX_FILE, SINGLE_FILE, element_size, is_finite, numel_of

DEFAULT_MAX_SHARD_BYTES = 50 * 10**9       # transformers 5's save_pretrained default, "50GB"


def parse_size(size: int | str, what: str = "shard size") -> int:
    """Bytes from an int or a transformers-style size string ("5GB", "500MB", "2GiB"); `what` names it in the
    error."""
    if isinstance(size, int) and not isinstance(size, bool):
        if size > 0:
            return size
        raise UpcycleError(f"{what} {size!r}: a size is a number of bytes above 0, or one such as 5GB, 500MB, 2GiB")
    text = str(size).strip().upper()
    units = {"TIB": 2**40, "GIB": 2**30, "MIB": 2**20, "KIB": 2**10, "TB": 10**12, "GB": 10**9, "MB": 10**6,
             "KB": 10**3, "B": 1, "": 1}
    for unit, factor in units.items():
        if text.endswith(unit):
            try:
                value = float(text[: len(text) - len(unit)])
            except ValueError:
                continue
            if value > 0 and value * factor < 2**63:
                return int(value * factor)
            break
    raise UpcycleError(f"{what} {size!r}: a size is a number of bytes above 0, or one such as 5GB, 500MB, 2GiB, 1TB")


@dataclass(frozen=True)
class TensorSlot:
    file: str
    start: int          # absolute offset of the tensor's first byte in its file
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def plan_shards(specs: list[tuple[str, tuple[int, ...], torch.dtype]], max_shard_bytes: int
                ) -> list[list[tuple[str, tuple[int, ...], torch.dtype]]]:
    """Split (name, shape, dtype) in order into shards of at most `max_shard_bytes` of tensor data (a tensor
    larger than that gets a shard of its own), as transformers' save_pretrained does."""
    shards, current, size = [], [], 0
    for spec in specs:
        nbytes = numel_of(spec[1]) * element_size(spec[2])
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(spec)
        size += nbytes
    if current or not shards:
        shards.append(current)
    return shards


def _header(tensors: list[tuple[str, tuple[int, ...], torch.dtype]], metadata: dict[str, str]
            ) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """The padded JSON header of one file and each tensor's (start, end) in its data section."""
    ordered = sorted(tensors, key=lambda t: (-element_size(t[2]), t[0]))     # aligned, then by name
    header, offsets, at = {"__metadata__": metadata}, {}, 0
    for name, shape, dtype in ordered:
        if dtype not in DTYPE_CODES:
            raise UpcycleError(f"tensor {name}: dtype {dtype} cannot be written to safetensors here")
        end = at + numel_of(shape) * element_size(dtype)
        header[name] = {"dtype": DTYPE_CODES[dtype], "shape": list(shape), "data_offsets": [at, end]}
        offsets[name] = (at, end)
        at = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return text, offsets


def _check_written_finite(name: str, tensor: torch.Tensor) -> None:
    """Every writer checks that what it writes is finite in the written dtype. The inputs were checked finite
    when read, so a non-finite value here is a cast that overflowed (float16 holds at most 65,504): refused with
    the tensor and the dtype named, before the output exists."""
    if is_finite(tensor):
        return
    kind = str(tensor.dtype).removeprefix("torch.")
    raise UpcycleError(f"tensor {name} holds values that are not finite in {kind}, the output's dtype (a weight "
                       f"past float16's 65,504 becomes inf when cast); nothing was written: choose --dtype "
                       f"bfloat16 or float32")


class ShardedWriter:
    """Writes a planned set of tensors into safetensors shards (plus the index when there are several).

    Create it with every output tensor's (name, shape, dtype), call `write(name, tensor)` once per name in any
    order, then `close()`, which checks that every planned tensor was written and writes the index. With
    `max_pending_bytes` the bytes go to disk on a background thread (module docstring): the caller must not
    change a tensor after handing it over."""

    def __init__(self, directory: str | os.PathLike, specs: list[tuple[str, tuple[int, ...], torch.dtype]], *,
                 max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, metadata: dict[str, str] | None = None,
                 max_pending_bytes: int | None = None):
        self.directory = Path(directory)
        names = [s[0] for s in specs]
        if len(set(names)) != len(names):
            raise UpcycleError("duplicate tensor names in the output plan")
        shards = plan_shards(specs, max_shard_bytes)
        self.files = ([SINGLE_FILE] if len(shards) == 1 else
                      [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
        self.slots: dict[str, TensorSlot] = {}
        self._fds: dict[str, int] = {}
        for file, tensors in zip(self.files, shards, strict=True):
            header, offsets = _header(tensors, {"format": "pt", **(metadata or {})})
            data_start = 8 + len(header)
            fd = os.open(self.directory / file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            self._fds[file] = fd
            _write_all(fd, struct.pack("<Q", len(header)) + header, 0)
            os.ftruncate(fd, data_start + (max(e for _, e in offsets.values()) if offsets else 0))
            for name, shape, dtype in tensors:
                start, end = offsets[name]
                self.slots[name] = TensorSlot(file, data_start + start, end - start, tuple(shape), dtype)
        self.written: set[str] = set()
        self.max_pending_bytes = max_pending_bytes
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="shard-writer") if max_pending_bytes else None
        self._pending: deque[tuple[Future, int]] = deque()
        self._pending_bytes = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        slot = self.slots.get(name)
        if slot is None:
            raise UpcycleError(f"tensor {name!r} is not in the output plan")
        if name in self.written:
            raise UpcycleError(f"tensor {name!r} written twice")
        if tuple(tensor.shape) != slot.shape or tensor.dtype != slot.dtype:
            raise UpcycleError(f"tensor {name!r}: planned {slot.dtype} {list(slot.shape)}, got {tensor.dtype} "
                               f"{list(tensor.shape)}")
        _check_written_finite(name, tensor)
        self.written.add(name)
        fd = self._fds[slot.file]
        if self._pool is None:
            _write_tensor(fd, tensor, slot.start)
            return
        while self._pending and self._pending_bytes + slot.nbytes > self.max_pending_bytes:
            self._finish_oldest()
        self._pending.append((self._pool.submit(_write_tensor, fd, tensor.detach(), slot.start), slot.nbytes))
        self._pending_bytes += slot.nbytes

    def _finish_oldest(self) -> None:
        future, nbytes = self._pending.popleft()
        self._pending_bytes -= nbytes
        future.result()             # a failed write is raised here

    def close(self) -> dict[str, str]:
        """Finish queued writes, close every shard and write the index (several shards); returns name -> file."""
        try:
            while self._pending:
                self._finish_oldest()
        finally:
            self._close_files()
        missing = [n for n in self.slots if n not in self.written]
        if missing:
            raise UpcycleError(f"the output plan has {len(missing)} tensors never written, e.g. {missing[:3]}")
        weight_map = {name: slot.file for name, slot in self.slots.items()}
        if len(self.files) > 1:
            total = sum(slot.nbytes for slot in self.slots.values())
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (self.directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return weight_map

    def abort(self) -> None:
        """Stop without checks (the caller's temporary folder is removed anyway); queued writes are dropped."""
        for future, _ in self._pending:
            future.cancel()
        self._pending.clear()
        self._close_files()

    def _close_files(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)       # a write in progress finishes before its file is closed
            self._pool = None
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}


def _write_all(fd: int, data, offset: int) -> None:
    """pwrite until every byte is written (a single call may write fewer)."""
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _write_tensor(fd: int, tensor: torch.Tensor, offset: int) -> None:
    _write_all(fd, tensor.to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy(), offset)

"""Sharded safetensors checkpoints, read one tensor at a time and written one tensor at a time (issue 13).

Reading (`CheckpointReader`): a folder's `model.safetensors`, or the shards its `model.safetensors.index.json`
lists. Files are memory-mapped by safetensors and a tensor is materialized only when asked for, so reading a
70B checkpoint costs the tensor in hand, not the model (mergekit reads checkpoints the same way).

Writing (`ShardedWriter`): every output tensor's name, shape and dtype are known before any weight exists (from a
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
from safetensors import safe_open

from ..errors import UpcycleError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 50 * 10**9       # transformers 5's save_pretrained default, "50GB"

DTYPE_CODES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
               torch.bool: "BOOL"}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


def parse_size(size: int | str) -> int:
    """Bytes from an int or a transformers-style size string ("5GB", "500MB", "2GiB")."""
    if isinstance(size, int):
        return size
    text = str(size).strip().upper()
    units = {"GIB": 2**30, "MIB": 2**20, "KIB": 2**10, "GB": 10**9, "MB": 10**6, "KB": 10**3, "B": 1}
    for unit, factor in units.items():
        if text.endswith(unit):
            try:
                value = float(text[: -len(unit)])
            except ValueError:
                break
            if value > 0:
                return int(value * factor)
    raise UpcycleError(f"shard size {size!r}: expected bytes or a size such as 5GB, 500MB, 2GiB")


# A weight index lists tensor names and file names: megabytes for the largest models; more is not an index.
MAX_INDEX_BYTES = 64 * 2**20


def check_finite(tensor: torch.Tensor, name: str, where: str) -> None:
    """Refuse NaN or infinite values in a floating-point tensor read from a checkpoint."""
    if tensor.is_floating_point() and not tensor.is_meta and not bool(torch.isfinite(tensor).all()):
        bad = int((~torch.isfinite(tensor)).sum())
        raise UpcycleError(f"{where}: tensor {name} holds {bad} NaN or infinite value(s); a model with non-finite "
                           f"weights is refused")


def check_index(folder: Path) -> dict[str, str]:
    """The weight map of `folder`'s safetensors index, each file a plain name of a file directly in the folder
    (an entry such as `../../secret.safetensors` or an absolute path would read tensors from elsewhere)."""
    index = folder / INDEX_FILE
    try:
        if not index.is_file() or index.stat().st_size > MAX_INDEX_BYTES:
            raise UpcycleError(f"{index} is not a regular file of at most {MAX_INDEX_BYTES // 2**20} MiB")
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, ValueError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise UpcycleError(f"{index} is not a safetensors index (a JSON object with a weight_map): "
                           f"{type(e).__name__}: {e}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in weight_map.items()):
        raise UpcycleError(f"{index}: weight_map must map tensor names to file names")
    for file in set(weight_map.values()):
        if not file or Path(file).name != file or file in (".", "..") or "\\" in file:
            raise UpcycleError(f"{index} names the weights file {file!r}, which is not a file in {folder}; an index "
                               f"may only name files next to it")
    return weight_map


class NoWeights(UpcycleError):
    """A folder without safetensors weights (as opposed to one whose weights are damaged)."""


def _safetensors_error(path: Path, error: Exception) -> UpcycleError:
    return UpcycleError(f"{path} is not a readable safetensors file ({type(error).__name__}: "
                        f"{' '.join(str(error).split())[:300]})")


class CheckpointReader:
    """The tensors of a checkpoint folder (single file or sharded), each read only when asked for; a file that is
    not safetensors, an index naming files outside the folder, and (with `check_values`) NaN or infinite weights
    are errors naming the file or tensor."""

    def __init__(self, folder: str | os.PathLike, *, check_values: bool = True):
        self.folder = Path(folder)
        self.check_values = check_values
        self._checked: set[str] = set()
        index = self.folder / INDEX_FILE
        if index.exists():
            weight_map = check_index(self.folder)
            self.file_of = {name: self.folder / file for name, file in weight_map.items()}
        elif (self.folder / SINGLE_FILE).is_file():
            path = self.folder / SINGLE_FILE
            self.file_of = dict.fromkeys(self._keys(path), path)
        else:
            raise NoWeights(f"{self.folder}: no {SINGLE_FILE} or {INDEX_FILE} (safetensors weights) to read")
        missing = sorted({str(p.name) for p in self.file_of.values() if not p.is_file()})
        if missing:
            raise UpcycleError(f"{self.folder}: the index lists shards that are not there: {', '.join(missing)}")
        self._open: dict[Path, object] = {}
        if index.exists():          # every shard's header read now, so that a damaged shard is named up front
            for path in sorted(set(self.file_of.values())):
                listed = {n for n, p in self.file_of.items() if p == path}
                absent = sorted(listed - set(self._keys(path)))
                if absent:
                    raise UpcycleError(f"{self.folder / INDEX_FILE} puts {absent[:3]} in {path.name}, which does not "
                                       f"hold them")

    @staticmethod
    def _keys(path: Path) -> list[str]:
        try:
            with safe_open(str(path), "pt") as f:
                return list(f.keys())
        except Exception as e:      # SafetensorError, OSError, a header that is not JSON...
            raise _safetensors_error(path, e) from None

    def _file(self, name: str):
        path = self.file_of[name]
        if path not in self._open:
            try:
                self._open[path] = safe_open(str(path), "pt")
            except Exception as e:
                raise _safetensors_error(path, e) from None
        return self._open[path]

    def names(self) -> list[str]:
        return list(self.file_of)

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._file(name).get_slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        code = self._file(name).get_slice(name).get_dtype()
        if code not in CODE_DTYPES:
            raise UpcycleError(f"{self.file_of[name]}: tensor {name} has dtype {code}, which upcycle does not read")
        return CODE_DTYPES[code]

    def get(self, name: str) -> torch.Tensor:
        """The tensor, read from the file now (a fresh tensor the caller owns)."""
        if name not in self.file_of:
            raise UpcycleError(f"{self.folder}: the checkpoint has no tensor {name!r}")
        try:
            tensor = self._file(name).get_tensor(name)
        except UpcycleError:
            raise
        except Exception as e:      # a file cut short after its header, a dtype torch lacks
            raise UpcycleError(f"{self.file_of[name]}: tensor {name} cannot be read ({type(e).__name__}: "
                               f"{' '.join(str(e).split())[:200]})") from None
        if self.check_values and name not in self._checked:
            check_finite(tensor, name, str(self.file_of[name]))
            self._checked.add(name)
        return tensor

    def nbytes(self) -> int:
        return sum(numel_of(self.shape(n)) * _element_size(self.dtype(n)) for n in self.file_of)

    def close(self) -> None:
        """Drop the open files (and their memory maps); the next read opens them again (a header parse)."""
        self._open.clear()


def numel_of(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


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
        nbytes = numel_of(spec[1]) * _element_size(spec[2])
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
    ordered = sorted(tensors, key=lambda t: (-_element_size(t[2]), t[0]))     # aligned, then by name
    header, offsets, at = {"__metadata__": metadata}, {}, 0
    for name, shape, dtype in ordered:
        if dtype not in DTYPE_CODES:
            raise UpcycleError(f"tensor {name}: dtype {dtype} cannot be written to safetensors here")
        end = at + numel_of(shape) * _element_size(dtype)
        header[name] = {"dtype": DTYPE_CODES[dtype], "shape": list(shape), "data_offsets": [at, end]}
        offsets[name] = (at, end)
        at = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return text, offsets


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

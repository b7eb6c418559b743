"""Safetensors checkpoints read one tensor at a time: a folder's `model.safetensors`, or the shards its
`model.safetensors.index.json` lists.

Files are memory-mapped by safetensors and a tensor is materialized only when asked for, so reading a 70B
checkpoint costs the tensor in hand, not the model (mergekit reads checkpoints the same way). A folder is data,
never a way out of itself: an index may name only files next to it (`check_index`), a damaged file is named in
the error, and NaN or infinite weights are refused (`check_finite`).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import UpcycleError
from ..files import read_json_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DTYPE_CODES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
               torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


# A weight index lists tensor names and file names: megabytes for the largest models; more is not an index.
MAX_INDEX_BYTES = 64 * 2**20


def is_finite(tensor: torch.Tensor) -> bool:
    """Whether a tensor holds no NaN or infinity (true of a tensor that is not floating point, or on meta)."""
    if not tensor.is_floating_point() or tensor.is_meta:
        return True
    if tensor.element_size() < 2:           # float8: torch has no isfinite for it; its values fit float16
        tensor = tensor.to(torch.float16)
    # A sum is finite only if every term is (NaN and infinities propagate through addition), and a sum costs a
    # twentieth of `isfinite(...).all()` on the CPU; a finite tensor whose sum overflows is checked term by term.
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


def check_finite(tensor: torch.Tensor, name: str, where: str) -> None:
    """Refuse NaN or infinite values in a floating-point tensor read from a checkpoint."""
    if not is_finite(tensor):
        values = tensor.to(torch.float16) if tensor.element_size() < 2 else tensor
        bad = int((~torch.isfinite(values)).sum())
        raise UpcycleError(f"{where}: tensor {name} holds {bad} NaN or infinite value(s); a model with non-finite "
                           f"weights is refused")


def check_index(folder: Path) -> dict[str, str]:
    """The weight map of `folder`'s safetensors index, each file a plain name of a file directly in the folder
    (an entry such as `../../secret.safetensors` or an absolute path would read tensors from elsewhere)."""
    index = folder / INDEX_FILE
    try:
        if not index.is_file() or index.stat().st_size > MAX_INDEX_BYTES:
            raise UpcycleError(f"{index} is not a regular file of at most {MAX_INDEX_BYTES // 2**20} MiB")
        weight_map = read_json_file(index, "safetensors index", MAX_INDEX_BYTES)["weight_map"]
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
        return sum(numel_of(self.shape(n)) * element_size(self.dtype(n)) for n in self.file_of)

    def close(self) -> None:
        """Drop the open files (and their memory maps); the next read opens them again (a header parse)."""
        self._open.clear()


def numel_of(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()

"""Files in detail: whether a path can be read as an input file (`file_problem`), the one JSON reader (`parse_json`
for text, `read_json_file` for a file within a size bound; nothing else in upcycle calls `json.load(s)`, which a
test checks), JSON text that every reader takes (`json_text`), and why a write failed for want of room
(`no_room`). How outputs are written whole is `upcycle.outputs`'."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

from .errors import UpcycleError


def file_problem(path: str | os.PathLike) -> str | None:
    """Why `path` cannot be read as an input file, in words for a message ("no such file", "is a folder", "is not a
    regular file (a pipe, a device or a socket)"), or None when it is a regular file (links followed)."""
    path = Path(path)
    if not path.exists():
        return "no such file" + (" (a link to nothing)" if path.is_symlink() else "")
    if path.is_dir():
        return "is a folder, not a file"
    if not path.is_file():
        return "is not a regular file (a pipe, a device or a socket)"
    return None


def _finite(value, path: str, found: list[str]):
    """`value` with every NaN or infinite float replaced by None (their dotted paths appended to `found`)."""
    if isinstance(value, float) and not math.isfinite(value):
        found.append(path or "(value)")
        return None
    if isinstance(value, dict):
        return {k: _finite(v, f"{path}.{k}" if path else str(k), found) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v, f"{path}[{i}]", found) for i, v in enumerate(value)]
    return value


def json_text(value, *, indent: int | None = None, where: str | None = None) -> str:
    """Valid JSON of `value` (Python's json writes NaN and Infinity, which no JSON reader takes): a non-finite
    number is written as null, and named on stderr when `where` (the file) is given."""
    found: list[str] = []
    clean = _finite(value, "", found)
    if found and where is not None:
        print(f"[upcycle] {where}: {len(found)} value(s) were not finite (NaN or infinite) and are written as null: "
              f"{', '.join(found[:5])}{', ...' if len(found) > 5 else ''}", file=sys.stderr)
    return json.dumps(clean, indent=indent, allow_nan=False)


# errnos of a write that found no room: a full disk, a file-size limit (`ulimit -f`), a quota
_NO_ROOM = {28: "no space left on the device", 27: "a file-size limit (ulimit -f) was reached",
            122: "the disk quota is exceeded"}
# the same, as libraries that wrap the OSError in their own error say it (safetensors' Rust IoError, torch.save)
_NO_ROOM_TEXT = (("No space left on device", 28), ("os error 28", 28), ("File too large", 27),
                 ("os error 27", 27), ("Disk quota exceeded", 122), ("os error 122", 122))


def no_room(error: BaseException) -> str | None:
    """Why a write failed for want of room, or None when `error` is something else: the error itself, or any
    error it was raised from, as an OSError's errno or as a wrapping library words it."""
    seen = error
    for _ in range(8):
        if seen is None:
            break
        if isinstance(seen, OSError) and seen.errno in _NO_ROOM:
            where = f" writing {seen.filename}" if seen.filename else ""
            return f"{_NO_ROOM[seen.errno]}{where}"
        text = str(seen)
        for words, code in _NO_ROOM_TEXT:
            if words in text:
                return _NO_ROOM[code]
        seen = seen.__cause__ or seen.__context__
    return None


# A JSON file upcycle reads beside a model (config.json, upcycle_config.json, a report): kilobytes, megabytes for
# a config with a large label map; more is not one, and reading it whole would cost the memory first.
MAX_JSON_BYTES = 64 * 2**20


def parse_json(text: str | bytes, where: str):
    """The JSON value of `text` (a line of a JSONL file, a file's content, a library's serialization), or one
    UpcycleError naming `where`: not JSON (the parser's words, on one line), or nested too deeply for the parser
    (Python's json recurses per level: 5,000 levels are a RecursionError, not data)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise UpcycleError(f"{where}: invalid JSON (nested too deeply to read)") from None
    except ValueError as e:     # JSONDecodeError, bad UTF-8 in bytes, an integer past Python's digit limit
        raise UpcycleError(f"{where}: invalid JSON ({' '.join(str(e).split())[:200]})") from None


def json_copy(value):
    """`value` as JSON gives it back (a deep copy with tuples as lists and keys as strings): what a file written of
    it holds, to compare with one read."""
    return json.loads(json.dumps(value))


def read_json_file(path: str | os.PathLike, what: str, max_bytes: int = MAX_JSON_BYTES):
    """The JSON value in `path`, or one UpcycleError naming the file and `what` it is: unreadable, larger than
    `max_bytes` (checked before reading), not UTF-8, not JSON, or nested too deeply for the parser."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise UpcycleError(f"{path}: the {what} is {size:,} bytes, more than the {max_bytes:,} such a file "
                               f"holds; it was not read")
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UpcycleError(f"{path}: the {what} cannot be read ({type(e).__name__}: {e})") from None
    return parse_json(text, f"{path}: the {what}")

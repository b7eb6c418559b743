"""Writing outputs whole or not at all: a temporary sibling renamed into place when the work succeeded.

`atomic_directory` (a folder) and `atomic_write` / `atomic_write_text` (one file) write next to the output and
rename at the end, so a failed or killed run leaves no partial output (docs/design.md principle 4). Temporaries
carry their owner's host and process id, so a later run can remove the ones a killed process left and leave alone
those still being written.
Every rename that puts an output in place is here (`replace_directory`, `atomic_write`, `move_files`): the rest
of the package writes through these. Which outputs a command may write at all is `upcycle.checkpoint.folders`'
job; nothing here ever deletes an input.
"""

from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path

from .errors import UpcycleError


def temp_prefix(out: Path, kind: str = "tmp") -> str:
    """Name prefix of a temporary sibling of `out` that records its owner (host and process id), so a later run
    can tell a temporary left by a killed process from one still being written."""
    return f".{out.name}.{kind}-{socket.gethostname()}-{os.getpid()}-"


def _owner_alive(name: str, out: Path) -> bool | None:
    """Whether the process that made temporary `name` of `out` still runs; None when unknown (another host, or
    a name without an owner, as older versions wrote)."""
    for kind in ("tmp", "old"):
        head = f".{out.name}.{kind}-"
        if not name.startswith(head):
            continue
        parts = name[len(head):].rsplit("-", 2)   # the host may contain '-'; the pid and mkdtemp's suffix do not
        if len(parts) != 3 or not parts[1].isdigit() or parts[0] != socket.gethostname():
            return None
        try:
            os.kill(int(parts[1]), 0)
        except ProcessLookupError:
            return False
        except PermissionError:       # another user's process: alive
            pass
        return True
    return None


def clean_stale_temporaries(out: str | os.PathLike) -> list[str]:
    """Remove temporaries of `out` whose owner process is gone (a run killed while writing); say on stderr (and
    return) what was removed and what was left (an owner still running, or on another host)."""
    out = Path(out)
    if not out.parent.is_dir():
        return []
    said = []
    stems = (f".{glob.escape(out.name)}.tmp-*", f".{glob.escape(out.name)}.old-*")
    for path in sorted(p for stem in stems for p in out.parent.glob(stem)):
        alive = _owner_alive(path.name, out)
        if alive is False:
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
            said.append(f"removed {path}, left by a process that no longer runs")
        elif alive is None:
            said.append(f"left {path} in place: a temporary of {out} from another host or an older upcycle; "
                        f"remove it by hand if no run is writing it")
    for message in said:
        print(f"[upcycle] {message}", file=sys.stderr)
    return said


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


def refuse_existing(out: Path, overwrite: bool) -> None:
    if out.exists() and not overwrite:
        raise UpcycleError(f"output {out} already exists (pass --overwrite to replace it)")


@contextlib.contextmanager
def atomic_directory(out: str | os.PathLike, *, overwrite: bool = False):
    """Yield a temporary directory that becomes `out` only if the block finishes without an exception.

    The temporary is a sibling named after its owner (`temp_prefix`), so a run killed with SIGKILL leaves a
    folder that the next run of the same OUT recognizes and removes (`clean_stale_temporaries`)."""
    out = Path(out)
    refuse_existing(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_temporaries(out)
    tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(out), dir=out.parent))
    try:
        yield tmp
        _default_permissions(tmp)
    except BaseException:          # KeyboardInterrupt and SystemExit too: never leave a partial folder
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_directory(tmp, out)


def replace_directory(new: Path, out: Path) -> None:
    """Put folder `new` at `out`: a rename, with the previous `out` moved aside first and removed after."""
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=temp_prefix(out, "old"), dir=out.parent))
        os.replace(out, old / "previous")
        os.replace(new, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(new, out)


def _default_permissions(directory: Path) -> None:
    """mkdtemp (and safetensors) create owner-only files; give the output the permissions of a plain mkdir."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for path in directory.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def check_writable_output(out: str | os.PathLike) -> None:
    """Refuse an OUT that `atomic_directory` could not create, before any work is done: a parent path that runs
    through a file, a folder without write permission, a read-only or virtual file system (/proc).

    The writer creates OUT's missing parents and a temporary sibling of OUT, so what must be writable is the
    nearest folder on the way up that exists. It is probed by creating and removing an empty temporary folder
    there (permission bits alone miss read-only mounts, /proc, and the superuser who ignores them), so the check
    leaves nothing behind."""
    out = Path(out).absolute()
    base = out.parent
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():
        raise UpcycleError(f"cannot write output {out}: {base} is a file, not a folder")
    if not os.access(base, os.W_OK | os.X_OK):
        raise UpcycleError(f"cannot write output {out}: no permission to create files in {base}")
    try:
        probe = tempfile.mkdtemp(prefix=f".{out.name}.write-check-", dir=base)
    except OSError as e:
        raise UpcycleError(f"cannot write output {out}: a folder cannot be created in {base} "
                           f"({e.strerror or e})") from None
    os.rmdir(probe)


def atomic_write(path: str | os.PathLike, write) -> None:
    """Write one file through a temporary sibling renamed over it: readers see the old file or the new one.
    `write(tmp)` fills the temporary, which `mkstemp` created new (O_EXCL: never a name someone planted a link
    under) with an unpredictable name beside `path`."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(path), dir=path.parent)
    try:
        os.close(fd)
        write(Path(tmp))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def move_files(source: Path, names: list[str], into: Path) -> None:
    """Rename the files `names` of folder `source` into folder `into` (on one file system), in the order given,
    each replacing what `into` holds under its name: a reader sees each file old or new, never half written."""
    for name in names:
        os.replace(source / name, into / name)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """`atomic_write` of UTF-8 text."""
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


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


def read_json_file(path: str | os.PathLike, what: str, max_bytes: int = MAX_JSON_BYTES):
    """The JSON value in `path`, or one UpcycleError naming the file and `what` it is: unreadable, larger than
    `max_bytes` (checked before reading), not UTF-8, not JSON, or nested too deeply for the parser."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise UpcycleError(f"{path}: the {what} is {size:,} bytes, more than the {max_bytes:,} such a file "
                               f"holds; it was not read")
        return json.loads(path.read_text(encoding="utf-8"))
    except RecursionError:
        raise UpcycleError(f"{path}: the {what} nests too deeply to be read") from None
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise UpcycleError(f"{path}: the {what} cannot be read ({type(e).__name__}: {e})") from None

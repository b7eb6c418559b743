"""Whether upcycle wrote an existing output, proven by its record, file by file, so that `--overwrite`, `--resume`
and a comparison's clean-up delete or replace only what upcycle wrote (`claims.check_replaceable`).

An output folder carries the record `MARKER`: its kind and, for every file upcycle wrote into it, the file's
relative path and fingerprint (`fingerprint`: its size and the SHA-256 of its bytes; a file over FULL_HASH_BYTES,
a weight shard, by its size, its modification time and the SHA-256 of three 1 MiB samples, so that judging a
100 GB output does not read 100 GB). A finished output is recorded whole when it is written; one that grows while a
command runs (a training run, a comparison) is recorded file by file as upcycle writes them (`record`), and a file
upcycle only appends to (a run's log) by the fingerprint of the part it had written (`appended`). A subfolder with a
record of its own (a run's model/, a comparison's conversions and runs) is judged by it.

A file is upcycle's when the record lists it and it still has the recorded fingerprint. Any other file, at any
depth, is the user's: a file added or edited since, one the record does not list, a link, a file whose name
resembles upcycle's. upcycle never deletes or replaces a user's file: a command that would have to refuses first
(`foreign_files`), and removal (`remove_owned`) deletes recorded files alone, then the folders that are left
empty. The one exception is upcycle's own temporaries by the whole of their name (`staging.temporary_owner`).

A folder written before records carried fingerprints (a marker without them, or none) cannot be proven upcycle's:
it is refused with that reason, and the user removes it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import socket
from collections.abc import Iterable, Iterator
from pathlib import Path

from .staging import atomic_write_text, process_state, temporary_owner

MARKER = ".upcycle-output.json"
MARKER_FORMAT = "upcycle-output"
RECORD_VERSION = 2
FULL_HASH_BYTES = 64 * 2**20
SAMPLE_BYTES = 2**20
# Folders written by upcycle before records carried fingerprints, recognised by the file that names their kind
# (so that the refusal can say what they are).
LEGACY_SIGNATURES = {"upcycle_config.json": "convert", "upcycle_report.json": "export", "run_config.yaml": "train",
                     "study.json": "compare", "analysis.json": "analyze"}
# sentence-transformers' files beside the transformer (checkpoint/sentence_modules.py reads and carries them)
SENTENCE_ROOT_FILES = ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json")
# The files of a model folder (transformers' save_pretrained, its tokenizer's files, upcycle's own records).
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
               "upcycle_config.json", "upcycle_report.json", "run_config.yaml", "tokenizer.json",
               "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt",
               "merges.txt", "tokenizer.model", "spiece.model", "chat_template.jinja", "chat_template.json",
               "preprocessor_config.json", "processor_config.json", *SENTENCE_ROOT_FILES)
# The names upcycle gives the top-level entries of its growing outputs (what sentence_modules.py will not take for a
# module's file); ownership itself goes by the record alone.
OUTPUT_ENTRIES = ("run_config.yaml", "log.jsonl", "checkpoints", "model", "inputs.json", "tensorboard", "wandb",
                  "study.json", "invocations", "calibration", "conversions", "cells", "comparison.json",
                  "comparison.md", "metric_over_steps.png", "init_diagnostics.png")
LOCK = re.compile(r"\.(?P<base>.+)\.lock")
LOCK_TEXT = re.compile(r"process (?P<pid>\d+) on (?P<host>\S+)\n?")


def fingerprint(path: Path) -> dict:
    """What identifies the file's content (module docstring)."""
    info = path.stat()
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        if info.st_size <= FULL_HASH_BYTES:
            for block in iter(lambda: f.read(SAMPLE_BYTES), b""):
                digest.update(block)
            return {"size": info.st_size, "sha256": digest.hexdigest()}
        for start in (0, info.st_size // 2, info.st_size - SAMPLE_BYTES):
            f.seek(start)
            digest.update(f.read(SAMPLE_BYTES))
    return {"size": info.st_size, "mtime_ns": info.st_mtime_ns, "sampled_sha256": digest.hexdigest()}


def _prefix_fingerprint(path: Path, size: int) -> dict:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        left = size
        while left > 0:
            block = f.read(min(SAMPLE_BYTES, left))
            if not block:
                break
            digest.update(block)
            left -= len(block)
    return {"size": size, "prefix_sha256": digest.hexdigest()}


def unchanged(path: Path, entry: dict) -> bool:
    """Whether the file still has the fingerprint its record gives (an appended file: still begins with what
    upcycle wrote)."""
    try:
        if not path.is_file() or path.is_symlink():
            return False
        if "prefix_sha256" in entry:
            return path.stat().st_size >= entry["size"] and _prefix_fingerprint(path, entry["size"]) == entry
        return fingerprint(path) == entry
    except (OSError, TypeError, KeyError):
        return False


def _own_lock(path: Path) -> bool:
    """A lock file upcycle left beside an output inside this folder (`claims.acquire_lock`): the name, and the
    text naming this host and a process that is gone or is upcycle's."""
    if LOCK.fullmatch(path.name) is None or path.is_symlink() or not path.is_file():
        return False
    try:
        found = LOCK_TEXT.fullmatch(path.read_text()[:200])
    except (OSError, UnicodeDecodeError):
        return False
    return found is not None and found["host"] == socket.gethostname() and \
        process_state(int(found["pid"])) in ("gone", "upcycle", "mine")


def _upcycles_aside(path: Path) -> bool:
    """upcycle's own temporary or lock file (never a link), which ownership passes over."""
    return not path.is_symlink() and (temporary_owner(path.name) is not None or _own_lock(path))


def _walk(folder: Path, prefix: str = "") -> Iterator[tuple[str, Path, str]]:
    """(relative path, path, what) below `folder`, never following a link: what is "file" (a file or a link),
    "dir" (a folder, yielded before what it holds) or "output" (a subfolder with a record of its own, not
    entered); upcycle's temporaries are left out."""
    for entry in sorted(folder.iterdir()):
        if _upcycles_aside(entry):
            continue
        rel = f"{prefix}{entry.name}"
        if entry.is_dir() and not entry.is_symlink():
            if (entry / MARKER).is_file() and not (entry / MARKER).is_symlink():
                yield rel, entry, "output"
            else:
                yield rel, entry, "dir"
                yield from _walk(entry, rel + "/")
        else:
            yield rel, entry, "file"


def read_record(folder: Path) -> dict | None:
    """The folder's record (RECORD_VERSION), or None: absent, unreadable, a link, an older format, or listing an
    entry outside the folder (`record_problem` says which)."""
    return None if record_problem(folder) else _parsed_record(folder)


def _parsed_record(folder: Path) -> dict | None:
    from ..files import read_json_file

    try:
        return read_json_file(folder / MARKER, "output record")
    except Exception:           # noqa: BLE001  (any unreadable record proves nothing)
        return None


def record_problem(folder: Path) -> str | None:
    """Why the folder's record proves nothing, in words for a refusal; None when it is a record of this version
    whose every entry lies inside the folder, reached through no link."""
    path = folder / MARKER
    if path.is_symlink():
        return f"its record ({MARKER}) is a link"
    if not path.is_file():
        return f"it has no record ({MARKER})"
    current = _parsed_record(folder)
    if not isinstance(current, dict) or current.get("format") != MARKER_FORMAT:
        return f"its record ({MARKER}) is damaged or unreadable (not an upcycle record of its files)"
    if current.get("version") != RECORD_VERSION:
        return (f"its record ({MARKER}) does not prove what upcycle wrote: it was written before upcycle recorded "
                f"its files' sizes and hashes (version {current.get('version')!r}, not {RECORD_VERSION})")
    if not isinstance(current.get("files"), dict):
        return f"its record ({MARKER}) is damaged or unreadable (its files are not listed by name)"
    for rel in current["files"]:
        if why := _outside(folder, rel):
            return f"its record lists {rel!r}, {why}: a record that reaches outside its folder proves nothing"
    return None


def _outside(folder: Path, rel: object) -> str | None:
    """Why the record entry `rel` does not name a place inside `folder` (None when it does): not a relative path
    of plain names, or one that passes through a link."""
    if not isinstance(rel, str) or not rel or "\\" in rel or "\0" in rel:
        return "not a relative path"
    parts = rel.split("/")
    if rel.startswith("/") or Path(rel).is_absolute() or any(p in ("", ".", "..") for p in parts):
        return "which is absolute or climbs out of the folder"
    for depth in range(1, len(parts)):           # the folders on the way, never a link
        if (folder.joinpath(*parts[:depth])).is_symlink():
            return "which passes through a link"
    return None


DIR = {"dir": True}


def _entry(path: Path) -> dict:
    return DIR if path.is_dir() and not path.is_symlink() else fingerprint(path)


def write_marker(folder: Path, kind: str, files: Iterable[str] | None = None, *, made: bool = True) -> None:
    """Record `folder` as upcycle's output of `kind`: everything below it (a finished output, `files` None), or
    the given files and folders (a growing output starts with none and `record`s what it writes). `made`: upcycle
    made the folder itself (not so for an empty folder a user gave, which `remove_owned` then keeps)."""
    from ..version import __version__

    if files is None:
        files = [rel for rel, _, what in _walk(folder) if rel != MARKER and what != "output"]
    current = {"format": MARKER_FORMAT, "version": RECORD_VERSION, "kind": kind, "upcycle": __version__,
               "made": made, "files": {rel: _entry(folder / rel) for rel in sorted(files)}}
    atomic_write_text(folder / MARKER, json.dumps(current, indent=1) + "\n")


def record(folder: Path, files: Iterable[str] = (), *, appended: Iterable[str] = (),
           forget: Iterable[str] = ()) -> None:
    """Add to `folder`'s record the files and folders upcycle just wrote there (with the folders on their way;
    `appended`: files it writes only by appending, by their content so far), and drop those it removed
    (`forget`)."""
    with folder_lock(folder):      # processes adding to one output (compare's invocations) take turns
        _record(folder, list(files), list(appended), list(forget))


@contextlib.contextmanager
def folder_lock(folder: Path) -> Iterator[None]:
    """An exclusive lock on `folder` itself (flock on the folder; nothing is written), held while the block runs.
    Not re-entrant: a block holding it must not call `record` on the same folder."""
    import fcntl
    import os

    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _record(folder: Path, files: list[str], appended: list[str], forget: list[str]) -> None:
    current = read_record(folder)
    if current is None:
        raise RuntimeError(f"{folder} has no record of upcycle's to add to")
    entries = current["files"]
    for rel in forget:
        entries.pop(rel, None)
    for rel in [*files, *appended]:
        parts = rel.split("/")
        for depth in range(1, len(parts)):        # the folders upcycle made on the way
            entries.setdefault("/".join(parts[:depth]), DIR)
    for rel in files:
        entries[rel] = _entry(folder / rel)
    for rel in appended:
        path = folder / rel
        if path.is_file():
            entries[rel] = _prefix_fingerprint(path, path.stat().st_size)
    current["files"] = dict(sorted(entries.items()))
    atomic_write_text(folder / MARKER, json.dumps(current, indent=1) + "\n")


def files_below(folder: Path, top: str) -> list[str]:
    """Every file and folder under `folder/top` (a tracker's folder), relative to `folder`: what upcycle records
    as written there by a library it ran."""
    base = folder / top
    if not base.is_dir() or base.is_symlink():
        return []
    return [top, *(f"{top}/{rel}" for rel, path, what in _walk(base) if what != "output" and not path.is_symlink())]


def replaceable(folder: Path, rel: str) -> bool:
    """Whether upcycle may replace `folder/rel`: absent, or a file its record lists with the fingerprint it has."""
    path = folder / rel
    if not path.exists() and not path.is_symlink():
        return True
    current = read_record(folder)
    return current is not None and rel in current["files"] and unchanged(path, current["files"][rel])


def foreign_files(folder: Path) -> list[str] | None:
    """What below an output folder upcycle cannot prove it wrote (relative paths; a folder ends with '/'), or None
    when the folder has no record of upcycle's at all."""
    current = read_record(folder)
    if current is None:
        return None
    listed = current["files"]
    foreign = []
    for rel, path, what in _walk(folder):
        if rel == MARKER:
            continue
        if what == "output":
            inner = foreign_files(path)
            foreign += [f"{rel}/{f}" for f in inner] if inner is not None else [f"{rel}/"]
        elif what == "dir":
            if listed.get(rel) != DIR:
                foreign.append(f"{rel}/")
        elif rel not in listed or not unchanged(path, listed[rel]):
            foreign.append(rel)
    return foreign


def own_output(path: Path) -> str | None:
    """Why upcycle may replace the existing output `path` (its kind), or None when it may not: a folder everything
    in which its record proves upcycle's (`foreign_files`), an empty folder, or a JSON file whose `format` names
    upcycle."""
    from ..files import read_json_file

    if path.is_symlink():
        return None
    if path.is_file():
        try:
            data = read_json_file(path, "output")
        except Exception:        # noqa: BLE001  (not readable as upcycle's)
            return None
        kind = data.get("format") if isinstance(data, dict) else None
        return kind if isinstance(kind, str) and kind.startswith("upcycle") else None
    if not path.is_dir():
        return None
    if not any(not _upcycles_aside(p) for p in path.iterdir()):
        return "empty folder"
    current = read_record(path)
    return str(current["kind"]) if current is not None and foreign_files(path) == [] else None


def why_not_own(path: Path) -> str:
    """What keeps the folder `path` from being upcycle's, for a refusal."""
    foreign = foreign_files(path)
    if foreign:
        more = f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        return f"it holds what upcycle did not write, or changed since ({', '.join(foreign[:5])}{more})"
    if (path / MARKER).exists() or (path / MARKER).is_symlink():
        return f"{record_problem(path) or 'its record does not prove what upcycle wrote'}; it is not proven upcycle's"
    if legacy_kind(path) is not None:
        return (f"a folder without a record ({MARKER}) does not prove what upcycle wrote: it was written before "
                f"upcycle recorded its files' sizes and hashes, or it is not upcycle's")
    return f"upcycle did not write it (no {MARKER})"


def remove_owned(folder: Path, files: Iterable[str] | None = None, *, keep_folder: bool = False) -> list[str]:
    """Delete what below `folder` its record proves upcycle's (only `files` of it, when given: their files and
    then the recorded folders they leave empty), and with the whole folder upcycle's temporaries and lock files of
    processes that are gone, the record and, once empty and unless `keep_folder`, the folder itself; return what
    is left (relative paths): the user's."""
    current = read_record(folder)
    listed = current["files"] if current is not None else {}
    wanted = None if files is None else set(files)
    removed = []
    for rel, path, what in list(_walk(folder)):
        if wanted is not None and rel not in wanted:
            continue
        if what == "output":
            if not remove_owned(path):
                removed.append(rel)
        elif what == "file" and rel in listed and unchanged(path, listed[rel]):
            path.unlink()
            removed.append(rel)
    for rel in sorted((r for r, e in listed.items() if e == DIR and (wanted is None or r in wanted)),
                      key=lambda r: r.count("/"), reverse=True):
        path = folder / rel
        if _outside(folder, rel):               # read_record refuses such a record; never leave the folder
            continue
        with contextlib.suppress(OSError):
            if path.is_dir() and not path.is_symlink():
                path.rmdir()                    # only when empty: a user's file inside keeps it
                removed.append(rel)
    if wanted is None:
        _remove_stale_aside(folder)
        if current is not None and [p.name for p in folder.iterdir()] == [MARKER]:
            (folder / MARKER).unlink()
            if not keep_folder and current.get("made", True):
                with contextlib.suppress(OSError):
                    folder.rmdir()
        if not folder.exists():
            return []
    elif current is not None:
        record(folder, forget=removed)
    return [rel + ("/" if what == "dir" else "") for rel, _, what in _walk(folder)
            if rel != MARKER and (wanted is None or rel in wanted)]


def remove_listed(folder: Path, listed: dict) -> list[str]:
    """Delete what below `folder` the entries `listed` prove upcycle's (relative to `folder`, taken from a record
    that covers it: a run's record lists its checkpoints' files), then the listed folders left empty; return what
    is left (relative paths): the user's, and files changed since they were recorded."""
    for rel, path, what in list(_walk(folder)):
        if what == "output":
            remove_owned(path)
        elif what == "file" and rel in listed and not _outside(folder, rel) and unchanged(path, listed[rel]):
            path.unlink()
    for rel in sorted((r for r, e in listed.items() if e == DIR and not _outside(folder, r)),
                      key=lambda r: r.count("/"), reverse=True):
        with contextlib.suppress(OSError):
            if (folder / rel).is_dir() and not (folder / rel).is_symlink():
                (folder / rel).rmdir()
    return [rel + ("/" if what == "dir" else "") for rel, _, what in _walk(folder)]


def _remove_stale_aside(folder: Path) -> None:
    """upcycle's temporaries and lock files directly in `folder` whose process is gone."""
    import shutil

    for path in folder.iterdir():
        if path.is_symlink():
            continue
        if temporary_owner(path.name) == "gone":
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        elif _own_lock(path):
            found = LOCK_TEXT.fullmatch(path.read_text()[:200])
            if found is not None and process_state(int(found["pid"])) == "gone":
                path.unlink()


def indexed_shards(folder: Path) -> set[str]:
    """The weight files a folder's index names (a shard it does not name is not part of the model)."""
    from ..files import read_json_file

    try:
        index = read_json_file(folder / "model.safetensors.index.json", "weight index")
        return {str(v) for v in index["weight_map"].values()}
    except Exception:       # noqa: BLE001
        return set()


def kind_of(folder: Path) -> str | None:
    """The kind of upcycle output `folder` is, by its record, or by its marker and signature file when upcycle
    wrote it before records carried fingerprints: what a command that adds to its own output (`--resume`,
    `compare`) needs there (it deletes nothing it cannot prove its own). None for anything else."""
    if not folder.is_dir() or folder.is_symlink():
        return None
    current = read_record(folder)
    if current is not None:
        return str(current["kind"])
    from ..files import read_json_file

    try:
        old = read_json_file(folder / MARKER, "output record") if (folder / MARKER).is_file() else None
    except Exception:        # noqa: BLE001
        old = None
    if isinstance(old, dict) and old.get("format") == MARKER_FORMAT and isinstance(old.get("kind"), str):
        return old["kind"]
    return legacy_kind(folder)


def legacy_kind(folder: Path) -> str | None:
    """The kind of a folder upcycle wrote before records carried fingerprints (its signature file), or None."""
    names = {p.name for p in folder.iterdir()} if folder.is_dir() else set()
    return next((k for signature, k in LEGACY_SIGNATURES.items() if signature in names), None)

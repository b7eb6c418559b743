"""Where a command may write: inputs are sacred, `--overwrite` replaces only upcycle's own outputs, one writer.

Every command that writes (convert, export, train, eval --out, analyze, compare, tiny-clip) claims its output
with `claim_output` before it reads a weight, and holds the claim until it is done:

- **inputs**: every path the command reads (model folders, the embedded model's cache, data, calibration and
  probe files, recipes, `--dense`, what a run or a conversion recorded) is given to the claim. An output that is
  an input, holds one, lies inside one, or reaches one through symbolic links (both sides are resolved; a model
  folder's linked files count too, as in a Hugging Face cache snapshot) is refused, whatever `--overwrite` says.
- **own outputs only**: an existing output is replaced only with `--overwrite`, and only when upcycle wrote it:
  a folder every file and folder of which, at any depth, its record lists with the fingerprint it still has
  (`upcycle.outputs.ownership`), or a JSON file of this command's own kind (`FILE_FORMATS`). A folder the user
  made, or one they put their own files into, at any depth, is never deleted; even then only recorded files are
  removed. An output that is a symbolic link is refused (replacing it would replace the link or, worse, what it
  points to). A command that adds to its own output (`--resume`, `compare`) needs its record's kind there and
  leaves a user's files in it alone.
- **one writer**: the claim holds an exclusive lock (`fcntl.flock`) on `.NAME.lock` beside the output, so a
  second run into the same output is refused at once instead of mixing with the first.

The claim writes through `Claim.directory()` (a temporary sibling renamed into place at the end, with the marker)
or `Claim.write_text()` (a temporary file renamed into place), so an output is whole or absent.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UpcycleError
from .ownership import kind_of, own_output, remove_owned, why_not_own, write_marker
from .staging import atomic_directory, atomic_write_text, check_writable_output


@dataclass(frozen=True)
class Input:
    """A path the command reads, and what it is to the user (for the message)."""

    what: str
    path: Path


def inputs(*pairs: tuple[str, str | os.PathLike | None]) -> list[Input]:
    """[(what, path)] -> Inputs, leaving out the paths not given (None) and names that are not paths."""
    return [Input(what, Path(path).expanduser()) for what, path in pairs if path not in (None, "")]


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _reach(path: Path) -> list[Path]:
    """Where reading `path` may lead: the path itself resolved, and for a folder the resolved targets of the
    symbolic links directly in it (a Hugging Face cache snapshot links each file into its blob store)."""
    found = [path.resolve()]
    if path.is_dir():
        try:
            entries = list(path.iterdir())
        except OSError:
            entries = []
        found += [entry.resolve() for entry in entries if entry.is_symlink()]
    return found


def check_inputs(out: Path, given: Iterable[Input]) -> None:
    """Refuse an output that is, holds, lies inside, or reaches through links, any input; or holds the current
    directory. Nothing is touched."""
    resolved = out.resolve()
    cwd = Path.cwd().resolve()
    if _inside(cwd, resolved):
        raise UpcycleError(f"output {out} is the current directory or holds it; choose a new folder for OUT")
    for item in given:
        if not item.path.exists() and not item.path.is_symlink():
            continue
        for reached in _reach(item.path):
            if _inside(reached, resolved):
                relation = "is" if reached == resolved else "holds"
                raise UpcycleError(f"output {out} {relation} the {item.what} {item.path}; writing there would "
                                   f"destroy an input. Choose another place for the output")
            if _inside(resolved, reached):
                raise UpcycleError(f"output {out} lies inside the {item.what} {item.path}; upcycle never writes "
                                   f"into its inputs. Choose a place outside it")
        if out.exists() and item.path.is_file() and out.is_file() and os.path.samefile(out, item.path):
            raise UpcycleError(f"output {out} is the {item.what} {item.path} (the same file under another name)")


# The `format` of the one-file outputs, by the kind of command that writes them: a file is replaced only by a
# command of its own kind (`eval --out` never replaces a run's manifest, a folder's upcycle_config.json, ...).
FILE_FORMATS = {"eval": "upcycle-eval"}


def check_replaceable(out: Path, *, overwrite: bool, file: bool = False, kind: str | None = None) -> None:
    """An existing output needs --overwrite, and may be replaced only when upcycle wrote it, as this kind of
    output for a file (FILE_FORMATS)."""
    if out.is_symlink():
        raise UpcycleError(f"output {out} is a symbolic link; give the real location (upcycle never writes "
                           f"through a link)")
    if not out.exists():
        return
    if file and out.is_dir():
        raise UpcycleError(f"output {out} is a folder; give a file name")
    if not file and not out.is_dir():
        raise UpcycleError(f"output {out} exists and is not a folder")
    if not overwrite:
        if not file and out.is_dir() and not any(out.iterdir()):
            return                       # an empty folder made for the output: nothing to lose
        raise UpcycleError(f"output {out} already exists (pass --overwrite to replace it)")
    found = own_output(out)
    if file and found is not None and found != FILE_FORMATS.get(kind):
        wanted = FILE_FORMATS.get(kind)
        raise UpcycleError(f"--overwrite replaces a file only when upcycle wrote it as {kind} output"
                           f"{f' (format {wanted!r})' if wanted else ''}, and {out} is another upcycle file "
                           f"(format {found!r}): replacing it would damage the output it belongs to. Choose "
                           f"another file")
    if found is None and file and (owner := own_output(out.parent)) not in (None, "empty folder"):
        raise UpcycleError(f"--overwrite replaces a file only when upcycle wrote it as {kind} output, and {out} is "
                           f"a file of the upcycle {owner} output {out.parent}: replacing it would damage that "
                           f"output. Choose another file")
    if found is None:
        why = "upcycle did not write it" if file else why_not_own(out)
        raise UpcycleError(f"--overwrite replaces only upcycle's own outputs, and {out} is not one: {why}. Move "
                           f"it away or choose another output")


class OutputLocked(UpcycleError):
    """Another process is writing the same output."""


@dataclass
class _Lock:
    path: Path
    fd: int

    def release(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.path)        # unlinked while still locked: a newcomer opens a fresh file
        os.close(self.fd)


def lock_path(out: Path) -> Path:
    return out.parent / f".{out.name}.lock"


_LOCK_TEXT = re.compile(r"(process \d+ on \S*\n?)?")     # what upcycle writes into a lock file (or nothing yet)


def _open_lock_file(path: Path) -> int:
    """Open (or create) the lock file without following a link, and only if it is upcycle's: a plain file with
    one name. A link, a folder, a FIFO, a second name of another file (a hard link) are refused: the lock file is
    truncated and written, and removed at the end."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
                     | getattr(os, "O_NONBLOCK", 0), 0o644)
    except OSError as e:
        what = {errno.ELOOP: "a symbolic link", errno.EISDIR: "a folder"}.get(e.errno)
        if what:
            raise UpcycleError(f"the lock file {path} is {what}: upcycle writes its lock there and never through a "
                               f"link or into a folder; move it away") from None
        raise UpcycleError(f"cannot create the lock file {path}: {e.strerror or e}") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        os.close(fd)
        what = "not a plain file" if not stat.S_ISREG(info.st_mode) else "a second name of another file (a hard link)"
        raise UpcycleError(f"the lock file {path} is {what}: upcycle does not write into it; move it away")
    return fd


def acquire_lock(out: Path) -> _Lock:
    """An exclusive lock on `out`'s lock file, or OutputLocked naming the holder."""
    import fcntl

    path = lock_path(out)
    while True:
        fd = _open_lock_file(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = ""
            with contextlib.suppress(OSError, UnicodeDecodeError):
                holder = os.pread(fd, 200, 0).decode().strip()
            os.close(fd)
            if e.errno in (errno.EAGAIN, errno.EACCES):
                raise OutputLocked(f"output {out} is being written by another upcycle run"
                                   f"{f' ({holder})' if holder else ''}; wait for it to finish or choose another "
                                   f"output") from None
            raise
        # the file may have been unlinked by its last holder between our open and our lock: lock the new one
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            text = os.pread(fd, 4096, 0)
            if not _LOCK_TEXT.fullmatch(text.decode(errors="replace")):
                os.close(fd)             # a file of the user's under the lock's name: left as it is
                raise UpcycleError(f"{path} exists and is not an upcycle lock file (it holds other text); upcycle "
                                   f"would write its lock there: move it away")
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"process {os.getpid()} on {os.uname().nodename}\n".encode(), 0)
            except OSError:              # no room even for the lock's line (a full disk): leave no lock behind
                _Lock(path, fd).release()
                raise
            return _Lock(path, fd)
        os.close(fd)


@dataclass
class Claim:
    """A checked, locked output; write it with `directory()` (a folder) or `write_text()` (a file)."""

    out: Path
    kind: str
    overwrite: bool
    created: list[Path] = field(default_factory=list)    # parent folders the claim made (removed if unused)

    @contextlib.contextmanager
    def directory(self) -> Iterator[Path]:
        """A temporary folder that becomes the output, with the marker listing what is in it, when the block
        finishes; on an exception nothing is left."""
        # an empty folder the user made for the output is replaced without --overwrite: it holds nothing to lose
        empty = self.out.is_dir() and not any(self.out.iterdir())
        with atomic_directory(self.out, overwrite=self.overwrite or empty, remove=remove_owned) as tmp:
            yield tmp
            write_marker(tmp, self.kind)

    def write_text(self, text: str) -> None:
        atomic_write_text(self.out, text)


def _make_parents(out: Path) -> list[Path]:
    """Create `out`'s missing parent folders (the lock file lives beside `out`); return those created."""
    missing = []
    parent = out.parent
    while not parent.exists():
        missing.append(parent)
        parent = parent.parent
    for folder in reversed(missing):
        folder.mkdir()
    return missing


@contextlib.contextmanager
def claim_output(out: str | os.PathLike, *, kind: str, given: Iterable[Input] = (), overwrite: bool = False,
                 file: bool = False, existing: str = "refuse", lock: bool = True) -> Iterator[Claim]:
    """Check `out` against the inputs and what exists there, lock it, and yield the claim; the lock is released
    when the block ends. `existing`: "refuse" (the default: an existing output needs --overwrite and must be
    upcycle's), or "continue" (a command that adds to its own output: resume, compare; it must be upcycle's own
    output of this kind, or absent, or empty). `lock`: False on the other processes of a distributed run, whose
    main process holds the lock."""
    out = Path(out).expanduser()
    check_claim(out, kind=kind, given=given, overwrite=overwrite, file=file, existing=existing)
    created = _make_parents(out) if lock else []
    try:
        held = acquire_lock(out) if lock else None
    except BaseException:
        _remove_empty(created)
        raise
    claim = Claim(out, kind, overwrite, created)
    try:
        yield claim
    finally:
        if held is not None:
            held.release()
        if not out.exists():
            _remove_empty(created)


def check_claim(out: str | os.PathLike, *, kind: str, given: Iterable[Input] = (), overwrite: bool = False,
                file: bool = False, existing: str = "refuse") -> None:
    """Every refusal `claim_output` makes before it touches anything: what a dry run says of its OUT, so it
    refuses what its run would refuse."""
    out = Path(out).expanduser()
    check_inputs(out, list(given))
    if existing == "continue":
        if out.is_symlink():
            raise UpcycleError(f"output {out} is a symbolic link; give the real location")
        if out.exists() and own_output(out) != "empty folder" and kind_of(out) != kind:
            raise UpcycleError(f"output {out} exists and is not an upcycle {kind} folder; choose a new output")
    else:
        check_replaceable(out, overwrite=overwrite, file=file, kind=kind)
    if file and not out.parent.is_dir():        # a file goes into a folder the user has; no folders are made
        raise UpcycleError(f"output {out}: {out.parent} is a file, not a folder" if out.parent.exists() else
                           f"output {out}: the folder {out.parent} does not exist")
    check_writable_output(out)


def _remove_empty(folders: list[Path]) -> None:
    for folder in folders:              # deepest first
        with contextlib.suppress(OSError):
            folder.rmdir()


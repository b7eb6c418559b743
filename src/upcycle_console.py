"""The `upcycle` console script (pyproject's entry point): Ctrl-C from its first moments ends with one line and
exit status 130, like Ctrl-C at any later point (`upcycle.cli.main`).

A top-level module, not part of the `upcycle` package, so that importing it runs no package `__init__` first: it
installs a SIGINT handler before anything of upcycle is imported. The command line's own modules (argparse among
them) take tens of milliseconds to import, and an interrupt there would end in a KeyboardInterrupt traceback.
Once `upcycle.cli` is imported, Python's own handler is back and `cli.main` turns the KeyboardInterrupt into its
message (and, during training, a checkpoint). What remains before this module runs is the interpreter's own
start-up.
"""

from __future__ import annotations

import os
import signal


def _interrupted_at_start(signum, frame) -> None:
    os.write(2, b"upcycle: interrupted; nothing was written\n")
    os._exit(130)           # nothing to clean up yet: no command has started


signal.signal(signal.SIGINT, _interrupted_at_start)


def main() -> int:
    from upcycle.cli import leaving
    from upcycle.cli import main as run

    signal.signal(signal.SIGINT, signal.default_int_handler)
    return leaving(run())

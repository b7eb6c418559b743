"""The `upcycle` command line: a dispatcher over the subcommands in `upcycle.commands`.

Exit status: 0 on success, 2 for bad input (one line on stderr, no traceback), 130 when interrupted (Ctrl-C at
any point from the console script's first line, `src/upcycle_console.py`, loading torch included), 143 on
SIGTERM (temporary outputs removed on the way out).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import signal
import sys
import warnings
from types import ModuleType

from .commands import COMMANDS
from .errors import UpcycleError

# Only the standard library is imported above: torch and transformers load inside `main`, with the command's
# module, where an interrupt while they load is a one-line message, not a traceback.


def command_module(name: str) -> ModuleType:
    """The module of subcommand `name` (`tiny-clip` -> upcycle.commands.tiny_clip)."""
    return importlib.import_module(f"upcycle.commands.{name.replace('-', '_')}")


def parser(argv: list[str] | None = None, *, every_command: bool = False) -> argparse.ArgumentParser:
    """The parser of `upcycle`. The arguments of a subcommand are added only for the command `argv` names (its
    module may load torch), or for every command with `every_command` (for tests and documentation)."""
    words = sys.argv[1:] if argv is None else argv
    chosen = next((w for w in words if not w.startswith("-")), None)
    root = argparse.ArgumentParser(prog="upcycle", description="Upcycle dense transformers into Mixture-of-Experts.")
    from .version import __version__

    root.add_argument("--version", action="version", version=f"upcycle {__version__}")
    sub = root.add_subparsers(dest="command", required=True)
    for name, help_line in COMMANDS.items():
        command = sub.add_parser(name, help=help_line, description=help_line)
        if every_command or name == chosen:
            command_module(name).add_arguments(command)
    return root


def main(argv: list[str] | None = None) -> int:
    """The `upcycle` command; returns the exit status."""
    # SIGTERM becomes SystemExit so the atomic writer removes its temporary folder on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    formatted, warnings.formatwarning = warnings.formatwarning, warning_line
    try:
        args = parser(argv).parse_args(argv)
        return command_module(args.command).run(args, argv)
    except UpcycleError as e:
        print(f"upcycle: error: {message(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:     # train says what OUT holds; elsewhere outputs are written atomically
        print(f"upcycle: interrupted; {str(e) or 'nothing was written'}", file=sys.stderr)
        return 130
    except BrokenPipeError:            # `upcycle methods | head`: the reader left; no traceback
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as e:
        # an interrupt landing in a class's __set_name__ while a module loads reaches us wrapped (Python 3.11)
        if isinstance(e, RuntimeError) and isinstance(e.__cause__, KeyboardInterrupt):
            print("upcycle: interrupted; nothing was written", file=sys.stderr)
            return 130
        from .files import no_room

        why = no_room(e)                # a full disk or a file-size limit: one line, not a traceback
        if why is None:
            raise
        print(f"upcycle: error: {why}. Outputs are built aside and moved into place only when complete, so "
              f"nothing of this one was kept and an earlier output is as it was (a training run keeps its last "
              f"finished checkpoint: --resume continues from it); free space or raise the limit and run it again",
              file=sys.stderr)
        return 2
    finally:
        warnings.formatwarning = formatted


def warning_line(message, category, filename, lineno, line=None) -> str:
    """A warning as one line for the person at the command line: its message (and its kind, when it is not a plain
    UserWarning), without Python's file name, line number and source line."""
    kind = "" if category is UserWarning else f" ({category.__name__})"
    return f"[upcycle] warning{kind}: {' '.join(str(message).split())}\n"


def leaving(status: int) -> int:
    """`status`, with every object alive now left out of the garbage collections of the interpreter's exit.

    For a process that is about to end (the console script, `python -m upcycle.cli`), not for `main` called from
    Python. At exit the interpreter runs full collections over everything torch and transformers created; with
    both imported that took 1.4 s of the 2-core CPU's time after a command had finished (0.7 s for torch alone).
    Frozen objects are still freed as their modules are torn down; only cycles among them are not collected, and
    the operating system takes back their memory a moment later. What upcycle writes is closed before this."""
    gc.freeze()
    return status


def message(error: Exception) -> str:
    """An error as one line of bounded length (a message quoting a huge value stays readable)."""
    text = " ".join(str(error).split())
    return text if len(text) <= 2000 else text[:2000] + f" ... ({len(text):,} characters)"


if __name__ == "__main__":
    sys.exit(leaving(main()))

"""A command's process ends once its command has: the objects alive at that point (torch's and transformers'
hundreds of thousands) are left out of the interpreter's final garbage collections, through both ways the command
line starts (the console script and `python -m upcycle.cli`), and never when `main` is called from Python."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_python(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_the_console_script_freezes_what_is_alive_and_keeps_the_status(tmp_path):
    code = ("import gc, sys, upcycle_console, upcycle.cli as cli\n"
            "cli.main = lambda: (print('frozen during the command:', gc.get_freeze_count()), 5)[1]\n"
            "status = upcycle_console.main()\n"
            "print('status', status, 'frozen after:', gc.get_freeze_count() > 1000)\n")
    done = run_python(["-c", code], tmp_path)
    assert done.stdout.splitlines() == ["frozen during the command: 0", "status 5 frozen after: True"], done


def test_python_m_upcycle_cli_leaves_the_same_way(tmp_path):
    code = ("import gc, runpy, sys\n"
            "import upcycle.cli as cli\n"
            "sys.argv = ['upcycle', 'methods']\n"
            "try:\n"
            "    runpy.run_module('upcycle.cli', run_name='__main__')\n"
            "except SystemExit as e:\n"
            "    print('exit', e.code, 'frozen:', gc.get_freeze_count() > 1000)\n")
    done = run_python(["-c", code], tmp_path)
    assert done.stdout.splitlines()[-1] == "exit 0 frozen: True", done


def test_main_called_from_python_freezes_nothing(capsys):
    import gc

    from upcycle.cli import main

    before = gc.get_freeze_count()
    assert main(["methods"]) == 0
    assert gc.get_freeze_count() == before


def test_the_tests_command_line_runs_from_src_with_no_console_script(tmp_path):
    """The suite starts `upcycle` through `conftest.upcycle_command`: with no console script installed (the project
    on PYTHONPATH alone, as on a bare GPU machine) that is the console module run by this Python, and it runs a
    command to its exit status (a refusal: 2, with upcycle's one-line message)."""
    from conftest import upcycle_command

    command = upcycle_command(tmp_path / "bin" / "upcycle")
    assert command[0] == sys.executable
    env = os.environ | {"PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([*command, "train", str(tmp_path / "missing"), str(tmp_path / "out"), "--steps", "1"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.startswith("upcycle: ") and "Traceback" not in done.stderr, done
    assert not (tmp_path / "out").exists()

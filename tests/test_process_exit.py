"""A command's process ends once its command has: the objects alive at that point (torch's and transformers'
hundreds of thousands) are left out of the interpreter's final garbage collections, through both ways the command
line starts (the console script and `python -m upcycle.cli`), and never when `main` is called from Python."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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

"""Ctrl-C ends every command with one line and exit status 130, from the console script's first line on (the
interpreter's own start-up before it is Python's), with a reason that is never blank."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from upcycle import cli

ROOT = Path(__file__).resolve().parents[2]


def run_python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter that imports from this checkout's src/."""
    env = os.environ | {"PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


def test_an_interrupt_while_the_command_line_is_still_importing_is_one_line_and_130(tmp_path):
    """The console script's module installs its handler before anything of upcycle is imported: an interrupt
    there (here raised at once, standing in for Ctrl-C during argparse's import) exits 130 with one line."""
    code = ("import os, signal, upcycle_console\n"
            "os.kill(os.getpid(), signal.SIGINT)\n"
            "import time; time.sleep(5)\n"
            "print('not interrupted')\n")
    done = run_python(code, tmp_path)
    assert done.returncode == 130, done
    assert done.stderr == "upcycle: interrupted; nothing was written\n" and "not interrupted" not in done.stdout


def test_the_console_script_hands_interrupts_back_to_the_command_line(tmp_path):
    """Once upcycle.cli is imported, Ctrl-C is a KeyboardInterrupt again, so that a command (training: its
    checkpoint) handles it; the console script is the pyproject entry point."""
    code = ("import signal, sys, upcycle_console\n"
            "sys.argv = ['upcycle', '--version']\n"
            "try:\n"
            "    upcycle_console.main()\n"
            "except SystemExit:\n"
            "    pass\n"
            "print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)\n")
    done = run_python(code, tmp_path)
    assert done.stdout.strip().splitlines()[-1] == "True", done
    assert 'upcycle = "upcycle_console:main"' in (ROOT / "pyproject.toml").read_text()


def test_an_interrupt_without_a_reason_still_says_what_happened(monkeypatch, capsys):
    class Command:
        @staticmethod
        def add_arguments(parser):
            pass

        @staticmethod
        def run(args, argv):
            raise KeyboardInterrupt()

    monkeypatch.setattr(cli, "command_module", lambda name: Command)
    assert cli.main(["methods"]) == 130
    assert capsys.readouterr().err == "upcycle: interrupted; nothing was written\n"


def test_an_interrupt_wrapped_while_a_module_loads_is_still_an_interrupt(monkeypatch, capsys):
    """Python 3.11 wraps an exception raised in a class's `__set_name__` (a KeyboardInterrupt landing while a
    module such as ipaddress loads) in RuntimeError; any other RuntimeError is not ours to hide."""
    def command(error):
        class Command:
            @staticmethod
            def add_arguments(parser):
                pass

            @staticmethod
            def run(args, argv):
                raise error
        return Command

    wrapped = RuntimeError("Error calling __set_name__")
    wrapped.__cause__ = KeyboardInterrupt()
    monkeypatch.setattr(cli, "command_module", lambda name: command(wrapped))
    assert cli.main(["methods"]) == 130
    assert capsys.readouterr().err == "upcycle: interrupted; nothing was written\n"
    monkeypatch.setattr(cli, "command_module", lambda name: command(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["methods"])


def test_ctrl_c_while_torch_loads_is_a_message_not_a_traceback(tmp_path):
    """The `upcycle` command imports torch and transformers inside `main`: an interrupt while they load (the
    first seconds of every command) exits 130 with one line."""
    import signal
    import subprocess

    code = ("import sys, upcycle.cli\nprint('ready', 'torch' in sys.modules, flush=True)\n"
            "sys.exit(upcycle.cli.main(['convert', 'default', '--dry-run']))\n")
    # started as a shell starts a command, Ctrl-C at its default: a library an earlier test loaded into this pytest
    # worker may leave SIGINT ignored, which a child inherits (it then finished the dry run with exit status 0)
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, cwd=tmp_path,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert process.stdout.readline().split() == ["ready", "False"]        # torch not loaded before main
    time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130, err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("upcycle: interrupted"), err

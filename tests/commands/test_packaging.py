"""What `pip install` of the project asks of the environment: a range of torch that leaves a GPU user's CUDA build
(or another package's pin) in place, never one exact release; and what a wheel of it carries beside the code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

tomllib = pytest.importorskip("tomllib", reason="reads pyproject.toml with Python 3.11's tomllib")
ROOT = Path(__file__).resolve().parents[2]


def requirement(name: str) -> Requirement:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found = [Requirement(r) for r in project["dependencies"] if Requirement(r).name == name]
    assert len(found) == 1, found
    return found[0]


def test_torch_is_a_range_that_keeps_the_torch_a_user_has():
    spec = requirement("torch").specifier
    assert not any(s.operator in ("==", "===", "~=") for s in spec), f"torch is pinned: {spec}"
    # CUDA builds as GPU machines carry them, vLLM's pin, this machine's CPU build, a future release
    for version in ("2.6.0", "2.11.0+cu130", "2.13.0+cpu", "2.14.0", "2.14.1+cu128", "3.0.0"):
        assert spec.contains(version, prereleases=True), version
    assert not spec.contains("2.5.1")          # transformers 5 needs torch 2.6


@pytest.mark.slow
def test_pip_install_keeps_the_installed_torch(tmp_path):
    """pip's own resolution of the project in this environment installs the project and nothing else: the torch
    already here satisfies the requirement and stays."""
    report = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-build-isolation",
                           "--quiet", "--report", str(report), str(ROOT)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    installs = [item["metadata"]["name"] for item in json.loads(report.read_text())["install"]]
    assert installs == ["upcycle"], installs


def test_the_wheel_carries_the_recipes_the_license_and_py_typed(tmp_path):
    """A wheel built from the project's files (copied, so the checkout gets no build/ folder) holds every packaged
    recipe byte for byte, `py.typed` and the Apache-2.0 LICENSE that its metadata names."""
    import shutil
    import zipfile

    source = tmp_path / "source"
    shutil.copytree(ROOT / "src" / "upcycle", source / "src" / "upcycle",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy2(ROOT / "src" / "upcycle_console.py", source / "src" / "upcycle_console.py")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, source / name)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "--quiet", str(source), "-w", str(tmp_path / "dist")], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("upcycle-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        recipes = sorted((ROOT / "src" / "upcycle" / "recipes").rglob("*.yaml"))
        assert len(recipes) >= 6
        for recipe in recipes:
            inside = recipe.relative_to(ROOT / "src").as_posix()
            assert archive.read(inside) == recipe.read_bytes(), inside
        assert "upcycle/py.typed" in names
        # the console script's entry, a top-level module (src/upcycle_console.py: Ctrl-C during start-up)
        assert archive.read("upcycle_console.py") == (ROOT / "src" / "upcycle_console.py").read_bytes()
        info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        assert archive.read(f"{info}/licenses/LICENSE") == (ROOT / "LICENSE").read_bytes()
        metadata = archive.read(f"{info}/METADATA").decode()
    assert "License-Expression: Apache-2.0" in metadata and "License-File: LICENSE" in metadata
    license_text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text[:200] and "Version 2.0, January 2004" in license_text[:200]
    assert "END OF TERMS AND CONDITIONS" in license_text          # the full text, not a one-line notice

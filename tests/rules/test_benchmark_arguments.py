"""Every benchmark's output paths (--out, --work, --json, --results) are argparse types that refuse, in argparse's
one line (exit 2) before any work, a path that cannot be written where it is given: a file given as a folder, a
folder given as a file, a file on the way (FILE/x.json), a link."""

from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from upcycle.scripts import output_file, output_folder

ROOT = Path(__file__).resolve().parents[2]

OUTPUT_FLAGS = ("--out", "--work", "--json", "--results")


def test_every_benchmark_output_flag_is_checked_by_its_type():
    unchecked = []
    for path in sorted((ROOT / "benchmarks").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument" and node.args \
                    and isinstance(node.args[0], ast.Constant) and node.args[0].value in OUTPUT_FLAGS:
                kind = next((k.value for k in node.keywords if k.arg == "type"), None)
                if not (isinstance(kind, ast.Name) and kind.id in ("output_file", "output_folder")):
                    unchecked.append(f"{path.name}:{node.lineno} {node.args[0].value}")
    assert unchecked == []


def test_output_paths_that_cannot_be_written_are_refused(tmp_path):
    (tmp_path / "FILE").write_text("mine\n")
    (tmp_path / "dir").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "dir")
    assert output_file(str(tmp_path / "dir" / "new" / "x.json")) == tmp_path / "dir" / "new" / "x.json"
    assert output_folder(str(tmp_path / "dir" / "new")) == tmp_path / "dir" / "new"
    for bad, said in ((tmp_path / "FILE" / "x.json", "FILE is a file, not a folder"),
                      (tmp_path / "dir", "is a folder"), (tmp_path / "link", "symbolic link")):
        with pytest.raises(argparse.ArgumentTypeError, match=said):
            output_file(str(bad))
    for bad, said in ((tmp_path / "FILE", "is a file; give a folder"),
                      (tmp_path / "FILE" / "sub", "FILE is a file, not a folder"),
                      (tmp_path / "link", "symbolic link")):
        with pytest.raises(argparse.ArgumentTypeError, match=said):
            output_folder(str(bad))
    assert (tmp_path / "FILE").read_text() == "mine\n" and not list((tmp_path / "dir").iterdir())


@pytest.mark.parametrize(("script", "args", "said"), [
    ("interop/runtimes_check.py", ["--work", "FILE"], "argument --work: FILE is a file; give a folder"),
    ("speed/moe_layer.py", ["--out", "FILE/x.json"], "argument --out: FILE/x.json cannot be written: FILE is a file"),
])
def test_a_benchmark_refuses_an_output_path_in_one_line(tmp_path, script, args, said):
    (tmp_path / "FILE").write_text("mine\n")
    env = os.environ | {"PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert said in done.stderr.strip().splitlines()[-1]
    assert (tmp_path / "FILE").read_text() == "mine\n" and sorted(p.name for p in tmp_path.iterdir()) == ["FILE"]


def _sys_path_edits(tree: ast.AST) -> list[int]:
    """Lines that change sys.path: sys.path.insert/append/extend calls, or an assignment to sys.path or a slice."""
    def is_sys_path(node) -> bool:
        target = node.value if isinstance(node, ast.Subscript) else node
        return (isinstance(target, ast.Attribute) and target.attr == "path" and isinstance(target.value, ast.Name)
                and target.value.id == "sys")
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and is_sys_path(node.func.value) \
                and node.func.attr in ("insert", "append", "extend"):
            found.append(node.lineno)
        if isinstance(node, ast.Assign) and any(is_sys_path(t) for t in node.targets):
            found.append(node.lineno)
    return found


def test_benchmarks_are_folders_by_kind_sharing_one_helper_module():
    """benchmarks/ holds a README and one folder per kind; no script edits sys.path (what they share is
    upcycle.scripts) or writes its own machine() (upcycle.machine's is the one)."""
    top = sorted(p.name for p in (ROOT / "benchmarks").iterdir() if p.name != "__pycache__")
    assert top == ["README.md", "gpu", "interop", "results", "speed", "studies"]
    found = []
    for path in sorted((ROOT / "benchmarks").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        found += [f"{path.relative_to(ROOT)}:{line} edits sys.path" for line in _sys_path_edits(tree)]
        found += [f"{path.relative_to(ROOT)}:{node.lineno} defines machine()" for node in ast.walk(tree)
                  if isinstance(node, ast.FunctionDef) and node.name == "machine"]
    assert found == []


def test_the_sys_path_finder_finds_each_form():
    tree = ast.parse("import sys\nsys.path.insert(0, 'x')\nsys.path[:0] = ['y']\nsys.path.append('z')\n"
                     "code = 'sys.path.insert(0, 1)'\n")
    assert sorted(_sys_path_edits(tree)) == [2, 3, 4]

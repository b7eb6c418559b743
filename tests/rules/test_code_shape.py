"""Rules on the code's shape ("plan, then execute"): each is a test so that it stays true.

- no function in src/ takes more than 8 parameters (a value object instead: an expert shape, a plan);
- upcycle.core holds one module-level mutable object, the routing context (what a layer reads besides `x`)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "upcycle"
MAX_PARAMETERS = 8
# module-level values that are not mutable state: constants and frozen sets/tuples, types, functions
IMMUTABLE_CALLS = {"frozenset", "tuple", "_ram", "re.compile", "compile", "TypeVar", "namedtuple"}


def parameters(node: ast.FunctionDef) -> int:
    a = node.args
    count = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
    return count - (1 if a.args and a.args[0].arg in ("self", "cls", "ctx") else 0)     # ctx: autograd's


def test_no_function_takes_more_than_eight_parameters():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and parameters(node) > MAX_PARAMETERS:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({parameters(node)})")
    assert found == []


def module_level_mutables(path: Path) -> list[str]:
    """Names bound at module level to a call's result or a mutable literal (dict, list, set), but not to an
    immutable value (frozenset, tuple, a compiled pattern, a number read once)."""
    found = []
    for node in ast.parse(path.read_text()).body:
        if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
            continue
        value = node.value
        mutable = isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)) or (
            isinstance(value, ast.Call) and ast.unparse(value.func) not in IMMUTABLE_CALLS)
        if mutable:
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            found.append(f"{path.name}:{node.lineno} {ast.unparse(target)}")
    return found


def test_core_holds_one_module_level_mutable_object_the_routing_context():
    found = [m for path in sorted((PACKAGE / "core").glob("*.py")) for m in module_level_mutables(path)]
    assert [m.split(" ")[1] for m in found] == ["ROUTING"], found


def test_the_mutable_finder_finds_them(tmp_path):
    (tmp_path / "m.py").write_text("A = {}\nB = frozenset({1})\nC = Thing()\nD: list = []\nE = (1, 2)\n")
    assert module_level_mutables(tmp_path / "m.py") == ["m.py:1 A", "m.py:3 C", "m.py:4 D"]


def test_a_conversion_reads_on_one_screen():
    """pipeline.py is the whole conversion in order (plan, claim, inputs, run, report, write): its steps live
    in the modules it calls, so it stays short; `convert` and `execute` each fit a screen."""
    path = PACKAGE / "conversion" / "pipeline.py"
    assert len(path.read_text().splitlines()) <= 120
    functions = {node.name: node for node in ast.parse(path.read_text()).body if isinstance(node, ast.FunctionDef)}
    for name in ("convert", "execute"):
        node = functions[name]
        assert node.end_lineno - node.lineno + 1 <= 30, name



def test_the_tests_are_grouped_by_what_they_check():
    """Each test file sits in its group's folder (conftest.GROUPS): rule tests apart from package tests, command
    tests and the benchmarks' own; the root holds only the shared helpers and the child processes tests start."""
    import conftest

    tests = PACKAGE.parents[1] / "tests"
    assert sorted(p.name for p in tests.glob("test_*.py")) == []
    assert sorted(p.name for p in tests.iterdir() if p.is_dir() and p.name != "__pycache__") == \
        sorted([*conftest.GROUPS, "fixtures"])
    for group in conftest.GROUPS:
        assert len(list((tests / group).glob("test_*.py"))) >= 3, group

"""The package's import graph has no cycles: every `import` and `from ... import` in src/upcycle,
at module level or inside a function, read with `ast` (nothing is imported to check it)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "upcycle"


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the package's modules it imports (`from . import x` counts as importing module x)."""
    modules = {module_name(p, package): p for p in package.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                base = here.split(".")[: len(here.split(".")) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                candidates = [target] + [f"{target}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            else:
                continue
            graph[name] |= {c for c in candidates if c in modules and c != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path [a, b, ..., a], or None (depth-first search with colours)."""
    colour = dict.fromkeys(graph, 0)       # 0 unseen, 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        colour[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if colour[nxt] == 1:
                return path[path.index(nxt):] + [nxt]
            if colour[nxt] == 0 and (cycle := visit(nxt)):
                return cycle
        colour[node] = 2
        path.pop()
        return None

    for start in sorted(graph):
        if colour[start] == 0 and (cycle := visit(start)):
            return cycle
    return None


def test_the_package_import_graph_is_acyclic():
    graph = import_graph()
    assert len(graph) > 30 and graph["upcycle.conversion.pipeline"]        # the walk found the package and its imports
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles(tmp_path):
    """A package with a -> b -> a (one import inside a function) is reported, so the check above can fail."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from .b import f\n")
    (package / "b.py").write_text("def f():\n    from . import a\n")
    (package / "c.py").write_text("from . import b\n")
    graph = import_graph(package)
    # `from . import x` imports the package itself first, so it is an edge to the package's __init__ too
    assert graph == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg", "pkg.a"}, "pkg.c": {"pkg", "pkg.b"}}
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.a"]


# The layering (docs/design.md): a module imports only its own sub-package and the layers below it. The leaves
# (config, files) know only the error type and the version; outputs (what a command may write and delete, proven by
# records it reads with files' bounded reader) is above them; core, data and figures (drawn from dicts)
# are independent of each other; methods, metrics and checkpoint I/O read core; the probe runs models, whole or a
# block at a time from a checkpoint, and compares their outputs; export (the stock classes) reads checkpoints and
# checks with the probe; conversion uses those; tasks (what a model trains and is evaluated on) read checkpoints
# and data; training runs the tasks' losses in its loop; analyze loads models and reads run folders (in the format
# `runs` names, never through the trainer's package); compare runs conversion, training (the trainer handed in by
# the command) and the metrics cell by cell; the commands and the CLI are on top.
LAYERS = {
    "upcycle.errors": 0, "upcycle.version": 0,
    "upcycle.config": 1, "upcycle.files": 1, "upcycle.progress": 1,
    "upcycle.outputs": 2,
    "upcycle.core": 3, "upcycle.data": 3, "upcycle.machine": 3, "upcycle.config_table": 3, "upcycle.figures": 3,
    "upcycle.config_reader": 3, "upcycle.runs": 3,
    "upcycle.methods": 4, "upcycle.metrics": 4, "upcycle.checkpoint": 4,
    "upcycle.probe": 5,
    "upcycle.export": 6,
    "upcycle.conversion": 7,
    "upcycle.tasks": 8, "upcycle.resize": 8,
    "upcycle.training": 9,
    "upcycle.analyze": 10,
    "upcycle.compare": 11,
    "upcycle.commands": 12,
    "upcycle.cli": 13, "upcycle": 13,
}


def layer_of(module: str) -> tuple[str, int]:
    """The sub-package (or leaf module) a module belongs to, and its layer."""
    for unit in (".".join(module.split(".")[:2]), module.split(".")[0]):
        if unit in LAYERS:
            return unit, LAYERS[unit]
    raise AssertionError(f"{module} is in no layer: add its sub-package to LAYERS")


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Edges that go up a layer, or sideways into another unit of the same layer."""
    bad = []
    for module, targets in graph.items():
        unit, layer = layer_of(module)
        for target in targets:
            other, other_layer = layer_of(target)
            if other != unit and other_layer >= layer:
                bad.append(f"{module} -> {target}")
    return sorted(bad)


def test_imports_only_go_down_the_layers():
    graph = import_graph()
    assert {layer_of(m)[0] for m in graph} == set(LAYERS)      # every unit exists and every module has a layer
    assert upward_imports(graph) == []


def test_an_upward_import_is_reported():
    graph = {"upcycle.core.moe": {"upcycle.training.loss.losses"},
             "upcycle.training.loss.losses": {"upcycle.core.router"},
             "upcycle.core.router": set(), "upcycle.data.text": {"upcycle.core.moe"}}
    assert upward_imports(graph) == ["upcycle.core.moe -> upcycle.training.loss.losses",
                                     "upcycle.data.text -> upcycle.core.moe"]


def test_the_public_names_resolve_in_a_fresh_interpreter():
    """Every name `upcycle` exports loads on first use, from its one home (a fresh interpreter, since this one has
    already imported the package)."""
    import subprocess
    import sys

    code = ("import upcycle\n"
            "for name in upcycle.__all__:\n"
            "    assert getattr(upcycle, name) is not None, name\n"
            "from upcycle.core.router import RoutingRecord\n"
            "assert upcycle.RoutingRecord is RoutingRecord\n"
            # training from Python beside converting: upcycle.train(cfg, out) as upcycle.convert(cfg, out)
            "from upcycle.training.trainer import train\n"
            "from upcycle.conversion.pipeline import convert\n"
            "assert upcycle.train is train and upcycle.convert is convert\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_tasks_and_training_are_two_packages():
    """What a model trains on (`tasks/`, which analyze and compare use too) and how the loop runs (`training/`)
    each have a package; no `train/` package remains, and the tasks do not import the training loop's modules."""
    assert (PACKAGE / "tasks" / "__init__.py").is_file() and (PACKAGE / "training" / "__init__.py").is_file()
    assert not (PACKAGE / "train").exists()
    graph = import_graph()
    assert not [f"{m} -> {t}" for m, targets in graph.items() if m.startswith("upcycle.tasks")
                for t in targets if t.startswith("upcycle.training")]


def _only_imports(tree: ast.Module) -> bool:
    """A module whose body is its docstring, imports and `__all__`: a second name for code that lives elsewhere."""
    body = [node for node in tree.body
            if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))
            and not (isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"])]
    return bool(body) and all(isinstance(node, (ast.Import, ast.ImportFrom)) for node in body)


def test_no_module_is_an_alias_and_nothing_is_re_exported():
    """Each name has one home: no module only re-exports others' names (a package's `__init__` may name its
    public entry points), and no import is kept alive only to be re-exported (`noqa: F401`)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        if path.name != "__init__.py" and _only_imports(ast.parse(text)):
            found.append(f"{path.relative_to(PACKAGE)} only re-exports names of other modules")
        found += [f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}"
                  for n, line in enumerate(text.splitlines(), 1) if "noqa: F401" in line]
    assert not found, "\n".join(found)


def test_an_alias_module_is_recognized():
    alias = ast.parse('"""Short names."""\nfrom .train.losses import z_loss\n__all__ = ["z_loss"]\n')
    real = ast.parse('"""Losses."""\nimport torch\n\ndef z_loss(x):\n    return x\n')
    assert _only_imports(alias) and not _only_imports(real)


def closure(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module `start` may import, directly or through others (imports inside functions included)."""
    seen, todo = set(), [start]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += graph[module]
    return seen


def test_upcycle_export_imports_no_conversion_and_no_method():
    """`upcycle export` writes what a conversion wrote: it needs the folder format, the stock layouts and the
    probe, never a method or the conversion machinery."""
    reached = closure(import_graph(), "upcycle.commands.export")
    assert "upcycle.export.from_folder" in reached and "upcycle.probe" in reached   # the walk follows the command
    assert sorted(m for m in reached if m.startswith(("upcycle.conversion", "upcycle.methods"))) == []


def test_the_closure_follows_imports_inside_functions(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from . import b\n")
    (package / "b.py").write_text("import pkg.c\n")
    (package / "c.py").write_text("")
    assert closure(import_graph(package), "pkg.a") == {"pkg.a", "pkg", "pkg.b", "pkg.c"}


def test_analyze_and_compare_read_runs_without_the_trainers_package():
    """A run folder's format is `upcycle.runs`; analyze and compare read runs through it and import nothing from
    `training/` (compare trains each cell with the trainer the command hands it)."""
    graph = import_graph()
    found = sorted(f"{m} -> {t}" for m, targets in graph.items() if m.startswith(("upcycle.analyze", "upcycle.compare"))
                   for t in targets if t.startswith("upcycle.training"))
    assert found == []


def test_tasks_are_made_through_their_registry_and_the_loop_asks_only_the_contract():
    """`make_task` holds no if-chain (a task is looked up in `TASKS` by the name its model's row gives), every task
    derives from `tasks.base.Task`, and the trainer asks nothing of a task with hasattr or getattr."""
    import ast

    from upcycle.config import TASKS as NAMES
    from upcycle.tasks.base import Task
    from upcycle.tasks.make import TASKS, task_class

    make = ast.parse((PACKAGE / "tasks" / "make.py").read_text())
    function = next(n for n in make.body if isinstance(n, ast.FunctionDef) and n.name == "make_task")
    assert not any(isinstance(n, ast.If) for n in ast.walk(function))
    assert set(TASKS) == set(NAMES) and all(issubclass(task_class(name), Task) for name in NAMES)
    assert all(task_class(name).name == name for name in NAMES)
    for path in (PACKAGE / "training").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("hasattr", "getattr") and \
                    node.args and "task" in ast.unparse(node.args[0]):
                raise AssertionError(f"{path.relative_to(PACKAGE)}:{node.lineno}: {ast.unparse(node)}")


def test_the_design_pages_layer_table_is_the_layering_checked_here():
    """docs/design.md's Layout table names each unit at the layer LAYERS gives it, and every unit once."""
    import re

    design = (PACKAGE.parents[1] / "docs" / "design.md").read_text()
    table = design[design.index("| Layer | Units |"):].split("\n\n")[0]
    documented = {}
    for row in table.splitlines()[2:]:
        layer, units = row.split("|")[1:3]
        for unit in re.findall(r"`([a-z_]+)`", units):
            documented[f"upcycle.{unit}"] = int(layer)
        if "package root" in units:
            documented["upcycle"] = int(layer)
    assert documented == LAYERS

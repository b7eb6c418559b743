"""One skeleton for every command, read from the code with `ast` (nothing here runs a command):

    a conversion reads its config in one place: at most three functions of conversion/ take the whole
    `ConvertConfig` (`plan.make_plan`, and the two entries that hand it on: `pipeline.convert` and
    `pipeline.upcycle_model`); everything after the plan takes the plan or its parts
    the plans hold no config object, so what a dry run prints is what the run reads
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from upcycle.conversion.plan import ConversionPlan
from upcycle.resize.compress import CompressPlan
from upcycle.resize.plan import ResizePlan

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "upcycle"
WHOLE_CONFIGS = ("ConvertConfig", "TrainConfig")


def functions_taking(folder: Path, names: tuple[str, ...] = WHOLE_CONFIGS) -> list[str]:
    """`file:function` for every function in `folder` with a parameter annotated as one of `names`, or called
    `cfg` (the whole config's name throughout the package)."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            a = node.args
            for arg in a.posonlyargs + a.args + a.kwonlyargs:
                annotation = ast.unparse(arg.annotation) if arg.annotation is not None else ""
                if arg.arg == "cfg" or any(name in annotation for name in names):
                    found.append(f"{path.relative_to(folder)}:{node.name}")
                    break
    return found


def test_a_conversion_reads_its_config_in_the_plan_alone():
    assert functions_taking(PACKAGE / "conversion") == [
        "pipeline.py:convert", "pipeline.py:upcycle_model", "plan.py:make_plan"]


def test_the_finder_sees_a_config_parameter(tmp_path):
    (tmp_path / "m.py").write_text("def a(cfg): ...\ndef b(x: 'ConvertConfig'): ...\ndef c(plan): ...\n"
                                   "class K:\n    def d(self, *, c: TrainConfig | None = None): ...\n")
    assert functions_taking(tmp_path) == ["m.py:a", "m.py:b", "m.py:d"]


def test_the_plans_hold_no_config_object():
    for plan in (ConversionPlan, ResizePlan, CompressPlan):
        types = {field.name: str(field.type) for field in dataclasses.fields(plan)}
        assert len(types) > 5 and not [name for name, t in types.items()
                                       if any(config in t for config in WHOLE_CONFIGS)], plan


def imported_units(folder: Path) -> set[str]:
    """The package's sub-packages `folder`'s modules import (at module level or inside a function)."""
    from test_import_graph import import_graph, layer_of

    graph = import_graph()
    prefix = "upcycle." + ".".join(folder.relative_to(PACKAGE).parts)
    return {layer_of(target)[0] for module, targets in graph.items() if module.startswith(prefix)
            for target in targets}


def test_resize_imports_nothing_of_the_conversion():
    """prune, grow and add-an-expert read calibration text (`data.model_inputs`) and compare a fine-tune with a base
    (`checkpoint.differences`) through the layers below both, never through conversion/'s internals."""
    units = imported_units(PACKAGE / "resize")
    assert "upcycle.checkpoint" in units and "upcycle.data" in units        # the walk saw its imports
    assert "upcycle.conversion" not in units


def callers_of(name: str) -> list[str]:
    """The package's modules that call `name(...)` or `<anything>.name(...)` (a comment or docstring does not)."""
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == name:
                found.add(path.relative_to(PACKAGE).as_posix())
    return sorted(found)


def test_an_moe_layer_is_built_from_weights_in_one_module():
    assert callers_of("from_init") == ["core/layer_build.py"]
    assert callers_of("layer_from_weights") == ["conversion/upcycle_layer.py", "core/layer_build.py",
                                                "core/stock_moe.py"]
    assert callers_of("layer_like") == ["core/resize.py"]


def test_forward_hooks_are_let_go_by_one_helper():
    """Every object that owns hooks takes them off with `core.hooks.HookHolder.remove`, written once."""
    defined = [f"{path.relative_to(PACKAGE).as_posix()}" for path in sorted(PACKAGE.rglob("*.py"))
               for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.FunctionDef)
               and node.name == "remove"]
    assert defined == ["core/hooks.py"]


PLANNING = {"convert": "conversion/pipeline.py", "train": "training/trainer.py", "prune": "resize/run.py",
            "grow": "resize/run.py", "compress": "resize/compress.py", "compare": "compare/study.py",
            "analyze": "analyze/run.py"}


def test_one_runner_claims_every_planned_commands_output():
    """convert, train, prune/grow, compress, compare and analyze run their plan through `outputs.job.run_job`
    (check, claim OUT, execute); none of their packages claims an output another way."""
    assert sorted(set(PLANNING.values())) == [m for m in callers_of("run_job") if not m.startswith("outputs/")]
    for package in ("conversion", "training", "resize", "compare", "analyze"):
        claiming = [m for m in callers_of("claim_output") if m.startswith(package + "/")]
        assert claiming == [], package
    assert callers_of("claim_output") == sorted(set(callers_of("claim_output")))    # the walk returns modules


def test_every_command_with_a_plan_takes_dry_run():
    from upcycle.cli import parser

    commands = parser(every_command=True)._subparsers._group_actions[0].choices
    for name in PLANNING:
        flags = {flag for action in commands[name]._actions for flag in action.option_strings}
        assert "--dry-run" in flags, name
    assert "--plan" in {f for a in commands["train"]._actions for f in a.option_strings}     # the older name stays


def names_used(name: str) -> list[str]:
    """Modules that name `name` (a call, or a function handed on), imports aside."""
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Name) and node.id == name:
                found.add(path.relative_to(PACKAGE).as_posix())
    return sorted(found)


def test_one_function_assembles_a_training_run_for_the_run_and_its_memory_plan():
    """The freezer, the objective, AdamW and its schedule are made in `training/parts.py` alone; the trainer hands
    `assemble` to the parallel layer, and the memory plan calls it on its fake model, so the two cannot drift."""
    for made in ("Freezer", "Objective", "make_optimizer", "make_scheduler"):
        assert callers_of(made) == ["training/parts.py"], made
    # the memory plan calls it; the trainer hands it to the parallel layer, which calls it on its layout
    assert names_used("assemble") == ["training/memory/plan.py", "training/parallel/accelerator.py",
                                      "training/trainer.py"]
    from test_import_graph import import_graph

    parallel = {target for module, targets in import_graph().items()
                if module.startswith("upcycle.training.parallel") for target in targets}
    assert "upcycle.training.parallel.sharding" in parallel          # the walk saw the layer's imports
    assert not {m for m in parallel if m.startswith(("upcycle.training.freezing", "upcycle.training.loss",
                                                     "upcycle.training.optimizer", "upcycle.training.schedule",
                                                     "upcycle.training.parts"))}


def test_a_models_task_asks_its_family_once(monkeypatch):
    """tasks/kind.py decides a model's task with one lookup of its architecture row."""
    from conftest import make_tiny
    from upcycle.tasks import kind

    asked = []
    real = kind.find_family
    monkeypatch.setattr(kind, "find_family", lambda config: asked.append(config) or real(config))
    for family, task in (("llama", "causal_lm"), ("bert", "contrastive"), ("clip", "clip")):
        asked.clear()
        assert kind.model_task(make_tiny(family)) == task and len(asked) == 1, family

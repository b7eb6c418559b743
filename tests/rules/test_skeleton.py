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
    for plan in (ConversionPlan, ResizePlan):
        types = {field.name: str(field.type) for field in dataclasses.fields(plan)}
        assert len(types) > 5 and not [name for name, t in types.items()
                                       if any(config in t for config in WHOLE_CONFIGS)], plan

"""One function runs every conversion: a new block source is one class, and the probe, the timings and the record
of a conversion are made in one place (conversion/orchestrator.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from conftest import make_tiny
from upcycle.config import ConvertConfig, PlacementConfig
from upcycle.conversion.blockwise import MethodLayers, method_groups
from upcycle.conversion.inputs import ConversionInputs
from upcycle.conversion.layer_check import layer_probe
from upcycle.conversion.orchestrator import BlockSource, run_conversion
from upcycle.conversion.plan import make_plan
from upcycle.conversion.report import conversion_report
from upcycle.core.moe import moe_layers
from upcycle.methods import get_method

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "upcycle"
CONVERSION = PACKAGE / "conversion"
COPY = ConversionInputs(get_method("copy"), {}, promised=True)      # copy with seeded random probe ids


class InstalledAsBuilt(BlockSource):
    """A fourth block source, written as a user would: a model in memory whose layers are installed the moment
    each is built (the in-memory source waits for all); the dense outputs, their rounding noise and the check
    are the defaults of a model held whole."""

    def __init__(self, model: torch.nn.Module, cfg: ConvertConfig) -> None:
        self.model, self.compute_dtype = model, torch.float32
        self.plan = make_plan(cfg, writing=False, model=model)

    def replay_groups(self, probe):
        return method_groups(self.plan.calibration.tokens, self.plan.seed, [layer_probe(probe.inputs)], None)

    def layer_builder(self):
        return MethodLayers(self.model, self.family, self.plan, COPY)

    def after_block(self, visit, block, layer) -> None:
        if layer is not None:
            self.family.install(block, layer)


def test_a_fourth_block_source_is_one_class():
    model = make_tiny("llama", layers=4).eval()
    cfg = ConvertConfig(model="tiny", method="copy", placement=PlacementConfig(every=2))
    source = InstalledAsBuilt(model, cfg)
    done = run_conversion(source, COPY, progress=False)
    assert sorted(moe_layers(model)) == ["model.layers.1.mlp", "model.layers.3.mlp"]   # installed, in place
    assert done.moe_layers == ["text.1", "text.3"] and [layer.name for layer in done.layers] == done.moe_layers
    assert done.after["total"] > done.before["total"] == done.before["active_per_token"]
    # copy reproduces the dense model; the record carries the measurement, the probe and every phase's time
    assert done.measured["max_abs_logit_diff"] < 1e-4 and done.noise is not None and done.probe is not None
    assert all(layer.check.passed for layer in done.layers)
    assert done.timings.upcycle > 0 and done.timings.check > 0
    report = conversion_report(source.plan, done)
    assert report.preservation.passed and report.model_class == "LlamaForCausalLM"


def test_a_failing_source_is_told_to_let_go():
    aborted = []

    class Failing(InstalledAsBuilt):
        def layer_builder(self):
            def fail(*args):
                raise RuntimeError("no layer")
            return fail

        def abort(self) -> None:
            aborted.append(True)

    cfg = ConvertConfig(model="tiny", method="copy")
    try:
        run_conversion(Failing(make_tiny("llama", layers=2).eval(), cfg), COPY, progress=False)
    except RuntimeError as e:
        assert str(e) == "no layer"
    assert aborted == [True]


def _calls(name: str) -> list[str]:
    """The conversion modules that call `name` (read with ast: a comment or a docstring does not count)."""
    found = []
    for path in sorted(CONVERSION.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == name:
                found.append(path.name)
    return found


def test_the_probe_the_timings_and_the_record_are_made_in_one_place():
    for name in ("make_probe", "Timings", "Converted", "convert_blocks"):
        assert _calls(name) == ["orchestrator.py"], name
    # every phase is timed by the record's own `Timings.phase`; the load, before the record exists, by its caller
    assert sorted(set(_calls("perf_counter"))) == ["merge.py", "pipeline.py", "report.py", "routes.py"]
    assert _calls("perf_counter").count("report.py") == 2


def test_one_function_builds_every_conversions_moe_layer():
    """A method's conversion and a merge build their layers through `upcycle_layer`, the conversion's one caller
    of `core.layer_build` (where every MoE layer built from weights is made); each route is chosen from the plan in
    one table."""
    assert _calls("from_init") == [] and _calls("layer_from_weights") == ["upcycle_layer.py"]
    assert sorted(_calls("upcycle_layer")) == ["blockwise.py", "merge_layers.py"]
    assert _calls("make_plan") == ["pipeline.py", "pipeline.py"]      # convert and upcycle_model


def _parameters(node: ast.FunctionDef) -> int:
    a = node.args
    named = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
    return len(named) + (a.vararg is not None) + (a.kwarg is not None)


def test_every_public_conversion_function_takes_at_most_six_parameters():
    """A conversion's inputs travel as one value (`inputs.ConversionInputs`), not as a dozen loose arguments:
    every public function and constructor of conversion/ takes six parameters or fewer."""
    found = {}
    for path in sorted(CONVERSION.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and (not node.name.startswith("_") or node.name == "__init__"):
                found[f"{path.name}:{node.name}:{node.lineno}"] = _parameters(node)
    assert found["orchestrator.py:run_conversion:" + str(next(
        n.lineno for n in ast.walk(ast.parse((CONVERSION / "orchestrator.py").read_text()))
        if isinstance(n, ast.FunctionDef) and n.name == "run_conversion"))] == 4       # the walk saw it
    assert {name: n for name, n in found.items() if n > 6} == {}


def test_a_missing_calibration_is_refused_in_one_place():
    """Whichever path converts, the refusal of a data-aware method without calibration data is made where the
    inputs are made, and nowhere else."""
    assert _calls("require_calibration") == ["inputs.py"]
    try:
        ConversionInputs(get_method("cluster"), {}, promised=False, calibration=[])
    except Exception as e:       # noqa: BLE001  (the type is checked below)
        assert type(e).__name__ == "UpcycleError" and "needs calibration data" in str(e)
    else:
        raise AssertionError("a data-aware method without calibration was accepted")
    # a merge's experts calibrate on their own source's text, checked by validate
    assert ConversionInputs(get_method("cluster"), {}, promised=False, per_source=True).calibration is None


def test_the_reports_export_entry_has_one_builder():
    """No literal dict with a "format" of "upcycle" or "hf" is built anywhere in the package but
    `export.protocol.export_entry` (the report's `export` entry; the checkpoint's own format record aside)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Dict):
                entries = {k.value: v for k, v in zip(node.keys, node.values, strict=True)
                           if isinstance(k, ast.Constant)}
                value = entries.get("format")
                if (isinstance(value, ast.Constant) and value.value in ("upcycle", "hf")
                        and "format_version" not in entries):
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    builder = PACKAGE / "export" / "protocol.py"
    assert sorted(found) == sorted(f"export/protocol.py:{_line(builder, text)}"
                                   for text in ('{"format": "upcycle"', '{"format": "hf"'))


def _line(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)

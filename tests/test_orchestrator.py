"""One function runs every conversion: a new block source is one class, and the probe, the timings and the record
of a conversion are made in one place (conversion/orchestrator.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from conftest import make_tiny
from upcycle.config import ConvertConfig, PlacementConfig
from upcycle.conversion.blockwise import MethodLayers, method_groups
from upcycle.conversion.layer_check import layer_probe
from upcycle.conversion.orchestrator import BlockSource, run_conversion
from upcycle.conversion.report import conversion_report
from upcycle.core.moe import moe_layers
from upcycle.methods import get_method

CONVERSION = Path(__file__).resolve().parents[1] / "src" / "upcycle" / "conversion"


class InstalledAsBuilt(BlockSource):
    """A fourth block source, written as a user would: a model in memory whose layers are installed the moment
    each is built (the in-memory source waits for all); the dense outputs, their rounding noise and the check
    are the defaults of a model held whole."""

    def __init__(self, model: torch.nn.Module, cfg: ConvertConfig) -> None:
        self.model, self.cfg, self.compute_dtype = model, cfg, torch.float32

    def replay_groups(self, probe):
        return method_groups(self.cfg, [layer_probe(probe.inputs)], None)

    def layer_builder(self):
        return MethodLayers(self.model, self.family, get_method("copy"), {}, self.cfg, True)

    def after_block(self, visit, block, layer) -> None:
        if layer is not None:
            self.family.install(block, layer)


def test_a_fourth_block_source_is_one_class():
    model = make_tiny("llama", layers=4).eval()
    cfg = ConvertConfig(model="tiny", method="copy", placement=PlacementConfig(every=2))
    done = run_conversion(InstalledAsBuilt(model, cfg), cfg, promised=True, progress=False)
    assert sorted(moe_layers(model)) == ["model.layers.1.mlp", "model.layers.3.mlp"]   # installed, in place
    assert done.moe_layers == ["text.1", "text.3"] and [layer.name for layer in done.layers] == done.moe_layers
    assert done.after["total"] > done.before["total"] == done.before["active_per_token"]
    # copy reproduces the dense model; the record carries the measurement, the probe and every phase's time
    assert done.measured["max_abs_logit_diff"] < 1e-4 and done.noise is not None and done.probe is not None
    assert all(layer.check.passed for layer in done.layers)
    assert done.timings.upcycle > 0 and done.timings.check > 0
    report = conversion_report(cfg, get_method("copy"), {}, done)
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
        run_conversion(Failing(make_tiny("llama", layers=2).eval(), cfg), cfg, promised=True, progress=False)
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

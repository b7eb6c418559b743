"""The conversion report is typed (`upcycle.conversion.report`) and written as the JSON it was before the
typing: the same keys in the same order and the same values as reports recorded before the change
(tests/fixtures/reports_before, README there)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from conftest import write_tiny_lm
from upcycle import ConvertConfig, MoEConfig, convert
from upcycle.config import CalibrationConfig, CheckConfig
from upcycle.conversion.report import ConversionReport

BEFORE = Path(__file__).parents[1] / "fixtures" / "reports_before"
CASES = {
    "copy": lambda text: dict(method="copy"),
    "granular": lambda text: dict(method="granular", method_args={"granularity": 2}),
    "drop_calibrated": lambda text: dict(method="drop", calibration=CalibrationConfig(
        data=str(text), tokens=256, sequence_length=16, batch_size=4)),
}
# Values a forward pass computes may differ in their last bits on another CPU (another summation order in the
# matmul kernels). Those of size >= 1e-4 are compared to 1% (a routing flip of one of the 256 calibration tokens
# moves a load by 1/512, < 1% of the ~0.25 loads); smaller ones are rounding noise itself (float32 logits of
# size ~0.5 differ by ~1e-7 between summation orders), only required to stay below 1e-4.
NOISE = 1e-4


# Keys added to the report since those fixtures: whether the conversion streamed, whether the end-to-end check ran, each
# layer's own check against the dense FFN, the files a streaming export wrote, and how the experts are stored (the MoE
# config's experts, delta_rank, train_base). Everything else is as before.
ADDED = {"streamed", "end_to_end", "max_abs_diff", "relative_diff", "probe_tokens", "allowed_max_abs_diff",
         "layer_rounding_noise", "passed", "files", "experts", "delta_rank", "train_base"}


def same(expected, actual, where: str) -> None:
    """Same keys in the same order (apart from ADDED), same types, same values (floats: as above); timings:
    keys only."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict), where
        actual = {k: v for k, v in actual.items() if k in expected or k not in ADDED}
        assert list(actual) == list(expected), f"{where}: {list(actual)}"
        for key in expected:
            if key != "timings_s":
                same(expected[key], actual[key], f"{where}.{key}")
    elif isinstance(expected, list):
        assert isinstance(actual, list) and len(actual) == len(expected), where
        for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
            same(e, a, f"{where}[{i}]")
    elif isinstance(expected, float):
        assert type(actual) is float, where
        if abs(expected) >= NOISE:
            assert math.isclose(actual, expected, rel_tol=1e-2), (where, actual, expected)
        else:
            assert abs(actual) < NOISE, (where, actual, expected)
    else:
        assert type(actual) is type(expected) and actual == expected, (where, actual, expected)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("reports")
    dense, text, held = write_tiny_lm(root / "src")
    out = {}
    for name, options in CASES.items():
        cfg = ConvertConfig(model=str(dense), moe=MoEConfig(num_experts=4, top_k=2), check=CheckConfig(text=str(held)),
                            **options(text))
        result = convert(cfg, root / name, progress=False)
        out[name] = (result.report, json.loads((root / name / "upcycle_report.json").read_text()), root)
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_the_report_is_written_as_before(converted, name):
    report, written, root = converted[name]
    expected = json.loads((BEFORE / f"{name}.json").read_text().replace("ROOT", str(root)))
    same(expected, written, name)
    assert list(written["timings_s"]) == list(expected["timings_s"])
    assert written["streamed"] is True and all("max_abs_diff" in layer for layer in written["layers"])
    assert isinstance(report, ConversionReport) and report.to_dict() == written


def test_the_typed_report_holds_what_the_json_says(converted):
    """Attributes are the typed form; the allowance's parts relate as the preservation check defines them, so a
    value written under another key's name would show here."""
    copy, granular, drop = (converted[name][0] for name in CASES)
    p = copy.preservation
    assert p.promised and p.passed is True and copy.max_abs_logit_diff <= p.allowance.allowed_max_abs_logit_diff
    a = p.allowance
    assert a.calibrated_tolerance == a.noise_factor * a.rounding_noise
    assert a.allowed_max_abs_logit_diff == max(a.calibrated_tolerance, a.ulp_floor, a.user_tolerance)
    assert p.relative_logit_diff == pytest.approx(copy.max_abs_logit_diff / a.output_scale, rel=1e-12)
    assert copy.parameters.after.total > copy.parameters.before.total == copy.parameters.before.active_per_token
    assert copy.timings.load is not None and copy.timings.write is not None
    assert granular.folded_scales() == [{"layer": layer.name, "scale": 2.0} for layer in granular.layers]
    assert drop.preservation.passed is None and drop.preservation.allowance is None
    assert all(layer.calibration.tokens_kept == 256 and sum(layer.calibration.routing.router_load) == 1.0
               for layer in drop.layers)
    assert drop.calibration.budget_per_layer == 256 and copy.calibration is None

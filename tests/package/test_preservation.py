"""The preservation check's tolerance is calibrated on the dense model itself (upcycle.conversion.preservation): it
passes the rounding of every dtype and fails a real break, and `upcycle.load` keeps the dtype a model was saved in."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

import upcycle
from conftest import make_tiny
from upcycle import methods as registry
from upcycle.config import CheckConfig, ConvertConfig
from upcycle.config_reader import build
from upcycle.conversion.pipeline import PreservationError, convert, upcycle_model
from upcycle.conversion.preservation import FLOOR_ULPS, ReorderedFFN, rounding_noise
from upcycle.core.ffn import FFNWeights
from upcycle.core.surgery import plan_targets, tower_cfg
from upcycle.probe import make_probe, probe_output


def cfg(model="x", **data) -> ConvertConfig:
    return build(ConvertConfig, {"model": str(model), "moe": {"num_experts": 4, "top_k": 2}, "check": {"tokens": 16},
                                 **data})


def break_layer(monkeypatch, scale: float, rows=(0, 0), layer: int = 0) -> None:
    """`copy` with `w_down[rows]` (default: row 0 of expert 0) scaled by `scale` in the `layer`-th converted layer."""
    copy = registry.METHODS["copy"]
    calls = []

    def broken(ffn, inputs, args):
        init = copy.fn(ffn, inputs, args)
        if len(calls) == layer:
            w_down = init.experts.w_down.clone()
            w_down[rows] *= scale
            init = replace(init, experts=replace(init.experts, w_down=w_down))
        calls.append(1)
        return init

    monkeypatch.setitem(registry.METHODS, "copy", registry.Method(**{**copy.__dict__, "fn": broken}))


def test_reordered_ffn_is_the_dense_ffn():
    g = torch.Generator().manual_seed(0)
    ffn = FFNWeights(w_up=torch.randn(64, 32, generator=g, dtype=torch.float64),
                     w_gate=torch.randn(64, 32, generator=g, dtype=torch.float64),
                     w_down=torch.randn(32, 64, generator=g, dtype=torch.float64), activation="silu")
    x = torch.randn(5, 32, generator=g, dtype=torch.float64)
    dense = (torch.nn.functional.silu(x @ ffn.w_gate.T) * (x @ ffn.w_up.T)) @ ffn.w_down.T
    torch.testing.assert_close(ReorderedFFN(ffn)(x), dense, rtol=1e-12, atol=1e-12)   # float64: same function


@pytest.mark.parametrize("width", [512, 768, 1536])
def test_the_reordered_sum_is_not_the_kernels_own_order(width):
    """Widths a matrix product sums in blocks (512, 768) split at the middle gave a reordered FFN equal to the
    dense one to the bit on x86-64 (a + b = b + a): noise 0, and a copy conversion of a random Qwen3 of width 768
    refused for 10 ulps of logit rounding. Split one past the middle, the two orders differ in rounding while
    computing the same function."""
    g = torch.Generator().manual_seed(0)
    D = 256
    ffn = FFNWeights(w_up=torch.randn(width, D, generator=g) * 0.1, w_gate=torch.randn(width, D, generator=g) * 0.1,
                     w_down=torch.randn(D, width, generator=g) * 0.1, activation="silu")
    x = torch.randn(512, D, generator=g)
    noise = (ReorderedFFN(ffn)(x) - ffn(x)).abs().max().item()
    assert 0 < noise < 1e-4 * ffn(x).abs().max().item()


def test_rounding_noise_leaves_the_model_exactly_as_it_was(family):
    model = make_tiny(family)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    modules = [type(m).__name__ for m in model.modules()]
    probe = make_probe(model, None, None, CheckConfig(tokens=16), seed=0)
    dense = probe_output(model, probe)
    from upcycle.core.architectures import family_of
    fam = family_of(model.config)
    blocks = [(model.get_submodule(t.path), tower_cfg(model, fam, t)) for t in plan_targets(model, cfg().placement)]
    noise = rounding_noise(model, probe, dense, blocks, fam)
    # float32 rounding of a 4-block model with logits of order 1: at most a few hundred ulps, not a function change
    assert 0 <= noise < 1e-5
    assert [type(m).__name__ for m in model.modules()] == modules
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(probe_output(model, probe).values_NC, dense.values_NC)


def test_report_states_the_tolerance_and_its_parts():
    p = upcycle_model(make_tiny("llama"), cfg(), progress=False).to_dict()["preservation"]
    assert p["passed"] and p["promised"]
    assert p["allowed_max_abs_logit_diff"] == max(p["calibrated_tolerance"], p["ulp_floor"], p["user_tolerance"])
    assert p["calibrated_tolerance"] == p["noise_factor"] * p["rounding_noise"] and p["noise_factor"] == 16
    assert p["ulp_floor"] == pytest.approx(FLOOR_ULPS * torch.finfo(torch.float32).eps * p["output_scale"])
    assert p["user_tolerance"] == 0 and p["tolerance"] == 0 and p["relative_tolerance"] == 0
    # a method that does not promise preservation pays for no calibration and reports no tolerance
    p = upcycle_model(make_tiny("llama"), cfg(method="drop"), progress=False).to_dict()["preservation"]
    assert p["passed"] is None and "allowed_max_abs_logit_diff" not in p


def tiny_with_working_ffns() -> torch.nn.Module:
    """A tiny Llama whose FFN weights are x3: at the random init (std 0.02) the FFN outputs are negligible next
    to the embeddings, so a broken expert could hardly show; in a trained model the FFNs carry the function."""
    model = make_tiny("llama")
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if ".mlp." in name:
                weight.mul_(3)
    return model


def test_one_expert_row_scaled_by_1_001_is_refused(tmp_path, monkeypatch):
    tiny_with_working_ffns().save_pretrained(tmp_path / "m")
    break_layer(monkeypatch, 1.001)
    with pytest.raises(PreservationError, match="refusing to write") as err:
        convert(cfg(tmp_path / "m", method="copy"), tmp_path / "out", progress=False)
    p = err.value.report.to_dict()["preservation"]
    # the allowance is 16 x the float32 rounding of four blocks (~3e-6 here); a 1e-3 change of one output
    # coordinate of one expert changes the logits by 15-37x that for any of the rows measured in the first block
    # (the row used: 22x); 5x leaves room for other CPUs' kernels
    assert err.value.report.to_dict()["max_abs_logit_diff"] > 5 * p["allowed_max_abs_logit_diff"]
    assert not (tmp_path / "out").exists()
    # the user can still accept it explicitly
    result = convert(cfg(tmp_path / "m", method="copy", check={"tokens": 16, "tolerance": 1.0}), tmp_path / "out",
                     progress=False)
    assert result.report.to_dict()["preservation"]["passed"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_conversion_passes_in_its_own_dtype_and_loads_in_it(dtype, tmp_path):
    """In memory the model computes in its dtype (streaming computes in float32: tests/commands/test_streaming.py)."""
    make_tiny("llama").save_pretrained(tmp_path / "m")
    result = convert(cfg(tmp_path / "m", method="copy", dtype=dtype, streaming=False), tmp_path / "out",
                     progress=False)
    p = result.report.to_dict()["preservation"]
    assert p["passed"] and result.report.to_dict()["dtype"] == dtype
    # the allowance follows the dtype: bf16/fp16 rounding (eps 7.8e-3 / 9.8e-4) is far above float32's
    fp32 = upcycle_model(make_tiny("llama"), cfg(), progress=False).to_dict()["preservation"]
    assert p["allowed_max_abs_logit_diff"] > 100 * fp32["allowed_max_abs_logit_diff"]
    loaded = upcycle.load(tmp_path / "out")
    assert loaded.dtype == getattr(torch, dtype)
    layer = next(m for m in loaded.modules() if isinstance(m, upcycle.MoELayer))
    assert layer.experts.w_down.dtype == getattr(torch, dtype) and layer.router.weight.dtype == torch.float32
    probe = make_probe(loaded, None, None, CheckConfig(tokens=16), seed=1)
    # compared on the device the conversion ran on (a GPU with --device auto): the same kernels, the same bits
    loaded.to(next(result.model.parameters()).device)
    assert torch.equal(probe_output(loaded, probe).values_NC, probe_output(result.model, probe).values_NC)
    assert upcycle.load(tmp_path / "out", dtype=torch.float32).dtype == torch.float32
    saved = json.loads((tmp_path / "out" / "upcycle_report.json").read_text())
    assert saved["preservation"]["rounding_noise"] == p["rounding_noise"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_still_refuses_a_wrong_scale(dtype, tmp_path, monkeypatch):
    """bf16 cannot even represent a 1.001 scale of most weights, and its check is as coarse as its rounding; a
    forgotten fold (every expert of one layer x2, as granular's scale) is a real break and is refused: measured
    about 4x (bf16) and 30x (fp16) the allowance, while the unbroken copy stays 15-17x below it."""
    tiny_with_working_ffns().save_pretrained(tmp_path / "m")
    break_layer(monkeypatch, 2.0, rows=(slice(None),))
    with pytest.raises(PreservationError):
        convert(cfg(tmp_path / "m", method="copy", dtype=dtype), tmp_path / "out", progress=False)


@pytest.mark.parametrize(("check", "message"), [
    ({"noise_factor": 0.0}, r"check.noise_factor must be a finite number in \(0, inf\), got 0.0"),
    ({"noise_factor": float("nan")}, r"check.noise_factor must be a finite number in \(0, inf\), got nan"),
    ({"tolerance": -1.0}, r"check.tolerance must be a finite number in \[0, inf\), got -1.0"),
    ({"relative_tolerance": -1e-5}, r"check.relative_tolerance must be a finite number in \[0, inf\), got -1e-05")])
def test_meaningless_check_settings_are_refused(check, message):
    from upcycle.errors import UpcycleError

    with pytest.raises(UpcycleError, match=message):      # when the config is made, before any model is touched
        cfg(check={"tokens": 16, **check})

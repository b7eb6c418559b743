"""One conversion pipeline: every way of reading the blocks (a model in memory, a checkpoint streamed block by
block, several fine-tunes merged) is validated once and reports through the same function, as a
`ConversionReport`; a stock export class is one module and one registry line."""

from __future__ import annotations

import importlib.util
import json
import textwrap

import pytest
import torch
import transformers

from conftest import fine_tune, write_tiny_lm
from upcycle import ConvertConfig, MoEConfig
from upcycle.config import CheckConfig, ExpertSource, PlacementConfig, SourcesConfig
from upcycle.conversion import pipeline, plan, report
from upcycle.conversion.report import ConversionReport
from upcycle.export.registry import STOCK_CLASSES


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return write_tiny_lm(tmp_path_factory.mktemp("pipeline"))


def _configs(lm, tmp_path) -> dict[str, tuple[ConvertConfig, object]]:
    dense, _, held = lm
    base = dict(model=str(dense), moe=MoEConfig(num_experts=2, top_k=1), placement=PlacementConfig(every=2),
                check=CheckConfig(text=str(held)))
    sources = tuple(ExpertSource(model=str(fine_tune(dense, tmp_path / f"ft{i}", seed=i)), data=str(held))
                    for i in range(2))
    return {"in memory, no output": (ConvertConfig(**base), None),
            "in memory": (ConvertConfig(**base, streaming=False), tmp_path / "memory"),
            "streaming": (ConvertConfig(**base, streaming=True), tmp_path / "streamed"),
            "merge": (ConvertConfig(**base, sources=SourcesConfig(experts=sources)), tmp_path / "merged")}


def test_every_conversion_is_validated_once_and_reports_through_one_function(lm, tmp_path, monkeypatch):
    validations, reports = [], []
    resolve_method, conversion_report = plan.resolve_method, report.conversion_report

    def counted_validate(*args, **kwargs):
        validations.append(args[0])
        return resolve_method(*args, **kwargs)

    def counted_report(*args, **kwargs):
        made = conversion_report(*args, **kwargs)
        reports.append(made)
        return made

    monkeypatch.setattr(plan, "resolve_method", counted_validate)   # where every conversion's plan validates it
    monkeypatch.setattr(report, "conversion_report", counted_report)
    for how, (cfg, out) in _configs(lm, tmp_path).items():
        validations.clear()
        reports.clear()
        result = pipeline.convert(cfg, out, progress=False)
        assert len(validations) == 1, how
        assert reports == [result.report] and isinstance(result.report, ConversionReport), how
        assert result.report.streamed == (how in ("streaming", "merge")), how
        if out is not None:          # the written report is the returned one
            assert json.loads((out / "upcycle_report.json").read_text()) == json.loads(
                json.dumps(result.report.to_dict()))
    merged = result.report
    assert merged.method == "sources (copy)" and merged.preservation.promised is False
    assert merged.sources["expert_source"] == [0, 1] and set(merged.router_source_agreement) == {"0:" + str(
        tmp_path / "ft0"), "1:" + str(tmp_path / "ft1")}


def test_a_report_is_typed_not_a_mapping():
    assert not hasattr(ConversionReport, "__getitem__") and not hasattr(ConversionReport, "keys")


CLASS_MODULE = '''
"""Mixtral written from Mistral decoders only (a test's export class)."""

from dataclasses import dataclass

from upcycle.export.mixtral import Mixtral


@dataclass(frozen=True)
class MistralMixtral(Mixtral):
    def config_keys(self, model, moe_blocks, source) -> dict:
        return {**super().config_keys(model, moe_blocks, source), "router_jitter_noise": 0.0}


CLASS = MistralMixtral("mistral_mixtral", "MixtralForCausalLM", "MixtralConfig", sources=("llama",),
                       expert_keys=("w1", "w3", "w2"), every_block=True, always_renormalizes=True,
                       model_type="mixtral")
'''


@pytest.mark.parametrize("streaming", [False, True])
def test_a_new_stock_class_is_one_module_and_one_registry_line(lm, tmp_path, monkeypatch, streaming):
    module_file = tmp_path / "mistral_mixtral.py"
    module_file.write_text(textwrap.dedent(CLASS_MODULE))
    spec = importlib.util.spec_from_file_location("mistral_mixtral", module_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(STOCK_CLASSES, module.CLASS.name, module.CLASS)        # the registry line

    from upcycle.cli import main

    dense, _, held = lm
    out = tmp_path / "out"
    assert main(["convert", str(dense), str(out), "--num-experts", "2", "--top-k", "1", "--every", "1",
                 "--export", "hf", "--export-class", "mistral_mixtral", "--probe-text", str(held), "--quiet",
                 "--set", f"streaming={'true' if streaming else 'false'}"]) == 0
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == "mixtral" and written["architectures"] == ["MixtralForCausalLM"]
    stock = transformers.AutoModelForCausalLM.from_pretrained(out)
    dense_model = transformers.AutoModelForCausalLM.from_pretrained(dense)
    ids = torch.randint(3, dense_model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():        # copy upcycling with renormalized top-1: the stock model computes the dense one
        torch.testing.assert_close(stock(ids).logits, dense_model(ids).logits, rtol=0, atol=1e-4)
    exported = json.loads((out / "upcycle_report.json").read_text())["export"]
    assert exported["class"] == "MixtralForCausalLM" and exported["model_type"] == "mixtral"

"""`conversion.plan.make_plan`: a conversion decided as one value before any weight loads; the dry run prints the
plan the real run carries out, and every refusal that needs no weight comes before OUT is claimed."""

from __future__ import annotations

import json

import pytest
import transformers

from conftest import make_tiny
from upcycle.checkpoint.reader import CheckpointReader
from upcycle.cli import main
from upcycle.config import ConvertConfig
from upcycle.config_reader import build
from upcycle.conversion.pipeline import convert
from upcycle.conversion.plan import IN_MEMORY, MERGED, STREAMED, make_plan
from upcycle.errors import UpcycleError
from upcycle.outputs import job

SUMMARY = ("method", "method_args", "promised", "dtype", "route", "model_type", "moe_layers", "num_experts", "top_k",
           "export", "export_class", "why_not_export_class")


def cfg(model, **data) -> ConvertConfig:
    return build(ConvertConfig, {"model": str(model), "moe": {"num_experts": 4, "top_k": 2}, "check": {"tokens": 16},
                                 **data})


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plan") / "dense"
    make_tiny("llama").save_pretrained(folder)
    return folder


CASES = {  # flags -> (config keys, the route taken)
    "streamed": ([], {}, STREAMED),
    "stock class in memory": (["--export", "hf"], {"export": "hf"}, IN_MEMORY),
    "streaming off": (["--set", "streaming=false"], {"streaming": False}, IN_MEMORY),
    "every other block, drop": (["--export", "hf", "--every", "2", "--method", "drop"],
                                {"export": "hf", "placement": {"every": 2}, "method": "drop"}, IN_MEMORY),
    "stock class streamed": (["--export", "hf", "--set", "streaming=true"], {"export": "hf", "streaming": True},
                             STREAMED),
}


@pytest.mark.parametrize("case", CASES)
def test_the_dry_run_prints_the_plan_the_conversion_carries_out(dense, tmp_path, capsys, case):
    flags, keys, route = CASES[case]
    assert main(["convert", str(dense), "--dry-run", "--num-experts", "4", "--top-k", "2", *flags]) == 0
    out = capsys.readouterr().out
    printed = json.loads(out[out.index("\n{") + 1:])
    assert f"route: {route}" in out
    done = convert(cfg(dense, **keys), tmp_path / "out", progress=False)
    assert done.plan.summary() == {k: printed[k] for k in SUMMARY}
    assert done.plan.route == route
    # what was written is what the plan said: the class, and the route (a streamed export says so)
    written = done.report.to_dict()["export"]
    assert written.get("class") == (done.plan.stock.architecture if done.plan.stock is not None else None)
    assert bool(written.get("streamed")) == (route == STREAMED)


def test_a_conversion_without_out_plans_in_memory_and_writes_no_stock_class(dense):
    plan = make_plan(cfg(dense, export="hf"), writing=False)
    assert plan.route == IN_MEMORY and plan.stock is None and plan.stream is None
    assert plan.dtype == "float32" and [t.path for t in plan.targets] == [f"model.layers.{i}" for i in range(4)]


def _never(*_args, **_kwargs):
    raise AssertionError("OUT was claimed or a weight was read before the refusal")


REFUSALS = {
    "a class that cannot hold the model": ({"export": "hf", "export_class": "mixtral", "placement": {"every": 2}},
                                           "every block"),
    "a missing model": ({"model": "not/a-local-folder"}, "could not load model 'not/a-local-folder'"),
    "a merge source of other sizes": (
        {"moe": {"num_experts": 2, "top_k": 1},
         "sources": {"router": "random", "experts": [{"model": "{dense}"}, {"model": "{narrow}"}]}},
        "intermediate_size: base 64, source 48"),
    "an argument out of its range": ({"method": "drop", "method_args": {"ratio": 2.0}}, r"ratio.*\[0, 1\]"),
    "a merge method that changes the expert shape": (
        {"method": "granular", "moe": {"num_experts": 2, "top_k": 1},
         "sources": {"router": "random", "experts": [{"model": "{dense}"}, {"model": "{dense}"}]}},
        "makes experts of another shape"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_weight_free_refusals_come_before_out_is_claimed(dense, tmp_path, monkeypatch, case):
    keys, message = REFUSALS[case]
    narrow = dense.parent / "narrow"
    if not narrow.exists():
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**make_tiny("llama").config.to_dict(),
                                                                   "intermediate_size": 48})).save_pretrained(narrow)
    text = json.dumps(keys).replace("{dense}", str(dense)).replace("{narrow}", str(narrow))
    keys = {"model": str(dense), **json.loads(text)}
    monkeypatch.setattr(job, "claim_output", _never)        # the runner claims OUT for every command
    monkeypatch.setattr(CheckpointReader, "get", _never)
    with pytest.raises(UpcycleError, match=message):
        convert(cfg(**keys), tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_a_merge_is_planned_with_its_sources_opened(dense):
    merge = cfg(dense, moe={"num_experts": 2, "top_k": 1},
                sources={"router": "random", "experts": [{"model": str(dense)}, {"model": str(dense)}]})
    plan = make_plan(merge)
    assert plan.route == MERGED and plan.promised is False and len(plan.opened[1]) == 2
    with pytest.raises(UpcycleError, match="give OUT"):
        make_plan(merge, writing=False)

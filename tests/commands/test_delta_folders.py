"""Delta experts end to end (`moe.experts: delta`): a copy conversion stored as the dense FFN plus zero deltas
computes the dense model and passes the preservation check; the saved layer comes back as delta experts with its
rank; a folder with nonzero deltas (noise) exports to stock classes that load without upcycle and give
`upcycle.load`'s logits; a frozen base (`moe.train_base: false`) stays bit-identical through training and holds
no optimizer state; the methods, merges, ranks and commands that cannot hold delta experts are refused, by the run
and its dry run alike, before anything is written."""

from __future__ import annotations

import json
import re

import pytest
import torch
import transformers as T
from safetensors.torch import load_file

import upcycle
from conftest import fails, make_tiny
from upcycle.cli import main
from upcycle.config import ConvertConfig
from upcycle.config_reader import build
from upcycle.conversion.pipeline import convert
from upcycle.core.delta_experts import DeltaExperts
from upcycle.core.moe import moe_layers
from upcycle.metrics.experts import similarity_and_diversity

IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))


def cfg(model, **data) -> ConvertConfig:
    base = {"model": str(model), "moe": {"num_experts": 4, "top_k": 2, "experts": "delta", "delta_rank": 4},
            "check": {"tokens": 16}}
    return build(ConvertConfig, {**base, **data, "moe": {**base["moe"], **data.get("moe", {})}})


@pytest.mark.parametrize("kind", ["llama", "gpt2"])          # a gated FFN; a plain one with biases
def test_a_copy_as_delta_experts_is_the_dense_model_and_loads_back_compact(kind, tmp_path):
    dense = make_tiny(kind)
    dense.save_pretrained(tmp_path / "dense")
    result = convert(cfg(tmp_path / "dense"), tmp_path / "out", progress=False)
    report = result.report.to_dict()
    assert report["preservation"]["promised"] and report["preservation"]["passed"]
    full = convert(cfg(tmp_path / "dense", moe={"experts": "full"}), progress=False).report.to_dict()
    assert report["parameters"]["after"]["total"] < full["parameters"]["after"]["total"]
    loaded = upcycle.load(tmp_path / "out")
    layers = moe_layers(loaded)
    assert layers and all(isinstance(layer.experts, DeltaExperts) and layer.experts.rank == 4
                          for layer in layers.values())
    assert all(not layer.experts.down_a.any() for layer in layers.values())     # a copy: zero deltas
    with torch.no_grad():
        ours, want = loaded(input_ids=IDS).logits, dense(input_ids=IDS).logits
    # float32 rounding of the top-2 weights' sum (w1 + w2 = 1 up to an ulp) and of the reordered additions
    assert (ours - want).abs().max() <= 1e-5 * want.abs().max()
    assert sum(p.numel() for p in loaded.parameters()) == report["parameters"]["after"]["total"]


@pytest.mark.parametrize("kind, export_class, every", [("llama", "qwen2_moe", 2), ("llama", "mixtral", 1),
                                                      ("qwen3", "qwen3_moe", 2)])
def test_a_delta_folder_exports_full_experts_with_its_logits(kind, export_class, every, tmp_path):
    make_tiny(kind).save_pretrained(tmp_path / "dense")
    convert(cfg(tmp_path / "dense", method="noise", placement={"every": every}), tmp_path / "moe", progress=False)
    ours = upcycle.load(tmp_path / "moe")
    assert any(layer.experts.down_a.abs().sum() > 0 for layer in moe_layers(ours).values())    # real deltas
    assert main(["export", str(tmp_path / "moe"), str(tmp_path / "hf"), "--export-class", export_class]) == 0
    stock, info = T.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(info.values()), info
    with torch.no_grad():
        diff = (stock.eval()(input_ids=IDS).logits - ours.eval()(input_ids=IDS).logits).abs().max().item()
    assert diff <= 1e-5
    written = load_file(tmp_path / "hf" / "model.safetensors")
    assert not any("base_" in name or name.endswith("_a") for name in written)     # full experts, no factors


def test_a_frozen_base_stays_bit_identical_through_training_and_gets_no_optimizer_state(lm, tmp_path):
    from conftest import train_config
    from upcycle.training.parts import assemble

    dense, _, train, held = lm
    moe = tmp_path / "moe"
    convert(cfg(dense, moe={"train_base": False}, check={"tokens": 16, "text": str(held)}), moe, progress=False)
    model = upcycle.load(moe)
    parts = assemble(model, train_config(moe, train, held))
    optimized = {id(p) for group in parts.optimizer.param_groups for p in group["params"]}
    bases = [p for layer in moe_layers(model).values() for p in layer.experts.base_parameters()]
    assert bases and not any(id(p) in optimized or p.requires_grad for p in bases)
    run = tmp_path / "run"
    assert main(["train", str(moe), str(run), "--data", str(train), "--eval-data", str(held), "--steps", "3",
                 "--batch-size", "4", "--sequence-length", "32", "--quiet", "--set", "eval_tokens=64",
                 "--set", "lr=1e-2"]) == 0
    before, after = load_file(moe / "model.safetensors"), load_file(run / "model" / "model.safetensors")
    names = [n for n in before if ".experts." in n]
    assert any(n.split(".")[-1].startswith("base_") for n in names)
    for name in names:
        moved = not torch.equal(before[name], after[name])
        if name.split(".")[-1].startswith("base_"):
            assert not moved, name
        elif name.endswith("_a"):       # A starts at zero: training moves it
            assert moved, name


def test_the_analysis_reads_delta_experts_as_the_experts_they_make(lm, tmp_path):
    dense, _, _, held = lm
    moe = tmp_path / "moe"
    convert(cfg(dense, method="noise", check={"tokens": 16, "text": str(held)}), moe, progress=False)
    assert main(["analyze", str(moe), str(tmp_path / "analysis"), "--data", str(held), "--quiet"]) == 0
    last = json.loads((tmp_path / "analysis" / "analysis.json").read_text())["snapshots"][-1]
    assert len(last["layers"]) == 4
    # noise's deltas part the experts: similar, not equal
    assert all(0 < layer["diversity"] and layer["weight_similarity"]["all"]["mean"] < 1
               for layer in last["layers"].values())


@pytest.mark.parametrize("method", ["cluster", "spri", "granular"])
def test_methods_whose_experts_are_no_base_plus_a_change_are_refused_run_and_dry_run_alike(method, tiny_llama,
                                                                                           tmp_path, capsys):
    args = ["--method", method, "--set", "moe.experts=delta", "--set", "moe.num_experts=4",
            "--set", "moe.top_k=2"]
    if method == "granular":
        args += ["--set", "method_args.granularity=2"]
    message = "cannot be stored as delta experts"
    fails(capsys, ["convert", str(tiny_llama), str(tmp_path / "out"), *args], message)
    fails(capsys, ["convert", str(tiny_llama), str(tmp_path / "out"), "--dry-run", *args], message)
    assert not (tmp_path / "out").exists()


def test_a_rank_beyond_the_matrices_is_refused_and_the_dry_run_shows_the_saving(tiny_llama, tmp_path, capsys):
    out = tmp_path / "out"
    for extra in ([], ["--dry-run"]):
        fails(capsys, ["convert", str(tiny_llama), str(out), "--set", "moe.experts=delta",
                       "--set", "moe.delta_rank=33", *extra], "moe.delta_rank must be at most")
    assert not out.exists()
    assert main(["convert", str(tiny_llama), str(out), "--dry-run", "--set", "moe.experts=delta",
                 "--set", "moe.delta_rank=2"]) == 0
    text = capsys.readouterr().out
    ours = int(re.search(r"parameters: [\d,]+ -> ([\d,]+) total", text).group(1).replace(",", ""))
    full = int(re.search(r"as full experts \(moe.experts: full\): ([\d,]+) total", text).group(1).replace(",", ""))
    # per layer 4 x 3 x 2 x (32 + 64) factors and one base FFN, against 8 full FFNs of 3 x 32 x 64
    assert full - ours == 4 * (8 * 3 * 32 * 64 - (3 * 32 * 64 + 8 * 3 * 2 * (32 + 64)))
    assert not out.exists()


@pytest.mark.parametrize("argv", [["prune", "--num-experts", "2"], ["grow", "--num-experts", "6"],
                                  ["grow", "--add", "FINETUNE", "--calibration", "TEXT"]])
def test_prune_grow_and_add_refuse_delta_folders_with_the_reason(argv, tiny_llama, tmp_path, capsys):
    moe = tmp_path / "moe"
    convert(cfg(tiny_llama), moe, progress=False)
    (tmp_path / "text.txt").write_text("some text to route by\n")
    verb, *rest = [{"FINETUNE": str(tiny_llama), "TEXT": str(tmp_path / "text.txt")}.get(a, a) for a in argv]
    for extra in ([], ["--dry-run"]):
        fails(capsys, [verb, str(moe), str(tmp_path / "out"), *rest, *extra], "holds delta experts")
    assert not (tmp_path / "out").exists()


def test_every_method_that_declares_deltas_converts_to_them_and_the_listing_says_which(tiny_llama, capsys):
    """The registry's declaration (`register(no_deltas=...)`) is what the conversion does: each method declared
    as the dense FFN plus a change converts to delta experts (the share of each change kept in its report), each
    other is refused; `upcycle methods` lists the same."""
    from upcycle.methods import METHODS

    assert main(["methods"]) == 0
    listing = capsys.readouterr().out
    for name, method in METHODS.items():
        shown = listing.split(f"{name}: ", 1)[1].split("as delta experts (moe.experts: delta): ", 1)[1]
        assert shown.startswith("yes" if method.no_deltas is None else "no"), name
        if method.no_deltas is not None or method.needs_calibration:
            continue
        result = convert(cfg(tiny_llama, method=name), progress=False)
        assert all(isinstance(layer.experts, DeltaExperts) for layer in moe_layers(result.model).values())
        entries = result.report.to_dict()["layers"]
        assert entries and all(0 <= v <= 1 for e in entries for v in e["delta_energy_kept"].values()), name
        # the report's similarity is that of the experts the layers hold (the method's cut to the rank)
        held = [similarity_and_diversity(layer.experts.weights()) for layer in moe_layers(result.model).values()]
        assert [(e["expert_similarity"], e["diversity"]) for e in entries] == held, name

"""`upcycle prune` and `upcycle grow` on an upcycle folder, end to end: the new folder loads with its new expert
count, its report says what was removed or copied and the KL to the source; pruning to E changes no logit; every
impossible request is refused before OUT is claimed."""

from __future__ import annotations

import json

import pytest
import torch

import upcycle
from upcycle.cli import main
from upcycle.core.moe import moe_layers


def _flags(train) -> list[str]:
    return ["--calibration", str(train), "--calibration-tokens", "256", "--quiet"]


def _logits(folder, ids):
    model = upcycle.load(str(folder)).eval()
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits


def test_prune_writes_a_folder_with_fewer_experts_and_says_what_went(tiny_lm, tmp_path):
    _, moe, train, _ = tiny_lm
    out = tmp_path / "pruned"
    assert main(["prune", str(moe), str(out), "--num-experts", "3", *_flags(train)]) == 0
    report = json.loads((out / "resize_report.json").read_text())
    model = upcycle.load(str(out))
    layers = moe_layers(model)
    assert layers and all(layer.num_experts == 3 and layer.top_k == 2 for layer in layers.values())
    assert set(report["layers"]) == set(layers)
    assert all(len(r["removed"]) == 1 and len(r["saliency"]) == 4 for r in report["layers"].values())
    assert report["kind"] == "prune" and report["request"]["by"] == "reap" and report["function_preserving"] is False
    assert report["kl_to_source"] is not None and report["kl_to_source"] >= 0
    assert report["calibration"]["tokens"] >= 256


def test_pruning_to_every_expert_writes_the_same_function(tiny_lm, tmp_path):
    _, moe, train, _ = tiny_lm
    out = tmp_path / "same"
    assert main(["prune", str(moe), str(out), "--num-experts", "4", "--by", "frequency", *_flags(train)]) == 0
    ids = torch.randint(3, 60, (2, 12), generator=torch.Generator().manual_seed(0))
    assert torch.equal(_logits(out, ids), _logits(moe, ids))
    report = json.loads((out / "resize_report.json").read_text())
    assert report["function_preserving"] is True and report["kl_to_source"] == pytest.approx(0, abs=1e-9)


def test_grow_adds_copies_and_says_it_is_not_function_preserving(tiny_lm, tmp_path):
    _, moe, train, _ = tiny_lm
    out = tmp_path / "grown"
    assert main(["grow", str(moe), str(out), "--num-experts", "6", "--by", "utility", *_flags(train)]) == 0
    report = json.loads((out / "resize_report.json").read_text())
    assert all(layer.num_experts == 6 for layer in moe_layers(upcycle.load(str(out))).values())
    assert all(len(r["copied"]) == 2 and len(set(r["copied"])) == 2 for r in report["layers"].values())
    assert report["kind"] == "grow" and report["function_preserving"] is False


@pytest.mark.parametrize(("command", "n", "said"), [
    ("prune", "1", "keeps at least 2 experts"), ("prune", "5", "use grow"), ("grow", "3", "use prune")])
def test_an_impossible_count_is_refused_before_out_is_claimed(tiny_lm, tmp_path, capsys, command, n, said):
    _, moe, train, _ = tiny_lm
    out = tmp_path / "out"
    assert main([command, str(moe), str(out), "--num-experts", n, *_flags(train)]) == 2
    assert said in capsys.readouterr().err and not out.exists()


def test_a_dense_model_is_refused_before_out_is_claimed(tiny_lm, tmp_path, capsys):
    dense, _, train, _ = tiny_lm
    assert main(["prune", str(dense), str(tmp_path / "out"), "--num-experts", "2", *_flags(train)]) == 2
    assert "is not an upcycle folder" in capsys.readouterr().err and not (tmp_path / "out").exists()

"""One-line messages that say what is wrong and what works: sizes in TB and
bare bytes, the training plan's gradients row and its CPU note, activation
checkpointing of a stock MoE class, a special token id that is no id, an eval output under a file, and a
prune that removes only exact copies called function-preserving."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from conftest import fails
from upcycle.checkpoint.writer import parse_size
from upcycle.cli import main
from upcycle.errors import UpcycleError


def test_sizes_take_terabytes_and_bare_bytes_and_refuse_what_is_no_size():
    assert parse_size("100TB") == 10**14 and parse_size("2TiB") == 2 * 2**40 and parse_size("512") == 512
    for bad in ("0", "-1", "abc", "1XB", 0):
        with pytest.raises(UpcycleError, match="a size is a number of bytes above 0"):
            parse_size(bad)


def test_a_shard_size_that_is_no_size_is_refused_both_ways_and_bare_bytes_are_taken(tiny_lm, tmp_path, capsys):
    dense, _, _, _ = tiny_lm
    for dry in ([], ["--dry-run"]):
        fails(capsys, ["convert", str(dense), str(tmp_path / "out"), "--shard-size", "0", *dry],
              "a size is a number of bytes above 0")
    assert not (tmp_path / "out").exists()
    assert main(["convert", str(dense), "--shard-size", "100000", "--dry-run"]) == 0     # bare bytes, as they say


def test_the_training_plan_prints_its_gradients_and_says_the_cpu_process_comes_on_top(tiny_lm, tmp_path, capsys):
    _, moe, train, _ = tiny_lm
    assert main(["train", str(moe), str(tmp_path / "run"), "--data", str(train), "--plan",
                 "--memory-budget", "100TB"]) == 0
    said = capsys.readouterr().out
    row = next(line for line in said.splitlines() if line.strip().startswith("gradients"))
    assert "all of them" in row
    assert "the process itself, torch and transformers imported, takes about 600.0 MB more" in said
    assert "of 100,000.00 GB: fits" in said


def test_moe_checkpointing_of_a_stock_mixtral_says_its_blocks_are_its_own(tiny_lm, tmp_path, capsys):
    _, moe, train, _ = tiny_lm
    stock = tmp_path / "stock"
    assert main(["export", str(moe), str(stock), "--export-class", "mixtral"]) == 0
    fails(capsys, ["train", str(stock), str(tmp_path / "run"), "--data", str(train), "--steps", "1",
                   "--activation-checkpointing", "moe"], "its sparse blocks are MixtralForCausalLM's own")


def test_a_special_token_id_below_minus_one_is_refused(tiny_lm, tmp_path, capsys):
    dense, _, _, _ = tiny_lm
    bad = tmp_path / "dense"
    shutil.copytree(dense, bad)
    config = json.loads((bad / "config.json").read_text())
    config["pad_token_id"] = -5
    (bad / "config.json").write_text(json.dumps(config))
    for dry in ([], ["--dry-run"]):
        fails(capsys, ["convert", str(bad), str(tmp_path / "out"), *dry],
              "config.json's pad_token_id is -5; it is a token id")


def test_an_eval_output_under_a_file_says_it_is_a_file(tiny_lm, tmp_path, capsys):
    _, moe, _, _ = tiny_lm
    (tmp_path / "afile").write_text("x")
    fails(capsys, ["eval", str(moe), "--out", str(tmp_path / "afile" / "ev.json")], "is a file, not a folder")


def test_pruning_only_exact_copies_is_reported_function_preserving(tiny_lm, tmp_path):
    """A folder grown with copies that share their source's probability (an earlier grow's -log 2), pruned back:
    the copies go, the kept experts take back their share, the KL is rounding, and the report says the prune kept
    the function."""
    import upcycle
    from upcycle.core.moe import moe_layers
    from upcycle.core.resize import duplicate_experts
    from upcycle.resize.expert_count import replace_layer

    _, moe, train, _ = tiny_lm
    model = upcycle.load(str(moe))
    for name, layer in moe_layers(model).items():
        grown = duplicate_experts(layer, [0, 1, 2, 3])
        grown.router.bias = torch.nn.Parameter(torch.full((8,), -math.log(2)))
        replace_layer(model, name, grown)
    upcycle.save(model, tmp_path / "grown")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (moe / name).is_file():
            shutil.copy(moe / name, tmp_path / "grown" / name)
    assert main(["prune", str(tmp_path / "grown"), str(tmp_path / "out"), "--num-experts", "4", "--calibration",
                 str(train), "--calibration-tokens", "128", "--quiet"]) == 0
    report = json.loads((tmp_path / "out" / "resize_report.json").read_text())
    assert report["function_preserving"] is True and report["kl_to_source"] < 1e-9
    assert all(layer["removed"] == [4, 5, 6, 7] for layer in report["layers"].values())

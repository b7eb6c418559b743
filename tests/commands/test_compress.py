"""`upcycle compress`: a full-expert folder as delta experts (the experts' mean plus rank-R changes). At full rank it
computes what the source does; below it, it keeps the SVD's share of each expert's difference, says so per layer,
and writes fewer bytes; the folder it writes loads as delta experts. What it cannot compress is refused, by the run
and its dry run alike, before OUT exists."""

from __future__ import annotations

import json

import pytest
import torch

import upcycle
from conftest import fails
from upcycle.cli import main
from upcycle.config import CheckConfig, ConvertConfig, MoEConfig
from upcycle.conversion.pipeline import convert
from upcycle.core.delta_experts import DeltaExperts
from upcycle.core.moe import moe_layers

IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.fixture
def noisy(lm, tmp_path):
    """The tiny Llama upcycled to 4 full experts by `noise` (experts that differ), with its tokenizer."""
    dense, _, _, held = lm
    out = tmp_path / "noisy"
    convert(ConvertConfig(model=str(dense), method="noise", moe=MoEConfig(num_experts=4, top_k=2),
                          check=CheckConfig(text=str(held))), out, progress=False)
    return out


def logits(folder) -> torch.Tensor:
    with torch.no_grad():
        return upcycle.load(folder).eval()(input_ids=IDS).logits


def test_full_rank_reproduces_the_source_and_a_low_rank_keeps_the_svds_share(noisy, tmp_path):
    full_rank = min(32, 64)            # the tiny Llama: D 32, F 64
    assert main(["compress", str(noisy), str(tmp_path / "exact"), "--rank", str(full_rank), "--quiet"]) == 0
    want = logits(noisy)
    assert (logits(tmp_path / "exact") - want).abs().max() <= 1e-5 * want.abs().max()
    report = json.loads((tmp_path / "exact" / "compress_report.json").read_text())
    assert all(kept["min"] >= 1 - 1e-6 for layer in report["layers"].values()
               for kept in layer["energy_kept"].values())
    assert report["max_abs_logit_diff"] <= 1e-5 * want.abs().max()

    assert main(["compress", str(noisy), str(tmp_path / "r2"), "--rank", "2", "--quiet"]) == 0
    low = json.loads((tmp_path / "r2" / "compress_report.json").read_text())
    kept = [k["mean"] for layer in low["layers"].values() for k in layer["energy_kept"].values()]
    assert all(0 < k < 1 for k in kept)            # noise is no rank-2 change: part of it is lost, and said
    assert low["kl_to_source"] > report["kl_to_source"] and low["max_abs_logit_diff"] > 0
    assert low["weight_bytes"]["after"] < low["weight_bytes"]["before"]
    loaded = upcycle.load(tmp_path / "r2")
    assert all(isinstance(layer.experts, DeltaExperts) and layer.experts.rank == 2
               for layer in moe_layers(loaded).values())
    assert sum(p.numel() for p in loaded.parameters()) == low["parameters"]["after"]


def test_what_compress_cannot_take_is_refused_run_and_dry_run_alike(noisy, tiny_llama, tmp_path, capsys):
    out = tmp_path / "out"
    for extra in ([], ["--dry-run"]):
        fails(capsys, ["compress", str(tiny_llama), str(out), "--rank", "2", *extra], "is not an upcycle folder")
        fails(capsys, ["compress", str(noisy), str(out), "--rank", "33", *extra], "--rank must be at most")
    assert main(["compress", str(noisy), str(tmp_path / "delta"), "--rank", "2", "--quiet"]) == 0
    capsys.readouterr()
    for extra in ([], ["--dry-run"]):
        fails(capsys, ["compress", str(tmp_path / "delta"), str(out), "--rank", "2", *extra],
              "already holds delta experts")
        fails(capsys, ["compress", str(noisy), str(noisy), "--rank", "2", *extra], "noisy")
    assert not out.exists()
    assert main(["compress", str(noisy), str(out), "--rank", "2", "--dry-run"]) == 0
    assert "compress plan" in capsys.readouterr().out and not out.exists()

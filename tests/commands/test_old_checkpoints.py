"""Folders written before the package was split into sub-packages still load and resume: an upcycle
folder and a training run made by commit ed0fab5 (tests/fixtures/pre_layout/README.md says how)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

import upcycle
from upcycle.cli import main

FIXTURE = Path(__file__).parents[1] / "fixtures" / "pre_layout"


def test_an_upcycle_folder_written_before_the_split_loads_and_computes_the_same():
    model = upcycle.load(FIXTURE / "moe")
    assert len(upcycle.core.moe.moe_layers(model)) == 4
    reference = load_file(FIXTURE / "moe_reference.safetensors")
    with torch.no_grad():
        logits = model(input_ids=reference["input_ids"]).logits
    # float32 on the same weights and ids; the bound allows other CPUs' summation order (logits are O(1))
    torch.testing.assert_close(logits, reference["logits"], rtol=1e-5, atol=1e-5)


def test_a_run_checkpointed_before_the_split_resumes_to_the_same_losses(tmp_path, monkeypatch):
    """The run stopped at step 2 (paths in its run_config.yaml are relative to the fixture folder); resumed by
    today's code it logs steps 3 and 4 with the losses the old code logged when it ran without stopping."""
    work = tmp_path / "pre_layout"
    shutil.copytree(FIXTURE, work)
    monkeypatch.chdir(work)
    code = main(["train", "moe", "run", "--data", "src/train.txt", "--steps", "4", "--batch-size", "4",
                 "--sequence-length", "16", "--lr", "3e-3", "--quiet", "--set", "checkpoint_every=2",
                 "--set", "eval_every=0", "--resume"])
    assert code == 0
    steps = [json.loads(line) for line in (work / "run" / "log.jsonl").read_text().splitlines()]
    expected = [json.loads(line) for line in (FIXTURE / "uninterrupted_log.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if "step" in s and "loss" in s] == [1, 2, 3, 4]
    for got, want in zip(steps[2:4], expected[2:4], strict=True):
        assert got["step"] == want["step"]
        # the same float32 arithmetic in the same order; 1e-5 relative leaves room for other CPUs' kernels
        assert abs(got["loss"]["task"] - want["loss"]["task"]) <= 1e-5 * abs(want["loss"]["task"])
    assert (work / "run" / "model" / "model.safetensors").exists()

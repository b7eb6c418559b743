"""benchmarks/speed/moe_layer.py gives each implementation its own number of repetitions: a slow one (transformers'
eager loop over olmoe's 64 experts, seconds a call on a GPU) runs `reps` times, not as often as the fastest needs
to fill `min_seconds`, so every row of the GPU check ends inside its time."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "speed"))

import moe_layer  # noqa: E402


def test_a_slow_implementation_repeats_only_reps_times(monkeypatch):
    calls = {"n": 0}
    build = moe_layer.build

    def with_a_slow_one(shape, s, seed=0):
        ours, dense, hf = build(shape, s, seed)
        fast = hf["hf_grouped_mm"]

        class Slow(torch.nn.Module):            # the same output as transformers' block, 100 ms later
            def __init__(self):
                super().__init__()
                self.inner = fast

            def forward(self, x):
                calls["n"] += 1
                time.sleep(0.1)
                return self.inner(x)

        return ours, dense, {"hf_grouped_mm": fast, "hf_eager": Slow()}

    monkeypatch.setattr(moe_layer, "build", with_a_slow_one)
    result = moe_layer.measure("smollm2", 32, reps=2, min_seconds=0.15, s=moe_layer.Setting("cpu", "float32", None))
    for mode in ("forward", "forward_backward"):
        reps = result[mode]["reps"]
        assert reps["hf_eager"] == 2                       # as often as the fastest needs: dozens
        assert reps["dense"] > 2                           # a fast one still fills min_seconds
        assert result[mode]["upcycle_vs_best_hf"] is not None
    # one agreement call, then per mode two warm-up calls and the two timed ones
    assert calls["n"] == 1 + 2 * (2 + 2)

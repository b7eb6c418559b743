"""benchmarks/speed/train_mfu.py: its FLOP count (6 x active non-embedding parameters + 12 x layers x attention width x
sequence) against what torch.utils.flop_counter counts in one real forward and backward, and its tiny CPU preset
run end to end (every field of a row, the plan beside the measured peak)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

BENCHMARKS = Path(__file__).parents[2] / "benchmarks" / "speed"
sys.path.insert(0, str(BENCHMARKS))
import train_mfu  # noqa: E402


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """torch's flop counter has no formula for grouped_mm (MoE experts): 2 x rows x inner x columns, summed over the
    groups, for each layout the forward and backward use."""
    if len(a_shape) == 2 and len(b_shape) == 3:        # tokens [N, K] x experts [E, K, M]
        return 2 * a_shape[0] * a_shape[1] * b_shape[2]
    if len(a_shape) == 2 and len(b_shape) == 2:        # [K, N] x [N, M], groups along N: the weight gradient
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    return 2 * a_shape[0] * a_shape[1] * a_shape[2] * b_shape[-1]


@pytest.mark.parametrize("name", ["dense", "upcycle_every_2", "upcycle_delta16_every_2", "qwen3_moe_every_2"])
def test_the_flop_count_is_what_torch_counts(name):
    """One forward and backward of the causal-LM loss (the fused head), attention on sdpa's math backend (whose
    matmuls the counter sees; the fused kernels' FLOPs are the same): within 2 % of the formula. The difference
    left is what neither counts as a matmul."""
    from upcycle.tasks.causal_lm import causal_lm_loss

    torch.manual_seed(0)
    model = train_mfu.build(name, "tiny", torch.float32).train()
    batch, seq = 2, 32
    ids = torch.randint(0, train_mfu.PRESETS["tiny"][5], (batch, seq))
    counter = FlopCounterMode(display=False, custom_mapping={torch.ops.aten._grouped_mm: _grouped_mm_flops})
    with counter, sdpa_kernel(SDPBackend.MATH):
        causal_lm_loss(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}).backward()
    counted = counter.get_total_flops() / (batch * seq)
    formula = train_mfu.flops_per_token(model, seq)
    assert abs(counted / formula - 1) < 0.02, (counted, formula)


def test_the_flop_count_of_the_real_shapes():
    """SmolLM2-1.7B's shapes, built on the meta device: the dense model's 6N + attention, and the MoE's active
    parameters (2 of 8 experts in half the blocks)."""
    with torch.device("meta"):
        dense = train_mfu.build("dense", "smollm2-1.7b", torch.bfloat16)
        moe = train_mfu.build("upcycle_every_2", "smollm2-1.7b", torch.bfloat16, weights=False)
    layers, hidden, inter, heads, _, vocab = train_mfu.PRESETS["smollm2-1.7b"]
    per_block = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
    non_embedding = layers * per_block + hidden + vocab * hidden        # blocks, final norm, the (tied) head
    attention = 12 * layers * hidden * 2048
    assert train_mfu.flops_per_token(dense, 2048) == 6 * non_embedding + attention
    router = layers // 2 * hidden * train_mfu.EXPERTS
    extra = layers // 2 * (train_mfu.TOP_K - 1) * 3 * hidden * inter
    assert train_mfu.flops_per_token(moe, 2048) == 6 * (non_embedding + router + extra) + attention


@pytest.mark.slow      # over 15 s on 2 cores (tests/durations.json): the slow tier
def test_the_tiny_preset_runs(tmp_path):
    out = tmp_path / "mfu.json"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "train_mfu.py"), "--device", "cpu", "--preset", "tiny",
                           "--models", "dense", "upcycle_every_2", "--micro-batch", "2", "--sequence-length", "32",
                           "--steps", "2", "--warmup", "1", "--peak-tflops", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=BENCHMARKS)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["sequence_length"] == 32 and result["peak_flops"] == 1e12
    for name in ("dense", "upcycle_every_2"):
        row = result["results"][name]
        assert row["micro_batch"] == 2 and row["steps"] == 2
        assert row["mfu"] == pytest.approx(row["tokens_per_s"] * row["flops_per_token"] / 1e12)
        assert 0.85 < row["plan_over_measured"] < 1.15, row          # the plan's bound, at a tiny size
    moe = result["results"]["upcycle_every_2"]
    assert moe["flops_per_token"] > result["results"]["dense"]["flops_per_token"]
    assert moe["mfu_over_dense"] == pytest.approx(moe["mfu"] / result["results"]["dense"]["mfu"])

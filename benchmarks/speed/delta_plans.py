"""Which upcycled models train on one 80 GB GPU with full experts and with delta experts: the memory plan `upcycle
train --plan` prints (`training.memory.plan.plan_memory`), from the models' configs alone (no weight is made; the
plan traces each model of fake tensors).

Shapes, each copy-upcycled to 8 experts top-2 in every other block (the recipes' placement):
  smollm2-1.7b  24 blocks, D 2048, F 8192, 32 heads, 32 KV heads, vocabulary 49,152, tied
  llama3.2-1b   16 blocks, D 2048, F 8192, 32 heads, 8 KV heads, vocabulary 128,256, tied
  llama3-8b     32 blocks, D 4096, F 14336, 32 heads, 8 KV heads, vocabulary 128,256
Experts: full (8 whole FFNs per layer), delta r16 and r64 (the dense FFN plus rank-r changes, base trained), and
delta r16 with a frozen base (`moe.train_base: false`). Weights in bfloat16 (a Llama checkpoint's dtype, which a
conversion keeps), bf16 mixed precision, one GPU, rows of 2,048 tokens, micro-batch 1, AdamW, the load-balance loss,
without and with full activation checkpointing.

    python benchmarks/speed/delta_plans.py      # -> benchmarks/results/delta_plans.json, a markdown table printed
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from memory_plans import GPU_BYTES, upcycled_llama
from memory_plans import SHAPES as MEMORY_SHAPES

from upcycle.config import MoEConfig, RegularizerConfig, TrainConfig
from upcycle.machine import machine
from upcycle.scripts import output_file
from upcycle.training.memory.plan import Layout, plan_memory

RESULTS = Path(__file__).parents[1] / "results" / "delta_plans.json"
SHAPES = {  # layers, hidden, intermediate, heads, kv heads, vocabulary, tied
    "smollm2-1.7b": (24, 2048, 8192, 32, 32, 49152, True),
    "llama3.2-1b": MEMORY_SHAPES["llama3.2-1b"],
    "llama3-8b": MEMORY_SHAPES["llama3.1-8b"],          # Llama-3-8B's shapes are Llama-3.1-8B's
}
EXPERTS = {  # name -> MoEConfig keys
    "full": {"experts": "full"},
    "delta r16": {"experts": "delta", "delta_rank": 16},
    "delta r64": {"experts": "delta", "delta_rank": 64},
    "delta r16, frozen base": {"experts": "delta", "delta_rank": 16, "train_base": False},
}


def build(shape: str, experts: str, dtype: torch.dtype) -> torch.nn.Module:
    return upcycled_llama(SHAPES[shape], dtype, MoEConfig(num_experts=8, top_k=2, **EXPERTS[experts]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES)
    parser.add_argument("--out", type=output_file, default=RESULTS)
    args = parser.parse_args()
    rows, started = [], time.time()
    layout = Layout(1, "single", "cuda", "80 GB GPU", GPU_BYTES, "bf16")
    for shape in args.shapes:
        for experts in EXPERTS:
            with torch.device("meta"):
                meta = build(shape, experts, torch.bfloat16)
            total = sum(p.numel() for p in meta.parameters())
            trainable = sum(p.numel() for p in meta.parameters() if p.requires_grad)
            for mode in ("none", "full"):
                cfg = TrainConfig(batch_size=1, sequence_length=2048, activation_checkpointing=mode,
                                  regularizers=RegularizerConfig(load_balance=0.01))
                plan = plan_memory(cfg, layout, detail=False,
                                   build=lambda dtype, shape=shape, experts=experts: build(
                                       shape, experts, dtype or torch.bfloat16))
                rows.append({"shape": shape, "experts": experts, "parameters": total, "trainable": trainable,
                             "checkpointing": mode, "peak_bytes": plan.peak_bytes, "fits_80gb": plan.fits,
                             "parts": plan.parts, "peak_at": plan.peak_at})
                print(f"{shape} {experts} {mode}: {plan.peak_bytes / 1e9:.1f} GB", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "delta_plans", "machine": machine(), "gpu_bytes": GPU_BYTES,
                                    "experts": 8, "top_k": 2, "every": 2, "sequence_length": 2048, "micro_batch": 1,
                                    "command": "python benchmarks/speed/delta_plans.py",
                                    "seconds": round(time.time() - started, 1), "rows": rows}, indent=1) + "\n")
    print(table(rows))
    print(f"wrote {args.out}")


def table(rows: list[dict]) -> str:
    """The markdown table docs/delta-experts.md shows: GB at the plan's peak on one 80 GB GPU."""
    lines = ["| model (8 experts, every other block) | experts | parameters | trained | no checkpointing | "
             "full checkpointing |", "|---|---|---:|---:|---:|---:|"]
    keyed = {(r["shape"], r["experts"], r["checkpointing"]): r for r in rows}
    for shape in SHAPES:
        for experts in EXPERTS:
            if (shape, experts, "none") not in keyed:
                continue
            cells = [f"{keyed[(shape, experts, m)]['peak_bytes'] / 1e9:.1f} GB"
                     + ("" if keyed[(shape, experts, m)]["fits_80gb"] else " (no)") for m in ("none", "full")]
            r = keyed[(shape, experts, "none")]
            lines.append(f"| {shape} | {experts} | {r['parameters'] / 1e9:.2f} B | {r['trainable'] / 1e9:.2f} B | "
                         f"{cells[0]} | {cells[1]} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

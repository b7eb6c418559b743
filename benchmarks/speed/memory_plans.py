"""The memory plans of training 1B, 3B and 8B upcycled models on 80 GB GPUs, one, two and eight of them, from the
models' configs alone (no weight exists): what docs/large-models.md's table shows.

Shapes (random weights are never made; the plan builds each model of fake tensors):
  llama3.2-1b   16 blocks, D 2048, F 8192, 32 heads, 8 KV heads, vocabulary 128,256, tied
  llama3.2-3b   28 blocks, D 3072, F 8192, 24 heads, 8 KV heads, vocabulary 128,256, tied
  llama3.1-8b   32 blocks, D 4096, F 14336, 32 heads, 8 KV heads, vocabulary 128,256
each copy-upcycled to 8 experts top-2 in every other block, weights in bfloat16 (a Llama checkpoint's dtype, which a
conversion keeps), bf16 mixed precision, rows of 2,048 tokens, AdamW, the load-balance loss. One GPU trains the
bfloat16 weights as they load; FSDP2 keeps float32 master shards (Accelerate's preparation).

    python benchmarks/speed/memory_plans.py          # -> benchmarks/results/memory_plans.json, a markdown table printed
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import transformers

from upcycle.config import MoEConfig, PlacementConfig, RegularizerConfig, TrainConfig
from upcycle.core.expert_shape import ExpertShape
from upcycle.core.moe import MoELayer
from upcycle.core.surgery import install, plan_targets, track_padding_masks
from upcycle.machine import machine
from upcycle.scripts import output_file
from upcycle.training.memory.plan import Layout, plan_memory

RESULTS = Path(__file__).parents[1] / "results"
SHAPES = {  # layers, hidden, intermediate, heads, kv heads, vocabulary, tied
    "llama3.2-1b": (16, 2048, 8192, 32, 8, 128256, True),
    "llama3.2-3b": (28, 3072, 8192, 24, 8, 128256, True),
    "llama3.1-8b": (32, 4096, 14336, 32, 8, 128256, False),
}
GPU_BYTES = 85_520_809_984          # an H100 80GB's torch.cuda.get_device_properties(0).total_memory
LAYOUTS = ((1, "single"), (2, "fsdp2"), (8, "fsdp2"))


def build(shape: str, dtype: torch.dtype) -> torch.nn.Module:
    return upcycled_llama(SHAPES[shape], dtype, MoEConfig(num_experts=8, top_k=2))


def upcycled_llama(dims: tuple, dtype: torch.dtype, moe: MoEConfig) -> torch.nn.Module:
    """A Llama of `dims` (layers, hidden, intermediate, heads, kv heads, vocabulary, tied) whose every other block's
    FFN is an MoE layer of `moe`, empty (the plan traces it on fake tensors)."""
    layers, hidden, inter, heads, kv, vocab, tied = dims
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                                      tie_word_embeddings=tied, max_position_embeddings=8192)
    model = transformers.LlamaForCausalLM._from_config(config, dtype=dtype)
    for target in plan_targets(model, PlacementConfig(every=2)):
        install(model, target.path, MoELayer(ExpertShape(hidden, inter, "silu", gated=True), moe, dtype=dtype))
    track_padding_masks(model)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES)
    parser.add_argument("--micro-batches", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--out", type=output_file, default=RESULTS / "memory_plans.json")
    args = parser.parse_args()
    rows, started = [], time.time()
    for shape in args.shapes:
        total = sum(p.numel() for p in build_meta(shape).parameters())
        for processes, sharding in LAYOUTS:
            layout = Layout(processes, sharding, "cuda", "80 GB GPU", GPU_BYTES, "bf16")
            for micro in args.micro_batches:
                for mode in ("none", "full"):
                    cfg = TrainConfig(batch_size=micro * processes, sequence_length=2048,
                                      activation_checkpointing=mode, regularizers=RegularizerConfig(load_balance=0.01))
                    plan = plan_memory(cfg, layout, detail=False,
                                       build=lambda dtype, shape=shape: build(shape, dtype or torch.bfloat16))
                    rows.append({"shape": shape, "parameters": total, "processes": processes, "sharding": sharding,
                                 "micro_batch": micro, "checkpointing": mode, "peak_bytes": plan.peak_bytes,
                                 "fits_80gb": plan.fits, "parts": plan.parts, "peak_at": plan.peak_at})
                    print(f"{shape} {processes}x{sharding} micro {micro} {mode}: {plan.peak_bytes / 1e9:.1f} GB",
                          flush=True)
    args.out.write_text(json.dumps({"benchmark": "memory_plans", "machine": machine(), "gpu_bytes": GPU_BYTES,
                                    "experts": 8, "top_k": 2, "every": 2, "sequence_length": 2048,
                                    "seconds": round(time.time() - started, 1), "rows": rows}, indent=1))
    print(table(rows))
    print(f"wrote {args.out}")


def build_meta(shape: str) -> torch.nn.Module:
    with torch.device("meta"):
        return build(shape, torch.bfloat16)


def table(rows: list[dict]) -> str:
    """The markdown table docs/large-models.md shows: GB per GPU at the plan's peak."""
    lines = ["| model (upcycled) | parameters | GPUs | micro-batch | no checkpointing | full checkpointing |",
             "|---|---:|---|---:|---:|---:|"]
    keyed = {(r["shape"], r["processes"], r["micro_batch"], r["checkpointing"]): r for r in rows}
    for shape, processes, micro in sorted({(r["shape"], r["processes"], r["micro_batch"]) for r in rows},
                                          key=lambda k: (list(SHAPES).index(k[0]), k[1], k[2])):
        cells = []
        for mode in ("none", "full"):
            r = keyed[(shape, processes, micro, mode)]
            cells.append(f"{r['peak_bytes'] / 1e9:.1f} GB" + ("" if r["fits_80gb"] else " (no)"))
        params = keyed[(shape, processes, micro, "none")]["parameters"]
        gpus = "1" if processes == 1 else f"{processes}, FSDP2"
        lines.append(f"| {shape} | {params / 1e9:.1f} B | {gpus} | {micro} x 2,048 | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

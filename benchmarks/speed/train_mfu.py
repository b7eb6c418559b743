"""Training at real size: model FLOP utilization (MFU), tokens/s and peak memory against the memory plan, for
1B-class shapes built from their configs with random weights (no hub), dense and copy-upcycled, beside
transformers' own MoE classes of the same shapes.

Shapes (`--preset`):
  smollm2-1.7b  24 blocks, D 2048, F 8192, 32 heads, 32 KV heads, vocabulary 49,152, tied embeddings
  llama3.2-1b   16 blocks, D 2048, F 8192, 32 heads, 8 KV heads, vocabulary 128,256, tied embeddings
  tiny          2 blocks, D 64, F 128, 4 heads, 2 KV heads, vocabulary 512 (a CPU run of the same code)
Rows (`--models`):
  dense              LlamaForCausalLM
  upcycle_every_2    the dense model copy-upcycled, 8 experts top-2, every other block
  upcycle_every_1    the same, every block
  upcycle_delta16_every_2, upcycle_delta64_every_2   upcycle_every_2 with delta experts (`moe.experts: delta`):
                     the dense FFN plus a rank-16 (64) change per expert and matrix
  qwen3_moe_every_2  transformers' Qwen3MoeForCausalLM of upcycle_every_2's shapes (decoder_sparse_step 2, the dense
                     blocks' FFN F wide, experts F wide; head_dim D / heads), experts_implementation grouped_mm
  mixtral_every_1    transformers' MixtralForCausalLM of upcycle_every_1's shapes, grouped_mm
  torchtitan_qwen3_every_1  torchtitan's own Qwen3-MoE model (its grouped experts, its attention) at
                     upcycle_every_1's shapes, in a loop of the same step where torchtitan imports (else why not)
Every row trains with `upcycle train`'s parts (Accelerate, its AdamW, the load-balance loss at 0.01, gradient
clipping), weights in `--weights` (bfloat16: what a SmolLM2 checkpoint and its conversion hold), bfloat16 autocast
on a GPU, rows of `--sequence-length` (2,048) tokens, the micro-batch the memory plan picks (the largest power of
two whose plan fits 92 % of the device), `--activation-checkpointing` and `--compile` as asked.

MFU = tokens/s x FLOPs per token / the device's peak bf16 FLOP/s, with FLOPs per token counted as torchtitan and
PaLM count them: 6 x the active non-embedding parameters, the output head included, + 12 x layers x heads x head
dim x sequence length for attention (`flops_per_token`; checked against torch.utils.flop_counter on a tiny model
in tests/benchmarks/test_train_mfu.py). Peak memory is torch.cuda.max_memory_allocated over the training steps (on
the CPU, the live tensors of `upcycle.training.memory.peak`) beside the plan's peak for the same run.

    python benchmarks/speed/train_mfu.py --device cuda --preset smollm2-1.7b --out OUT/train_mfu.json
    python benchmarks/speed/train_mfu.py --device cpu --preset tiny --micro-batch 2 --sequence-length 64 --steps 2
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path

import torch
import transformers

from upcycle.config import MoEConfig, PlacementConfig, RegularizerConfig, TrainConfig
from upcycle.core.expert_shape import ExpertShape
from upcycle.core.moe import MoELayer, moe_layers
from upcycle.core.surgery import install, plan_targets, track_padding_masks
from upcycle.machine import machine
from upcycle.scripts import output_file

RESULTS = Path(__file__).parents[1] / "results"
PRESETS = {  # layers, hidden, intermediate, heads, kv heads, vocabulary
    "smollm2-1.7b": (24, 2048, 8192, 32, 32, 49152),
    "llama3.2-1b": (16, 2048, 8192, 32, 8, 128256),
    "tiny": (2, 64, 128, 4, 2, 512),
}
EXPERTS, TOP_K = 8, 2
# the delta rows last: a GPU check stopped at its time limit keeps the rows measured before them
MODELS = ("dense", "upcycle_every_2", "upcycle_every_1", "qwen3_moe_every_2", "mixtral_every_1",
          "torchtitan_qwen3_every_1", "upcycle_delta16_every_2", "upcycle_delta64_every_2")
# dense bf16 tensor-core peak per GPU (NVIDIA's data sheets, without sparsity); MFU is measured against these
PEAK_FLOPS = {"H200": 989e12, "H100 80GB HBM3": 989e12, "H100 SXM": 989e12, "H100 PCIe": 756e12, "A100": 312e12}
FIT_SHARE = 0.92        # of the device's memory the picked micro-batch's plan may take (the allocator's own slack)


def llama_config(preset: str, dtype: torch.dtype) -> transformers.LlamaConfig:
    layers, hidden, inter, heads, kv, vocab = PRESETS[preset]
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                                      tie_word_embeddings=True, max_position_embeddings=8192, dtype=dtype)
    config.architectures = ["LlamaForCausalLM"]
    return config


def stock_config(name: str, preset: str, dtype: torch.dtype):
    layers, hidden, inter, heads, kv, vocab = PRESETS[preset]
    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv, tie_word_embeddings=True, max_position_embeddings=8192,
                  num_experts_per_tok=TOP_K, router_aux_loss_coef=0.0, output_router_logits=False,
                  experts_implementation="grouped_mm", dtype=dtype)
    if name.startswith("mixtral"):
        return transformers.MixtralConfig(intermediate_size=inter, num_local_experts=EXPERTS, **common)
    every = int(name.rsplit("_", 1)[1])
    return transformers.Qwen3MoeConfig(moe_intermediate_size=inter, intermediate_size=inter, num_experts=EXPERTS,
                                       head_dim=hidden // heads, decoder_sparse_step=every, mlp_only_layers=[],
                                       norm_topk_prob=True, **common)


def build(name: str, preset: str, dtype: torch.dtype, *, weights: bool = True) -> torch.nn.Module:
    """The row's model in `dtype`, on the current default device; `weights=False` (under a fake or meta mode) only
    its structure: the MoE layers of an upcycled row empty, as the memory plan builds them."""
    if name.startswith(("qwen3", "mixtral")):
        return transformers.AutoModelForCausalLM.from_config(stock_config(name, preset, dtype), dtype=dtype)
    config = llama_config(preset, dtype)
    model = transformers.LlamaForCausalLM._from_config(config, dtype=dtype)
    if name == "dense":
        return model
    every = int(name.rsplit("_", 1)[1])
    moe = moe_config(name)
    if weights:
        from upcycle.config import CheckConfig, ConvertConfig
        from upcycle.conversion.pipeline import upcycle_model

        device = next(model.parameters()).device
        upcycle_model(model, ConvertConfig(method="copy", moe=moe,
                                           placement=PlacementConfig(every=every), device=str(device),
                                           check=CheckConfig(sequences=1, tokens=16, per_layer=False,
                                                             end_to_end=False)),
                      progress=False)
        return model
    _, hidden, inter, *_ = PRESETS[preset]
    for target in plan_targets(model, PlacementConfig(every=every)):
        install(model, target.path, MoELayer(ExpertShape(hidden, inter, "silu", gated=True), moe, dtype=dtype))
    track_padding_masks(model)
    return model


def moe_config(name: str) -> MoEConfig:
    """An upcycled row's MoE: full experts, or delta experts of the rank its name gives (upcycle_delta16_every_2)."""
    kind = name.split("_")[1]
    if kind.startswith("delta"):
        return MoEConfig(num_experts=EXPERTS, top_k=TOP_K, experts="delta", delta_rank=int(kind.removeprefix("delta")))
    return MoEConfig(num_experts=EXPERTS, top_k=TOP_K)


def flops_per_token(model: torch.nn.Module, sequence_length: int) -> int:
    """6 x active non-embedding parameters (the output head included: a tied head's matrix counted once, as the
    head) + 12 x layers x attention width x sequence length (module docstring)."""
    config = model.config
    total = sum(p.numel() for p in model.parameters())
    # a delta layer's base serves every token; its factors, like full experts, k of E
    inactive = sum((layer.num_experts - layer.top_k) * layer.experts.parameters_per_expert()
                   for layer in moe_layers(model).values())
    for block in _stock_moe_blocks(model):          # transformers' MoE classes: k of E experts active
        experts = block.experts
        per_expert = experts.gate_up_proj[0].numel() + experts.down_proj[0].numel()
        inactive += (experts.gate_up_proj.shape[0] - config.num_experts_per_tok) * per_expert
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    non_embedding = total - inactive - (embedding.numel() if embedding is not head else 0)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attention = 12 * config.num_hidden_layers * config.num_attention_heads * head_dim * sequence_length
    return 6 * non_embedding + attention


def _stock_moe_blocks(model: torch.nn.Module):
    from upcycle.core.stock_moe import stock_moe_blocks

    return stock_moe_blocks(model).values()


def peak_flops(device: torch.device, given: float | None) -> float | None:
    if given:
        return given * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


def plan_for(name: str, args, cfg: TrainConfig, layout):
    from upcycle.training.memory.plan import plan_memory

    return plan_memory(cfg, layout, detail=False,
                       build=lambda dtype: build(name, args.preset, dtype or args.dtype, weights=False))


def pick_micro_batch(name: str, args, layout) -> tuple[int, object]:
    """The largest power-of-two micro-batch (at most --max-micro-batch) whose plan fits FIT_SHARE of the device:
    the plans of 1 and 2 rows give the bytes a row adds, which gives the candidate, whose own plan decides."""
    room = FIT_SHARE * layout.device_bytes
    one = plan_for(name, args, run_config(args, 1), layout)
    if one.peak_bytes > room:
        raise RuntimeError(f"{name}: no micro-batch fits ({one.peak_bytes / 1e9:.1f} GB planned for 1 row, "
                           f"{room / 1e9:.1f} GB room)")
    per_row = max(1, plan_for(name, args, run_config(args, 2), layout).peak_bytes - one.peak_bytes)
    micro = 1
    while micro * 2 <= min(args.max_micro_batch, 1 + (room - one.peak_bytes) // per_row):
        micro *= 2
    while micro > 1:
        plan = plan_for(name, args, run_config(args, micro), layout)
        if plan.peak_bytes <= room:
            return micro, plan
        micro //= 2
    return 1, one


def run_config(args, micro: int) -> TrainConfig:
    return TrainConfig(batch_size=micro, sequence_length=args.sequence_length, lr=1e-4, compile=args.compile,
                       activation_checkpointing=args.activation_checkpointing,
                       mixed_precision="bf16" if args.device.startswith("cuda") else "no",
                       regularizers=RegularizerConfig(load_balance=0.01))


def run(name: str, args, device: torch.device) -> dict:
    import gc

    from upcycle.training.memory.peak import measure_peak
    from upcycle.training.memory.plan import Layout, local_layout
    from upcycle.training.parallel.accelerator import make_accelerator, prepare
    from upcycle.training.parts import assemble
    from upcycle.training.step import StepSetup, train_step

    gc.collect()                 # the previous row's model (Accelerate's wrapped forward keeps it in a cycle)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if name.startswith("torchtitan"):
        return torchtitan_row(args, device)
    probe = run_config(args, 1)
    layout = local_layout(probe) if device.type == "cuda" else Layout(1, "single", "cpu", "cpu", 2**40, "no")
    if args.micro_batch:
        micro, plan = args.micro_batch, plan_for(name, args, run_config(args, args.micro_batch), layout)
    else:
        micro, plan = pick_micro_batch(name, args, layout)
    cfg = run_config(args, micro)
    accelerator = make_accelerator(cfg)
    with torch.device(device):
        torch.manual_seed(0)
        model = build(name, args.preset, args.dtype)
    model.train()
    flops = flops_per_token(model, args.sequence_length)
    params = {"total": sum(p.numel() for p in model.parameters())}
    g = torch.Generator().manual_seed(0)
    vocab = PRESETS[args.preset][5]
    ids = torch.randint(0, vocab, (micro, args.sequence_length), generator=g)
    mask = torch.ones_like(ids)
    mask[-1, -1] = 0                   # a padded token, as the plan assumes (the masked attention path)
    batch = {"input_ids": ids, "attention_mask": mask}
    if device.type == "cuda":
        torch.cuda.empty_cache()
    times, state = [], {}

    def steps() -> None:
        parts = prepare(model, cfg, accelerator, functools.partial(assemble, cfg=cfg))    # as the trainer does
        state["parts"] = parts
        for step in range(args.warmup + args.steps):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            result = train_step(parts.model, batch, parts.optimizer, parts.objective,
                                StepSetup(accelerator=accelerator, clip_grad=1.0), step=step)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if step >= args.warmup:
                times.append(time.perf_counter() - start)
            state["loss"] = result.loss["total"]

    measured = measure_peak(steps, device)
    # what existed before the steps: the model (the CPU's count of it: its parameters and buffers)
    start = measured.start_bytes if measured.start_bytes is not None else \
        sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    peak = start + measured.peak_bytes
    tokens = micro * args.sequence_length
    tokens_per_s = tokens / statistics.median(times)
    peak_device = peak_flops(device, args.peak_tflops)
    out = {"micro_batch": micro, "tokens_per_step": tokens, "tokens_per_s": tokens_per_s,
           "step_s_median": statistics.median(times), "steps": len(times), "flops_per_token": flops,
           "mfu": tokens_per_s * flops / peak_device if peak_device else None, "peak_bytes": peak,
           "plan_bytes": plan.peak_bytes, "plan_over_measured": plan.peak_bytes / peak, "plan_parts": plan.parts,
           "parameters": params, "final_loss": state.get("loss")}
    if args.profile:
        from gpu_profile import profile

        parts = state["parts"]
        profile(name, lambda step: train_step(parts.model, batch, parts.optimizer, parts.objective,
                                              StepSetup(accelerator=accelerator, clip_grad=1.0), step=step),
                device, args.profile)
    state.clear()
    return out


def torchtitan_row(args, device: torch.device) -> dict:
    """torchtitan's Qwen3-MoE model at upcycle_every_1's shapes, trained by the same kind of loop (bf16 weights,
    fused AdamW, its own cross-entropy over its logits): where torchtitan imports and its flex attention compiles."""
    try:
        import importlib.util

        import torchtitan  # noqa: F401
        # the interop check's worker module, by its path (it lives in benchmarks/interop/)
        worker = Path(__file__).resolve().parents[1] / "interop" / "torchtitan_worker.py"
        spec = importlib.util.spec_from_file_location("torchtitan_worker", worker)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        titan_config = module.titan_config
    except Exception as e:            # noqa: BLE001  (the row says why not)
        return {"error": f"torchtitan does not import here ({type(e).__name__}: {str(e)[:200]})"}
    layers, hidden, inter, heads, kv, vocab = PRESETS[args.preset]
    hf = {"hidden_size": hidden, "head_dim": hidden // heads, "vocab_size": vocab, "tie_word_embeddings": True,
          "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
          "moe_intermediate_size": inter, "num_experts": EXPERTS, "num_experts_per_tok": TOP_K,
          "max_position_embeddings": 8192, "rope_theta": 10000.0, "rms_norm_eps": 1e-5}
    try:
        config = titan_config(hf)
        with torch.device("meta"):
            model = config.build()
        model.to_empty(device=device)
        model.init_states()
        model.to(args.dtype).train()
        micro = args.micro_batch or 1
        ids = torch.randint(0, vocab, (micro, args.sequence_length), device=device)
        positions = torch.arange(args.sequence_length, device=device)[None].expand(micro, -1)
        masks = model.get_attention_masks(positions)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
        times = []
        for step in range(args.warmup + args.steps):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            logits = model(ids, positions, masks)
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if step >= args.warmup:
                times.append(time.perf_counter() - start)
    except Exception as e:            # noqa: BLE001
        return {"error": f"torchtitan's model did not train here ({type(e).__name__}: {str(e)[:300]})"}
    tokens = micro * args.sequence_length
    return {"micro_batch": micro, "tokens_per_s": tokens / statistics.median(times), "steps": len(times),
            "peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
            "note": "torchtitan's model in a plain loop (its trainer needs a dataset and tokenizer this machine "
                    "does not have); no load-balance loss"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--preset", default="smollm2-1.7b", choices=PRESETS)
    parser.add_argument("--models", nargs="+", default=[m for m in MODELS if m != "upcycle_every_1"],
                        choices=MODELS)
    parser.add_argument("--sequence-length", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, help="rows per step (default: the largest the plan fits)")
    parser.add_argument("--max-micro-batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--weights", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--activation-checkpointing", default="none", choices=("none", "full", "moe"))
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--peak-tflops", type=float, help="the device's peak bf16 TFLOP/s (default: by GPU name)")
    parser.add_argument("--profile", type=Path, help="also profile two steps of each row into this folder")
    parser.add_argument("--out", type=output_file)
    args = parser.parse_args()
    from upcycle.scripts import check_device, check_positive

    check_device(parser, args.device)
    check_positive(parser, steps=args.steps, sequence_length=args.sequence_length,
                   max_micro_batch=args.max_micro_batch, **({"micro_batch": args.micro_batch}
                                                             if args.micro_batch is not None else {}))
    args.dtype = getattr(torch, args.weights)
    device = torch.device(args.device)
    started = time.time()
    results = {}
    for name in args.models:
        try:
            results[name] = run(name, args, device)
        except Exception as e:          # noqa: BLE001  (one row failing is a result, not the end of the run)
            results[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        r = results[name]
        print(f"{name:26s} " + (f"{r['tokens_per_s']:12,.0f} tokens/s" + (f"  MFU {r['mfu']:.3f}" if r.get("mfu")
                                                                           else "") if "tokens_per_s" in r
                                 else r["error"]), flush=True)
    dense = results.get("dense", {})
    for name, r in results.items():
        if name != "dense" and r.get("mfu") and dense.get("mfu"):
            r["mfu_over_dense"] = r["mfu"] / dense["mfu"]
    for ours, theirs in (("upcycle_every_2", "qwen3_moe_every_2"), ("upcycle_every_1", "mixtral_every_1"),
                         ("upcycle_every_1", "torchtitan_qwen3_every_1")):
        if "tokens_per_s" in results.get(ours, {}) and "tokens_per_s" in results.get(theirs, {}):
            results[ours][f"speedup_vs_{theirs}"] = results[ours]["tokens_per_s"] / results[theirs]["tokens_per_s"]
    out = {"benchmark": "train_mfu", "machine": machine(device), "preset": args.preset,
           "shapes": dict(zip(("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab"),
                              PRESETS[args.preset], strict=True)),
           "experts": EXPERTS, "top_k": TOP_K, "sequence_length": args.sequence_length, "weights": args.weights,
           "activation_checkpointing": args.activation_checkpointing, "compile": args.compile,
           "peak_flops": peak_flops(device, args.peak_tflops), "results": results,
           "seconds": round(time.time() - started, 1),
           "flop_count": "6 x active non-embedding parameters (head included) + 12 x layers x heads x head_dim x "
                         "sequence (torchtitan, PaLM)"}
    args.out = args.out or RESULTS / f"train_mfu_{device.type}_{args.preset}.json"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""Whole-model training speed: one `upcycle train` step (upcycle.training.step.train_step under Accelerate, as the
trainer runs it) on a dense model, on upcycle's MoE of it, and on transformers' stock MoE classes of the same shapes.

Models (random weights; SmolLM2-135M's shapes by default: 30 blocks, D 576, F 1536, 9 heads, 3 KV heads, vocabulary
49,152, tied embeddings):
  dense                 LlamaForCausalLM
  upcycle_every_2       the dense model copy-upcycled, 8 experts top-2, every other block (the recipes' placement)
  upcycle_every_1       the same with every block MoE
  mixtral_grouped_mm    MixtralForCausalLM of the every-block shapes, experts_implementation="grouped_mm"
  mixtral_eager         the same with experts_implementation="eager"
  qwen3_moe_grouped_mm  Qwen3MoeForCausalLM of the every-block shapes (head_dim 64), grouped_mm
Every model trains with the same step: bf16 mixed precision on a GPU (float32 master weights), the trainer's AdamW
(fused on a GPU), gradient clipping at 1, and the load-balance loss at 0.01 (read from upcycle's routing records,
and from forward hooks on the stock routers). Batches of B x S random tokens; tokens/s is the median over the
timed steps after warm-up. FLOP ideal of a MoE = the dense model's tokens/s x (dense active parameters / the
MoE's active parameters per token): the MoE runs k of E experts, so per token it does that much more work.

Run:
  python benchmarks/speed/train_step.py --device cuda                 # 16 x 1024 tokens, every model
  python benchmarks/speed/train_step.py --device cpu --preset tiny    # a smoke run of the same code on a CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import partial
from pathlib import Path

import torch
import transformers
from gpu_profile import profile

from upcycle.config import ConvertConfig, MoEConfig, PlacementConfig, RegularizerConfig, TrainConfig
from upcycle.conversion.pipeline import upcycle_model
from upcycle.conversion.preservation import count_parameters
from upcycle.machine import machine
from upcycle.scripts import output_file
from upcycle.training.loss.objective import Objective
from upcycle.training.optimizer import make_optimizer
from upcycle.training.step import StepSetup, train_step

RESULTS = Path(__file__).parents[1] / "results"
PRESETS = {  # (layers, hidden, intermediate, heads, kv heads, vocabulary, experts, top-k)
    "smollm2": (30, 576, 1536, 9, 3, 49152, 8, 2),
    "tiny": (2, 64, 128, 4, 2, 512, 4, 2),
}
MODELS = ("dense", "upcycle_every_2", "upcycle_every_1", "mixtral_grouped_mm", "mixtral_eager",
          "qwen3_moe_grouped_mm")


def dense_model(preset: str, seed: int = 0):
    layers, hidden, inter, heads, kv, vocab, _, _ = PRESETS[preset]
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, tie_word_embeddings=True, max_position_embeddings=4096))


def build(name: str, preset: str, device: torch.device):
    layers, hidden, inter, heads, kv, vocab, experts, k = PRESETS[preset]
    if name == "dense" or name.startswith("upcycle"):
        model = dense_model(preset).to(device)
        if name.startswith("upcycle"):
            cfg = ConvertConfig(method="copy", moe=MoEConfig(num_experts=experts, top_k=k),
                                placement=PlacementConfig(every=int(name.rsplit("_", 1)[1])),
                                check=dataclass_check(), device=str(device))
            upcycle_model(model, cfg, progress=False)
        return model
    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv, tie_word_embeddings=True, max_position_embeddings=4096,
                  num_experts_per_tok=k, router_aux_loss_coef=0.0, output_router_logits=False)
    torch.manual_seed(0)
    if name.startswith("mixtral"):
        config = transformers.MixtralConfig(intermediate_size=inter, num_local_experts=experts,
                                            experts_implementation=name.split("_", 1)[1], **common)
        return transformers.MixtralForCausalLM(config).to(device)
    config = transformers.Qwen3MoeConfig(moe_intermediate_size=inter, intermediate_size=inter, num_experts=experts,
                                         head_dim=64, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                                         experts_implementation="grouped_mm", **common)
    return transformers.Qwen3MoeForCausalLM(config).to(device)


def dataclass_check():
    from upcycle.config import CheckConfig

    return CheckConfig(sequences=2, tokens=64, per_layer=False)


def run(name: str, args, device: torch.device) -> dict:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    mixed = "bf16" if device.type == "cuda" else "no"
    acc = Accelerator(mixed_precision=mixed, cpu=device.type == "cpu")
    model = build(name, args.preset, device)
    active = count_parameters(model)["active_per_token"]
    if name.startswith(("mixtral", "qwen3")):         # stock classes: k of E experts active, as ours count them
        layers, hidden, inter, _, _, _, experts, k = PRESETS[args.preset]
        active -= layers * (experts - k) * 3 * hidden * inter
    model.train()
    cfg = TrainConfig(lr=1e-4, batch_size=args.batch_size, sequence_length=args.sequence_length)
    optimizer = make_optimizer(model, cfg, fused=device.type == "cuda")
    model, optimizer = acc.prepare(model, optimizer)
    if args.compile:
        model = torch.compile(model)
    reg = Objective(acc.unwrap_model(model), RegularizerConfig(load_balance=0.01)).to(device)
    g = torch.Generator().manual_seed(0)
    vocab = PRESETS[args.preset][5]
    batch = {"input_ids": torch.randint(0, vocab, (args.batch_size, args.sequence_length), generator=g),
             "attention_mask": torch.ones(args.batch_size, args.sequence_length, dtype=torch.long)}
    times = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(args.warmup + args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = train_step(model, batch, optimizer, reg, StepSetup(accelerator=acc, clip_grad=1.0), step=step)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    tokens = args.batch_size * args.sequence_length
    if args.profile and name in args.profile_models:
        profile(name, partial(train_step, model, batch, optimizer, reg, accelerator=acc, clip_grad=1.0), device,
                args.profile)
    out = {"tokens_per_s": tokens / statistics.median(times), "step_s_median": statistics.median(times),
           "steps": len(times), "active_parameters": active, "total_parameters": count_parameters(model)["total"],
           "final_loss": result.loss["total"]}
    if device.type == "cuda":
        out["peak_bytes"] = torch.cuda.max_memory_allocated(device)
    del model, optimizer, reg
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--preset", default="smollm2", choices=PRESETS)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--sequence-length", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="torch.compile every model")
    parser.add_argument("--out", type=output_file)
    parser.add_argument("--profile", type=Path, help="also profile two steps of --profile-models into this folder")
    parser.add_argument("--profile-models", nargs="+", default=["dense", "upcycle_every_1", "mixtral_grouped_mm"],
                        choices=MODELS)
    args = parser.parse_args()
    from upcycle.scripts import check_device, check_positive

    check_device(parser, args.device)
    check_positive(parser, steps=args.steps, batch_size=args.batch_size, sequence_length=args.sequence_length)
    device = torch.device(args.device)
    started = time.time()
    results = {}
    for name in args.models:
        try:
            results[name] = run(name, args, device)
        except Exception as e:          # noqa: BLE001  (one model failing is a result, not the end of the run)
            results[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        r = results[name]
        print(f"{name:22s} " + (f"{r['tokens_per_s']:10,.0f} tokens/s" if "tokens_per_s" in r else r["error"]),
              flush=True)
    dense = results.get("dense", {})
    for name, r in results.items():
        if name != "dense" and "tokens_per_s" in r and "tokens_per_s" in dense:
            r["flop_ratio"] = dense["active_parameters"] / r["active_parameters"]
            r["flop_ideal_tokens_per_s"] = dense["tokens_per_s"] * r["flop_ratio"]
            r["share_of_flop_ideal"] = r["tokens_per_s"] / r["flop_ideal_tokens_per_s"]
    for ours in ("upcycle_every_1",):
        for theirs in ("mixtral_grouped_mm", "mixtral_eager", "qwen3_moe_grouped_mm"):
            if "tokens_per_s" in results.get(ours, {}) and "tokens_per_s" in results.get(theirs, {}):
                results[ours][f"speedup_vs_{theirs}"] = results[ours]["tokens_per_s"] / results[theirs]["tokens_per_s"]
    command = ["python benchmarks/speed/train_step.py", "--device", args.device, "--preset", args.preset,
               "--batch-size", str(args.batch_size), "--sequence-length", str(args.sequence_length),
               "--steps", str(args.steps), "--warmup", str(args.warmup)] + (["--compile"] if args.compile else [])
    out = {"benchmark": "train_step", "machine": machine(device), "preset": args.preset,
           "shapes": dict(zip(("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab", "experts", "top_k"),
                              PRESETS[args.preset], strict=True)),
           "batch": [args.batch_size, args.sequence_length], "compile": args.compile, "results": results,
           "seconds": round(time.time() - started, 1), "command": " ".join(command)}
    name = f"train_step_{device.type}" + ("_compile" if args.compile else "") + \
        ("" if args.preset == "smollm2" else f"_{args.preset}")
    args.out = args.out or RESULTS / f"{name}.json"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

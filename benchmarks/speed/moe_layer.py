"""MoE layer speed: ours (the rule's path, and each path forced) vs k x one dense FFN vs transformers' own MoE
experts backends, in one process, on the CPU or a CUDA GPU.

For each shape and token count every implementation gets the same input and the same weights (so the same
routing), and the repetitions are interleaved round-robin (rotated each time, so none always follows the same
one) so that machine noise hits all of them alike; we report medians (CUDA: CUDA-event times).

  dense_x_k            one dense SwiGLU FFN on the N tokens, time x k: the FLOP-equivalent baseline
  upcycle              upcycle.core.moe.MoELayer, the path its rule picks (`grouped_ffn.kernel_path`)
  upcycle_grouped_mm   the same layer with grouped_mm forced
  upcycle_loop         the same layer with the per-expert loop forced
  hf_eager             transformers MixtralSparseMoeBlock, experts_implementation="eager"
  hf_grouped_mm        transformers MixtralSparseMoeBlock, experts_implementation="grouped_mm"
  (Qwen3-MoE's sparse block runs the same `@use_experts_implementation` experts code as Mixtral's.)

Shapes (E experts, k, D, F): smollm2 (8, 2, 576, 1536), mixtral (8, 2, 4096, 14336), olmoe (64, 8, 2048, 1024).
`--dtype`: float32 (weights and inputs), tf32 (float32 with TF32 matmuls, CUDA), bfloat16 (weights and inputs in
bf16), or `--autocast bf16` (float32 weights under autocast, as mixed-precision training runs). On CUDA each
measurement also records the peak memory a forward+backward allocates beyond the weights and the input.

Run:
  python benchmarks/speed/moe_layer.py                      # the CPU table: smollm2, N = 512, 4096, 16384, float32
  python benchmarks/speed/moe_layer.py --device cuda --shapes smollm2 mixtral olmoe --tokens 8192 32768 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import time
from pathlib import Path

import torch
from gpu_profile import profile
from transformers import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

from upcycle.core.ffn import FFNWeights
from upcycle.core.grouped_ffn import forced_kernel_path
from upcycle.core.moe import MoELayer
from upcycle.machine import machine
from upcycle.scripts import output_file

SHAPES = {"smollm2": (8, 2, 576, 1536), "mixtral": (8, 2, 4096, 14336), "olmoe": (64, 8, 2048, 1024)}
DTYPES = {"float32": torch.float32, "tf32": torch.float32, "bfloat16": torch.bfloat16}
RESULTS = Path(__file__).parents[1] / "results"


class Setting:
    """The run's device, dtype and autocast (one object, read by every timed call)."""

    def __init__(self, device: str, dtype: str, autocast: str | None) -> None:
        self.device = torch.device(device)
        self.dtype_name = dtype
        self.dtype = DTYPES[dtype]
        self.autocast = torch.bfloat16 if autocast == "bf16" else None
        self.profile: Path | None = None        # --profile: where each row's profiles go (CUDA)
        torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
        torch.backends.cudnn.allow_tf32 = dtype == "tf32"

    def precision(self):
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def build(shape: str, s: Setting, seed: int = 0):
    E, K, D, FF = SHAPES[shape]
    g = torch.Generator().manual_seed(seed)
    w_gate, w_up = torch.randn(E, FF, D, generator=g) * 0.02, torch.randn(E, FF, D, generator=g) * 0.02
    w_down, router = torch.randn(E, D, FF, generator=g) * 0.02, torch.randn(E, D, generator=g) * 0.02
    ours = MoELayer.from_init(FFNWeights(w_up=w_up, w_gate=w_gate, w_down=w_down, activation="silu"), router,
                              top_k=K, dtype=s.dtype).to(s.device)
    dense = FFNWeights(w_up=w_up[0].to(s.device, s.dtype).requires_grad_(),
                       w_gate=w_gate[0].to(s.device, s.dtype).requires_grad_(),
                       w_down=w_down[0].to(s.device, s.dtype).requires_grad_(), activation="silu")
    hf = {}
    for impl in ("eager", "grouped_mm"):
        config = MixtralConfig(hidden_size=D, intermediate_size=FF, num_local_experts=E, num_experts_per_tok=K,
                               hidden_act="silu", experts_implementation=impl)
        block = MixtralSparseMoeBlock(config)
        with torch.no_grad():
            block.gate.weight.copy_(router)
            block.experts.gate_up_proj.copy_(torch.cat([w_gate, w_up], dim=1))
            block.experts.down_proj.copy_(w_down)
        hf[f"hf_{impl}"] = block.to(s.device, s.dtype)
    del w_gate, w_up, w_down
    return ours, dense, hf


def timed(fn, x: torch.Tensor, backward: bool, s: Setting) -> tuple[float, int | None]:
    """(seconds, peak bytes allocated beyond what was allocated before the call, CUDA only)."""
    for p in getattr(fn, "params", None) or []:       # as optimizer.zero_grad(set_to_none=True) leaves them
        p.grad = None
    x = x.clone().requires_grad_(backward)
    s.sync()
    if s.device.type == "cuda":
        base = torch.cuda.memory_allocated(s.device)
        torch.cuda.reset_peak_memory_stats(s.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    else:
        t0 = time.perf_counter()
    if backward:
        with s.precision():
            y = fn(x)
        y.float().square().mean().backward()
    else:
        with torch.no_grad(), s.precision():
            fn(x)
    if s.device.type == "cuda":
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1000, torch.cuda.max_memory_allocated(s.device) - base
    return time.perf_counter() - t0, None


def measure(shape: str, n_tokens: int, reps: int, min_seconds: float, s: Setting) -> dict:
    E, K, D, FF = SHAPES[shape]
    ours, dense, hf = build(shape, s)
    x = torch.randn(1, n_tokens, D, generator=torch.Generator().manual_seed(1)).to(s.device, s.dtype)
    impls = {"dense": lambda t: dense(t.view(-1, D)), "upcycle": ours, **hf}
    for path in ("grouped_mm", "loop"):        # the two kernel paths of our layer, whatever the rule picks
        def forced(t, path=path):
            with forced_kernel_path(path):
                return ours(t)
        impls[f"upcycle_{path}"] = forced
    impls["dense"].params = list(dense.tensors().values())
    for module in (ours, *hf.values()):
        module.params = list(module.parameters())
    for path in ("grouped_mm", "loop"):
        impls[f"upcycle_{path}"].params = ours.params
    failed = {}
    with torch.no_grad(), s.precision():   # same routing and weights: the outputs must agree
        ref = ours(x).float()
        agreement = {}
        for name, block in hf.items():
            try:
                agreement[name] = (block(x).float() - ref).abs().max().item()
            except (RuntimeError, torch.OutOfMemoryError) as e:     # e.g. a dtype mismatch under autocast
                failed[name] = f"{type(e).__name__}: {str(e)[:200]}"
    for name in failed:
        impls.pop(name)
    result = {"shape": shape, "experts": E, "top_k": K, "hidden": D, "intermediate": FF, "tokens": n_tokens,
              "max_abs_diff_vs_upcycle": agreement, "failed": failed}
    for mode, backward in (("forward", False), ("forward_backward", True)):
        times = {name: [] for name in impls}
        peaks: dict[str, int | None] = {}
        warm = {}
        for name, fn in impls.items():
            timed(fn, x, backward, s)                                  # first call: caches, workspaces
            warm[name], peaks[name] = timed(fn, x, backward, s)
        # short calls are noisier: each implementation repeats until it has run about `min_seconds`, at least
        # `reps` times; a slow one (transformers' eager loop over olmoe's 64 experts) stops at `reps`, instead of
        # running as often as the fastest needs (that row did not finish in 85 s on an H200)
        n_reps = {name: max(reps, math.ceil(min_seconds / t)) for name, t in warm.items()}
        names = list(impls)
        for rep in range(max(n_reps.values())):  # round-robin, rotated each repetition so none always runs first
            for name in names[rep % len(names):] + names[: rep % len(names)]:
                if len(times[name]) < n_reps[name]:
                    times[name].append(timed(impls[name], x, backward, s)[0])
        med = {name: statistics.median(t) for name, t in times.items()}
        baseline = K * med["dense"]
        best_hf = min((med[n] for n in hf if n in med), default=None)
        result[mode] = {
            "reps": n_reps,                 # per implementation
            "median_s": {"dense_x_k": baseline, **{n: v for n, v in med.items() if n != "dense"}},
            "ratio_to_dense_x_k": {n: v / baseline for n, v in med.items() if n != "dense"},
            "upcycle_vs_best_hf": med["upcycle"] / best_hf if best_hf else None,
            "upcycle_vs_hf_grouped_mm": med["upcycle"] / med["hf_grouped_mm"] if "hf_grouped_mm" in med else None,
            "peak_bytes": {n: v for n, v in peaks.items() if v is not None} or None,
        }
    if s.profile is not None and s.device.type == "cuda":        # one fwd+bwd of ours and of transformers' best
        for name in ("upcycle", "hf_grouped_mm"):
            if name in impls:
                profile(f"{shape}_{n_tokens}_{name}", lambda step, fn=impls[name]: timed(fn, x, True, s), s.device,
                        s.profile, steps=3)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shapes", nargs="+", default=["smollm2"], choices=SHAPES)
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 4096, 16384])
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument("--autocast", choices=["bf16"], help="run under autocast in this dtype (float32 weights)")
    parser.add_argument("--reps", type=int, default=7, help="at least this many timed repetitions")
    parser.add_argument("--min-seconds", type=float, default=3.0, help="repeat short calls to fill this time")
    parser.add_argument("--out", type=output_file)
    parser.add_argument("--profile", type=Path, help="CUDA: also profile each row's fwd+bwd of upcycle and "
                                                     "hf_grouped_mm into this folder (benchmarks/speed/gpu_profile.py)")
    args = parser.parse_args()
    from upcycle.scripts import check_device, check_positive

    check_device(parser, args.device)
    check_positive(parser, tokens=args.tokens, reps=args.reps)
    s = Setting(args.device, args.dtype, args.autocast)
    s.profile = args.profile
    default_name = "moe_layer" + ("" if s.device.type == "cpu" else f"_{s.device.type}") + \
        ("_bf16" if args.autocast else "" if args.dtype == "float32" else f"_{args.dtype}")
    args.out = args.out or RESULTS / f"{default_name}.json"
    torch.manual_seed(0)
    runs = []
    started = time.time()
    command = ["python benchmarks/speed/moe_layer.py", "--device", args.device, "--shapes", *args.shapes,
               "--tokens", *map(str, args.tokens), "--dtype", args.dtype, "--reps", str(args.reps),
               "--min-seconds", str(args.min_seconds)] + (["--autocast", args.autocast] if args.autocast else [])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for shape in args.shapes:
        for n in args.tokens:
            runs.append(measure(shape, n, args.reps, args.min_seconds, s))
            if s.device.type == "cuda":         # the last measurement's layers are gone: give their memory back
                torch.cuda.empty_cache()
            fb = runs[-1]["forward_backward"]
            print(f"{shape} N={n:6d} fwd+bwd / dense_x_k: " + "  ".join(f"{k} {v:.2f}x" for k, v in
                                                                     fb["ratio_to_dense_x_k"].items())
                  + (f"  | upcycle / best hf {fb['upcycle_vs_best_hf']:.2f}" if fb["upcycle_vs_best_hf"] else ""),
                  flush=True)
            # written after every row (whole, by rename): a run stopped at a time limit keeps the rows it measured
            out = {"benchmark": "moe_layer", "setting": {"device": args.device, "dtype": args.dtype,
                                                          "autocast": args.autocast, "activation": "silu",
                                                          "reps": args.reps},
                   "machine": machine(s.device), "results": runs, "seconds": round(time.time() - started, 1),
                   "complete": len(runs) == len(args.shapes) * len(args.tokens), "command": " ".join(command)}
            tmp = args.out.with_name(f".{args.out.name}.tmp")
            tmp.write_text(json.dumps(out, indent=2))
            tmp.replace(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

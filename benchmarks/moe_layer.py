"""MoE layer speed: ours vs k x one dense FFN vs transformers' own MoE experts backends, in one process.

Setting (issue #2): E=8 experts, top-k=2, SmolLM2's D=576 / F=1536 SwiGLU, float32, N tokens in {512, 4096,
16384}. For each N every implementation gets the same input and the same weights (so the same routing), and
the repetitions are interleaved round-robin (rotated each time, so none always follows the same one) so
that machine noise hits all of them alike; we report medians.

  dense_x_k          one dense SwiGLU FFN on the N tokens, time x k: the FLOP-equivalent baseline
  upcycle            upcycle.core.moe.MoELayer
  hf_eager           transformers MixtralSparseMoeBlock, experts_implementation="eager"
  hf_grouped_mm      transformers MixtralSparseMoeBlock, experts_implementation="grouped_mm"
  (Qwen3-MoE's sparse block runs the same `@use_experts_implementation` experts code as Mixtral's.)

With `--autocast bf16` every implementation runs under torch.autocast("cpu", bfloat16) (weights float32, as in
mixed-precision training) and the results go to moe_layer_bf16.json; an implementation that fails under autocast
is recorded with its error instead of a time.

Run: python benchmarks/moe_layer.py [--tokens 512 4096 16384] [--reps 7] [--min-seconds 3] [--autocast bf16]
     -> benchmarks/results/moe_layer.json (moe_layer_bf16.json)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import transformers
from transformers import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

from upcycle.core.ffn import FFNWeights
from upcycle.core.grouped_ffn import forced_kernel_path
from upcycle.core.moe import MoELayer

E, K, D, FF = 8, 2, 576, 1536
RESULTS = Path(__file__).parent / "results"
AUTOCAST: dict = {"dtype": None}     # set by --autocast: every timed call runs under CPU autocast in that dtype


def precision():
    dtype = AUTOCAST["dtype"]
    return torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()


def machine() -> dict:
    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__}


def build(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w_gate, w_up = torch.randn(E, FF, D, generator=g) * 0.02, torch.randn(E, FF, D, generator=g) * 0.02
    w_down, router = torch.randn(E, D, FF, generator=g) * 0.02, torch.randn(E, D, generator=g) * 0.02
    ours = MoELayer.from_init(FFNWeights(w_up=w_up, w_gate=w_gate, w_down=w_down, activation="silu"), router, top_k=K)
    dense = FFNWeights(w_up=w_up[0].clone().requires_grad_(), w_gate=w_gate[0].clone().requires_grad_(),
                       w_down=w_down[0].clone().requires_grad_(), activation="silu")
    hf = {}
    for impl in ("eager", "grouped_mm"):
        config = MixtralConfig(hidden_size=D, intermediate_size=FF, num_local_experts=E, num_experts_per_tok=K,
                               hidden_act="silu", experts_implementation=impl)
        block = MixtralSparseMoeBlock(config)
        with torch.no_grad():
            block.gate.weight.copy_(router)
            block.experts.gate_up_proj.copy_(torch.cat([w_gate, w_up], dim=1))
            block.experts.down_proj.copy_(w_down)
        hf[f"hf_{impl}"] = block
    return ours, dense, hf


def timed(fn, x: torch.Tensor, backward: bool) -> float:
    for p in getattr(fn, "params", None) or []:       # as optimizer.zero_grad(set_to_none=True) leaves them
        p.grad = None
    start = time.perf_counter()
    if backward:
        with precision():
            y = fn(x)
        y.float().square().mean().backward()
    else:
        with torch.no_grad(), precision():
            fn(x)
    return time.perf_counter() - start


def measure(n_tokens: int, reps: int, min_seconds: float) -> dict:
    ours, dense, hf = build()
    x = torch.randn(1, n_tokens, D, generator=torch.Generator().manual_seed(1))
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
    with torch.no_grad(), precision():   # same routing and weights: the outputs must agree (float32: exactly)
        ref = ours(x).float()
        agreement = {}
        for name, block in hf.items():
            try:
                agreement[name] = (block(x).float() - ref).abs().max().item()
            except RuntimeError as e:     # e.g. a dtype mismatch under autocast
                failed[name] = f"{type(e).__name__}: {str(e)[:200]}"
    for name in failed:
        impls.pop(name)
    result = {"tokens": n_tokens, "max_abs_diff_vs_upcycle": agreement, "failed": failed}
    for mode, backward in (("forward", False), ("forward_backward", True)):
        times = {name: [] for name in impls}
        warm = {name: timed(fn, x.clone().requires_grad_(backward), backward) for name, fn in impls.items()}
        # short calls are noisier: repeat them until each implementation has run about `min_seconds`
        n_reps = max(reps, math.ceil(min_seconds / min(warm.values())))
        names = list(impls)
        for rep in range(n_reps):       # round-robin, rotated each repetition so no one always runs first
            for name in names[rep % len(names):] + names[: rep % len(names)]:
                times[name].append(timed(impls[name], x.clone().requires_grad_(backward), backward))
        med = {name: statistics.median(t) for name, t in times.items()}
        baseline = K * med["dense"]
        result[mode] = {
            "reps": n_reps,
            "median_s": {"dense_x_k": baseline, **{n: v for n, v in med.items() if n != "dense"}},
            "ratio_to_dense_x_k": {n: v / baseline for n, v in med.items() if n != "dense"},
            "upcycle_vs_best_hf": med["upcycle"] / min(med[n] for n in hf if n in med) if set(hf) & set(med)
            else None,
            "upcycle_vs_hf_grouped_mm": med["upcycle"] / med["hf_grouped_mm"] if "hf_grouped_mm" in med else None,
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 4096, 16384])
    parser.add_argument("--reps", type=int, default=7, help="at least this many timed repetitions")
    parser.add_argument("--min-seconds", type=float, default=3.0, help="repeat short calls to fill this time")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--autocast", choices=["bf16"], help="run under CPU autocast in this dtype")
    args = parser.parse_args()
    AUTOCAST["dtype"] = torch.bfloat16 if args.autocast == "bf16" else None
    args.out = args.out or RESULTS / ("moe_layer_bf16.json" if args.autocast else "moe_layer.json")
    torch.manual_seed(0)
    runs = []
    for n in args.tokens:
        runs.append(measure(n, args.reps, args.min_seconds))
        fb = runs[-1]["forward_backward"]["ratio_to_dense_x_k"]
        fw = runs[-1]["forward"]["ratio_to_dense_x_k"]
        print(f"N={n:6d}  fwd: " + "  ".join(f"{k} {v:.2f}x" for k, v in fw.items())
              + "  | fwd+bwd: " + "  ".join(f"{k} {v:.2f}x" for k, v in fb.items()), flush=True)
    out = {"benchmark": "moe_layer", "setting": {"num_experts": E, "top_k": K, "hidden": D, "intermediate": FF,
                                                  "dtype": "float32", "activation": "silu", "reps": args.reps,
                                                  "autocast": args.autocast},
           "machine": machine(), "results": runs,
           "command": "python benchmarks/moe_layer.py " + " ".join(["--tokens", *map(str, args.tokens),
                                                                    "--reps", str(args.reps),
                                                                    "--min-seconds", str(args.min_seconds)]
                                                                   + (["--autocast", args.autocast] if args.autocast
                                                                      else []))}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

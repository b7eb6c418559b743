"""Delta experts against full experts and the dense FFN: one MoE layer's forward + backward at SmolLM2-135M's shape
(8 experts, top-2, D 576, F 1536), on the CPU, in one process.

  dense        the dense SwiGLU FFN on the N tokens: the compute a delta layer should stay near
  full         8 full experts (`core.moe.Experts`, the path its rule picks), top-2
  delta_r      8 experts as the dense FFN plus rank-r deltas (`core.delta_experts.DeltaExperts`), top-2

Every implementation gets the same tokens and the same routing (k distinct experts per token, weights summing to
1); the repetitions are interleaved round-robin (rotated each time) so that machine noise hits all alike, and the
medians are reported with each one's ratio to the dense FFN, the parameters it holds and the peak bytes a forward +
backward keeps live beyond its weights and input (`training.memory.peak.measure_peak`: every tensor's storage
followed). A layer is not a training step: the step's optimizer state scales with the parameters, which the JSON
gives.

    python benchmarks/speed/delta_layer.py [--tokens 2048] [--reps 7] [--ranks 16 64] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from upcycle.core.delta_experts import DeltaExperts
from upcycle.core.expert_shape import ExpertShape
from upcycle.core.ffn import FFNWeights
from upcycle.core.moe import Experts
from upcycle.machine import machine
from upcycle.scripts import check_positive, output_file
from upcycle.training.memory.peak import measure_peak

E, K, D, F_ = 8, 2, 576, 1536
RESULTS = Path(__file__).parents[1] / "results" / "delta_layer.json"


def dense_ffn(g: torch.Generator) -> FFNWeights:
    return FFNWeights(w_gate=torch.randn(F_, D, generator=g) * 0.02, w_up=torch.randn(F_, D, generator=g) * 0.02,
                      w_down=torch.randn(D, F_, generator=g) * 0.02, activation="silu")


def routing(T: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids_TK = torch.rand(T, E, generator=g).topk(K, dim=-1).indices
    w_TK = torch.softmax(torch.randn(T, K, generator=g), -1)
    ids_N, order = torch.sort(ids_TK.reshape(-1), stable=True)
    return order // K, w_TK.reshape(-1)[order], torch.bincount(ids_N, minlength=E)


def implementations(dense: FFNWeights, ranks: list[int], g: torch.Generator) -> dict:
    """name -> (module, call(x) -> y)."""
    shape = ExpertShape.of(dense)
    made = {}
    ffn = torch.nn.ModuleDict({"gate": torch.nn.Linear(D, F_, bias=False), "up": torch.nn.Linear(D, F_, bias=False),
                               "down": torch.nn.Linear(F_, D, bias=False)})
    with torch.no_grad():
        ffn["gate"].weight.copy_(dense.w_gate)
        ffn["up"].weight.copy_(dense.w_up)
        ffn["down"].weight.copy_(dense.w_down)
    made["dense"] = (ffn, lambda x, s: ffn["down"](torch.nn.functional.silu(ffn["gate"](x)) * ffn["up"](x)))
    full = Experts(E, shape)
    full.load_weights(dense.repeat(E).map(lambda t: t + 0.001 * torch.randn(t.shape, generator=g)))
    made["full"] = (full, lambda x, s: full(x, *s))
    for r in ranks:
        delta = DeltaExperts(E, shape, r)
        delta.load_base(dense)
        delta.load_deltas({name: (torch.randn(a.shape, generator=g) * 0.01, b.detach().clone())
                           for name, (_, a, b) in delta._pairs().items()})
        made[f"delta_r{r}"] = (delta, lambda x, s, delta=delta: delta(x, *s))
    return made


def step(module: torch.nn.Module, call, x: torch.Tensor, slots) -> None:
    module.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    call(x, slots).pow(2).mean().backward()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--out", type=output_file, default=RESULTS)
    args = parser.parse_args()
    check_positive(parser, tokens=args.tokens, reps=args.reps, ranks=args.ranks)
    if max(args.ranks) > min(D, F_):
        parser.error(f"--ranks must be at most min(D, F) = {min(D, F_)}, got {max(args.ranks)}")
    g = torch.Generator().manual_seed(0)
    dense = dense_ffn(g)
    made = implementations(dense, args.ranks, g)
    x = torch.randn(args.tokens, D, generator=g)
    slots = routing(args.tokens, g)
    names = list(made)
    for name in names:                   # one warm-up each
        step(*made[name], x, slots)
    times = {name: [] for name in names}
    for rep in range(args.reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            started = time.perf_counter()
            step(*made[name], x, slots)
            times[name].append(time.perf_counter() - started)
    rows = {}
    for name in names:
        module, call = made[name]
        peak = measure_peak(lambda module=module, call=call: step(module, call, x, slots)).peak_bytes
        median = statistics.median(times[name])
        rows[name] = {"median_s": median, "times_s": times[name],
                      "parameters": sum(p.numel() for p in module.parameters()), "peak_bytes": peak}
    for row in rows.values():
        row["time_vs_dense"] = row["median_s"] / rows["dense"]["median_s"]
        row["peak_vs_dense"] = row["peak_bytes"] / rows["dense"]["peak_bytes"]
        row["parameters_vs_dense"] = row["parameters"] / rows["dense"]["parameters"]
    result = {"what": "one layer's forward + backward, float32, CPU", "shape": {"E": E, "k": K, "D": D, "F": F_},
              "tokens": args.tokens, "reps": args.reps, "threads": torch.get_num_threads(), "machine": machine(),
              "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for name, row in rows.items():
        print(f"{name:10s} {row['median_s'] * 1e3:8.1f} ms  x{row['time_vs_dense']:.2f} time  "
              f"x{row['peak_vs_dense']:.2f} peak  x{row['parameters_vs_dense']:.2f} parameters")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

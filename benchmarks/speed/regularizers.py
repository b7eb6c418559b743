"""Cost of the regularizers on a SmolLM2 MoE training step: DPSL, and EESD with a full or uncertain-only teacher.

Model: the embedded SmolLM2-135M upcycled with `drop` (experts differ, as EESD assumes), every other block
(15 MoE layers), E = 8, k = 2, float32; AdamW; causal-LM loss on Wikipedia rows of 256 tokens. Each
configuration runs in a fresh child process (so its peak RSS is its own): one warm-up step, then `--steps`
timed steps (median).

  plain           task loss only
  eesd            + EESD, teacher on every token (docs/methods.md §4.6)
  eesd_uncertain  + EESD, teacher on the 25% most uncertain tokens (highest routing entropy)

Inside the EESD runs, hooks time the teacher itself and every MoE layer's forward. Theory: the teacher runs E
expert forwards per token, an MoE layer's forward + backward about 3k, so teacher / MoE layers = E / (3k) = 1.33
(times the fraction of tokens for the uncertain-only teacher). The MoE layers' forward + backward is estimated as
3 x their measured forward.

DPSL: forward + backward of `dpsl` on B = 73,728 tokens x 16 experts, alpha = 1 and 0.75, with each Beta-CDF
backend side by side (the on-device continued fraction, `torch`, and scipy.special.betainc, `scipy`, which `auto`
uses for CPU tensors), median of repetitions, interleaved; plus the largest difference between the two losses.
(A share of a CPU training step says little about a GPU run, so it is no longer reported.) `--only dpsl`
rewrites just this section of the JSON.

Effect of the uncertain-only teacher: on one batch, the share of the full EESD loss (per-token squared error
against the ensemble) that the 25% highest-entropy tokens carry, against the 25% a random subset carries.

Run: .venv/bin/python benchmarks/speed/regularizers.py [--steps 3] -> benchmarks/results/regularizers.json
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from upcycle.machine import machine
from upcycle.scripts import output_file

ROWS = 256



def time_dpsl(tokens: int = 73_728, experts: int = 16, reps: int = 7) -> dict:
    """dpsl forward + backward per (alpha, backend), repetitions interleaved across the backends."""
    import upcycle.training.loss.dpsl as module
    from upcycle.training.loss.dpsl import dpsl

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(tokens, experts, generator=g).requires_grad_(True)
    real_cdf = module.beta_cdf
    rows = []
    for alpha in (1.0, 0.75):
        times: dict[str, list[float]] = {"torch": [], "scipy": []}
        losses = {}
        for rep in range(reps + 1):
            for backend in times:
                module.beta_cdf = lambda *a, backend_=backend, **k: real_cdf(*a, backend=backend_, **k)
                t = time.perf_counter()
                loss = dpsl(logits.softmax(-1), alpha)
                loss.backward()
                if rep:                                 # the first round warms up
                    times[backend].append(time.perf_counter() - t)
                losses[backend] = float(loss.detach())
                logits.grad = None
        module.beta_cdf = real_cdf
        medians = {b: statistics.median(ts) for b, ts in times.items()}
        rows.append({"alpha": alpha, "median_s": medians, "torch_over_scipy": medians["torch"] / medians["scipy"],
                     "loss_difference": abs(losses["torch"] - losses["scipy"])})
    return {"tokens": tokens, "experts": experts, "reps": reps, "auto_backend_on_cpu": "scipy", "rows": rows}


def child(mode: str, tokens: int, steps: int) -> dict:
    from upcycle.checkpoint.loading import load_dense
    from upcycle.config import CalibrationConfig, ConvertConfig, RegularizerConfig
    from upcycle.config_reader import build
    from upcycle.conversion.pipeline import upcycle_model
    from upcycle.core.moe import moe_layers
    from upcycle.data.model_inputs import text_batches
    from upcycle.data.text import wikipedia_split
    from upcycle.training.loss.objective import Objective
    from upcycle.training.step import train_step

    torch.manual_seed(0)
    model, tokenizer = load_dense("default")
    upcycle_model(model, build(ConvertConfig, {"method": "drop", "moe": {"num_experts": 8, "top_k": 2},
                                               "placement": {"every": 2}}), progress=False)
    rows = tokens // ROWS
    batches = [b for b in text_batches(tokenizer, wikipedia_split()[0], CalibrationConfig(
                                           tokens=tokens * (steps + 1), sequence_length=ROWS, batch_size=rows), seed=0)
               if b["input_ids"].shape == (rows, ROWS)][: steps + 1]
    reg_cfg = {"plain": RegularizerConfig(),
               "eesd": RegularizerConfig(eesd=1.0),
               "eesd_uncertain": RegularizerConfig(eesd=1.0, eesd_uncertain_fraction=0.25)}[mode]
    reg = Objective(model, reg_cfg)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)

    clock = {"teacher": 0.0, "moe_forward": 0.0}
    if reg.teacher is not None:
        import upcycle.training.loss.teacher as teacher_module
        original = teacher_module.ensemble_output

        def timed(*args, **kwargs):
            t = time.perf_counter()
            out = original(*args, **kwargs)
            clock["teacher"] += time.perf_counter() - t
            return out
        teacher_module.ensemble_output = timed
    starts = {}
    for name, layer in moe_layers(model).items():
        layer.register_forward_pre_hook(lambda m, a, _n=name: starts.__setitem__(_n, time.perf_counter()))
        # registered after the teacher's hook, so this one runs after the teacher: subtract the teacher's share
        layer.register_forward_hook(lambda m, a, o, _n=name: clock.__setitem__(
            "moe_forward", clock["moe_forward"] + time.perf_counter() - starts[_n]))

    step_times, teacher_times, moe_times = [], [], []
    for i, batch in enumerate(batches):
        clock.update(teacher=0.0, moe_forward=0.0)
        t = time.perf_counter()
        train_step(model, batch, optimizer, reg)
        if i:   # the first step warms up allocators and caches
            step_times.append(time.perf_counter() - t)
            teacher_times.append(clock["teacher"])
            moe_times.append(clock["moe_forward"] - clock["teacher"])
    effect = uncertain_share(model, reg.teacher, batches[0]) if mode == "eesd" else None
    return {"mode": mode, "tokens_per_step": rows * ROWS, "steps_timed": len(step_times), "effect": effect,
            "step_median_s": statistics.median(step_times), "teacher_median_s": statistics.median(teacher_times),
            "moe_forward_median_s": statistics.median(moe_times),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


@torch.no_grad()
def uncertain_share(model, teacher, batch: dict, fraction: float = 0.25) -> dict:
    """The effect of an uncertain-only teacher: the share of the full EESD loss (per-token squared errors
    against the all-expert ensemble) carried by the `fraction` of tokens with the highest routing entropy,
    against `fraction` (what a random subset carries on average), mean over MoE layers."""
    from upcycle.core.moe import moe_layers
    from upcycle.training.loss.teacher import ensemble_output

    teacher.enabled = False
    seen, shares = {}, []
    handles = [layer.register_forward_hook(lambda m, a, o, _n=name: seen.__setitem__(_n, (a[0], o)))
               for name, layer in moe_layers(model).items()]
    model.train()
    model(**batch)
    for h in handles:
        h.remove()
    for name, layer in moe_layers(model).items():
        x, y = (t.reshape(-1, t.shape[-1]) for t in seen[name])
        err_T = ((y - ensemble_output(teacher.teachers[name], x)) ** 2).sum(-1)
        probs = layer.last_record.probs_TE
        entropy_T = -torch.special.xlogy(probs, probs).sum(-1)
        top = entropy_T.topk(int(fraction * entropy_T.numel())).indices
        shares.append(float(err_T[top].sum() / err_T.sum()))
    teacher.enabled = True
    return {"fraction": fraction, "loss_share_of_uncertain_tokens": sum(shares) / len(shares),
            "per_layer": shares}


def run_child(mode: str, tokens: int, steps: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", mode, str(tokens), str(steps)],
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{mode} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=output_file,
                        default=str(Path(__file__).parents[1] / "results" / "regularizers.json"))
    parser.add_argument("--only", choices=["dpsl"], help="rerun only this section, keeping the rest of --out")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), int(args.child[2]))))
        return

    info = machine()
    dpsl_time = {**time_dpsl(), "machine": info}
    for row in dpsl_time["rows"]:
        print(f"dpsl fwd+bwd at 73,728 x 16, alpha {row['alpha']}: torch {row['median_s']['torch'] * 1000:.0f} ms, "
              f"scipy {row['median_s']['scipy'] * 1000:.0f} ms", flush=True)
    if args.only == "dpsl":
        results = json.loads(Path(args.out).read_text())
        results["dpsl"] = dpsl_time
        for stale in ("dpsl_fraction_of_step", "step_s_at_73728_tokens_extrapolated"):
            results.pop(stale, None)
        Path(args.out).write_text(json.dumps(results, indent=2))
        print(f"wrote the dpsl section of {args.out}")
        return
    runs = {}
    for mode, tokens in (("plain_half", args.tokens // 2), ("plain", args.tokens), ("eesd", args.tokens),
                         ("eesd_uncertain", args.tokens)):
        runs[mode] = run_child(mode.removesuffix("_half"), tokens, args.steps)
        print(f"{mode}: {runs[mode]}", flush=True)
    # step(T) = fixed + per_token * T through the two measured points (the optimizer step over all 413M
    # parameters is a fixed cost of several seconds on this CPU)
    (t1, s1), (t2, s2) = ((runs[m]["tokens_per_step"], runs[m]["step_median_s"]) for m in ("plain_half", "plain"))
    per_token = (s2 - s1) / (t2 - t1)
    fixed = s1 - per_token * t1
    k, E = 2, 8
    eesd = {}
    for mode, fraction in (("eesd", 1.0), ("eesd_uncertain", 0.25)):
        r = runs[mode]
        moe_fwd_bwd = 3 * r["moe_forward_median_s"]
        eesd[mode] = {
            "step_time_overhead": r["step_median_s"] / runs["plain"]["step_median_s"] - 1,
            "peak_rss_overhead_mb": r["peak_rss_mb"] - runs["plain"]["peak_rss_mb"],
            "peak_rss_overhead": r["peak_rss_mb"] / runs["plain"]["peak_rss_mb"] - 1,
            "teacher_over_moe_layers": r["teacher_median_s"] / moe_fwd_bwd,
            "theory_teacher_over_moe_layers": fraction * E / (3 * k),
        }
    results = {
        "benchmark": "regularizer cost on a SmolLM2-135M MoE step (drop, every other block, E=8, k=2, float32)",
        "machine": info, "dpsl": dpsl_time, "runs": runs,
        "step_s_per_token": per_token, "step_s_fixed": fixed,
        "linearity_check": {"tokens": [runs["plain_half"]["tokens_per_step"], runs["plain"]["tokens_per_step"]],
                            "step_s": [runs["plain_half"]["step_median_s"], runs["plain"]["step_median_s"]]},
        "eesd": eesd,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    results["eesd"]["eesd_uncertain"]["effect"] = runs["eesd"]["effect"]
    print(json.dumps({k: results[k] for k in ("dpsl", "linearity_check", "eesd")}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""Delta experts in a whole training step: the dense model, its copy-upcycled MoE with full experts and with delta
experts (the dense FFN plus rank-r changes, `moe.experts: delta`), side by side in one process, on the CPU.

Models (random weights of SmolLM2-135M's shapes: 30 blocks, D 576, F 1536, 9 heads, 3 KV heads, vocabulary 49,152,
tied embeddings; the MoE ones 8 experts top-2 in every other block, the recipes' placement):
  dense              LlamaForCausalLM
  full               copy-upcycled, 8 full experts per MoE layer
  delta_r<R>         copy-upcycled as delta experts of rank R, base trained
  delta_r<R>_frozen  the same with `moe.train_base: false` (the deltas alone train; AdamW holds no base state)
Every model runs `upcycle.training.step.train_step` as the trainer does (AdamW, clipping at 1, the load-balance
loss at 0.01 on the MoE models), float32, on the same batches. The timed steps are interleaved round-robin (rotated
each round) so that machine noise hits every model alike; the medians are reported with each one's ratio to the
dense step. Peak memory is the step's: the parameters' bytes plus the most bytes live during the first step of a
fresh optimizer (gradients, AdamW's state, activations; `training.memory.peak.measure_peak` follows every tensor's
storage), so that it counts what a run holds at its peak.

    python benchmarks/speed/delta_step.py [--ranks 16 64] [--batch-size 4] [--sequence-length 256] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import transformers

from upcycle.config import CheckConfig, ConvertConfig, MoEConfig, PlacementConfig, RegularizerConfig, TrainConfig
from upcycle.conversion.pipeline import upcycle_model
from upcycle.conversion.preservation import count_parameters
from upcycle.machine import machine
from upcycle.scripts import check_positive, output_file
from upcycle.training.loss.objective import Objective
from upcycle.training.memory.peak import measure_peak
from upcycle.training.optimizer import make_optimizer
from upcycle.training.step import StepSetup, train_step

RESULTS = Path(__file__).parents[1] / "results" / "delta_step.json"
SHAPES = {"layers": 30, "hidden": 576, "intermediate": 1536, "heads": 9, "kv_heads": 3, "vocab": 49152,
          "experts": 8, "top_k": 2, "every": 2}


def build(name: str) -> torch.nn.Module:
    s = SHAPES
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["intermediate"],
        num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
        tie_word_embeddings=True, max_position_embeddings=4096))
    if name != "dense":
        kind = {"experts": "full"} if name == "full" else {
            "experts": "delta", "delta_rank": int(name.split("_r")[1].split("_")[0]),
            "train_base": not name.endswith("_frozen")}
        cfg = ConvertConfig(method="copy", moe=MoEConfig(num_experts=s["experts"], top_k=s["top_k"], **kind),
                            placement=PlacementConfig(every=s["every"]),
                            check=CheckConfig(sequences=2, tokens=64, per_layer=False, end_to_end=False))
        upcycle_model(model, cfg, progress=False)
    return model.train()


class Runner:
    """A model, its optimizer and objective, and the step as the trainer runs it."""

    def __init__(self, name: str, batch: dict) -> None:
        from accelerate import Accelerator

        self.model = build(name)
        self.accelerator = Accelerator(cpu=True)
        self.cfg = TrainConfig(lr=1e-4, batch_size=batch["input_ids"].shape[0],
                               sequence_length=batch["input_ids"].shape[1])
        self.objective = Objective(self.model, RegularizerConfig(load_balance=0.01 if name != "dense" else 0.0))
        self.batch = batch
        self.optimizer = None
        self.steps = 0

    def fresh_optimizer(self) -> None:
        self.optimizer = make_optimizer(self.model, self.cfg)

    def step(self) -> float:
        result = train_step(self.model, self.batch, self.optimizer, self.objective,
                            StepSetup(accelerator=self.accelerator, clip_grad=1.0), step=self.steps)
        self.steps += 1
        return float(result.loss["total"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--sequence-length", type=int, default=256)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=output_file, default=RESULTS)
    args = parser.parse_args()
    check_positive(parser, ranks=args.ranks, batch_size=args.batch_size, sequence_length=args.sequence_length,
                   reps=args.reps)
    if max(args.ranks) > min(SHAPES["hidden"], SHAPES["intermediate"]):
        parser.error(f"--ranks must be at most {min(SHAPES['hidden'], SHAPES['intermediate'])}")
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, SHAPES["vocab"], (args.batch_size, args.sequence_length), generator=g),
             "attention_mask": torch.ones(args.batch_size, args.sequence_length, dtype=torch.long)}
    names = ["dense", "full", *(f"delta_r{r}" for r in args.ranks), f"delta_r{args.ranks[0]}_frozen"]
    started = time.time()
    rows, runners = {}, {}
    for name in names:      # built one at a time: each one's peak measured alone, before the others exist
        runner = runners[name] = Runner(name, batch)
        params = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        runner.fresh_optimizer()
        step_peak = measure_peak(runner.step).peak_bytes       # the first step: grads and AdamW's state made
        counted = count_parameters(runner.model)
        rows[name] = {"parameters": counted["total"], "active_per_token": counted["active_per_token"],
                      "trainable": sum(p.numel() for p in runner.model.parameters() if p.requires_grad),
                      "parameter_bytes": params, "step_peak_bytes": step_peak, "peak_bytes": params + step_peak}
        print(f"{name:16s} built; peak {rows[name]['peak_bytes'] / 2**30:.2f} GiB", flush=True)
    for runner in runners.values():             # a warm-up step each
        runner.step()
    times = {name: [] for name in names}
    for rep in range(args.reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            t0 = time.perf_counter()
            runners[name].step()
            times[name].append(time.perf_counter() - t0)
    for name, row in rows.items():
        row["step_s_median"] = statistics.median(times[name])
        row["step_s"] = times[name]
    for row in rows.values():
        row["time_vs_dense"] = row["step_s_median"] / rows["dense"]["step_s_median"]
        row["peak_vs_dense"] = row["peak_bytes"] / rows["dense"]["peak_bytes"]
        row["parameters_vs_dense"] = row["parameters"] / rows["dense"]["parameters"]
    command = (f"python benchmarks/speed/delta_step.py --ranks {' '.join(map(str, args.ranks))} --batch-size "
               f"{args.batch_size} --sequence-length {args.sequence_length} --reps {args.reps}")
    result = {"benchmark": "delta_step", "what": "one training step (forward, backward, AdamW), float32, CPU",
              "shapes": SHAPES, "batch": [args.batch_size, args.sequence_length], "reps": args.reps,
              "threads": torch.get_num_threads(), "machine": machine(), "rows": rows,
              "seconds": round(time.time() - started, 1), "command": command}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for name, row in rows.items():
        print(f"{name:16s} {row['step_s_median']:7.2f} s  x{row['time_vs_dense']:.2f} time  "
              f"x{row['peak_vs_dense']:.2f} peak  x{row['parameters_vs_dense']:.2f} parameters")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

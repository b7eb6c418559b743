"""Contrastive training speed of the embedded all-MiniLM-L6-v2 (`minilm`): upcycle's training step, dense and
copy-upcycled, beside sentence-transformers' own trainer on the same work.

Rows (each a fresh model, the same pairs in the same order, the same batch, length and learning rate):
  upcycle_dense           upcycle's step (`train_step` with the contrastive task, as `upcycle train` runs it:
                          batches made ahead, length-bucketed chunks) on the dense encoder
  upcycle_moe             the same on the copy-upcycled encoder: 8 experts, top-2, every other block, load balance
                          0.01 (MoE layers route and compute the real tokens alone)
  upcycle_dense_padded,   the same two with every batch padded to its longest text (one chunk): what the step
  upcycle_moe_padded      computed before length bucketing
  sentence_transformers   sentence-transformers' SentenceTransformerTrainer with MultipleNegativesRankingLoss
                          (scale 20 = upcycle's temperature 0.05) on the dense encoder, its batches in the same
                          order; needs the `datasets` package (the row is left out, with the reason, without it)
Per row: real tokens per second (median step time over the timed steps after warm-up) and positions computed per
real token. bf16 autocast on a GPU, float32 on the CPU; AdamW at lr 1e-4 (fused on a GPU).

    .venv/bin/python benchmarks/speed/contrastive_step.py                          # CPU: batch 64, then 512 x 64
    .venv/bin/python benchmarks/speed/contrastive_step.py --batch-size 512 --rows upcycle_dense,upcycle_moe --add
    python benchmarks/speed/contrastive_step.py --device cuda --batch-size 512     # a GPU
Writes benchmarks/results/contrastive_step.json (or --out), with the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from upcycle.config import ConvertConfig, MoEConfig, PlacementConfig, RegularizerConfig, TrainConfig
from upcycle.machine import machine
from upcycle.scripts import output_file
from upcycle.training.step import PlainTorch

RESULTS = Path(__file__).resolve().parents[1] / "results"
ROWS = ("upcycle_dense", "upcycle_moe", "upcycle_dense_padded", "upcycle_moe_padded", "sentence_transformers")
LR = 1e-4
TEMPERATURE = 0.05


def encoder(moe: bool, device: torch.device):
    from upcycle.checkpoint.loading import load_model
    from upcycle.conversion.pipeline import upcycle_model
    from upcycle.data.assets import minilm_path

    model, tokenizer = load_model(str(minilm_path()))
    model.to(device)
    if moe:
        from upcycle.config import CheckConfig

        cfg = ConvertConfig(method="copy", moe=MoEConfig(num_experts=8, top_k=2), placement=PlacementConfig(every=2),
                            check=CheckConfig(sequences=2, tokens=32, per_layer=False), device=str(device))
        upcycle_model(model, cfg, tokenizer=tokenizer, progress=False)
    return model.train(), tokenizer


class Autocast(PlainTorch):
    """`train_step`'s one-process accelerator with bf16 autocast on a GPU (as `upcycle train`'s mixed precision)."""

    def autocast(self):
        return torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda" else super().autocast()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def upcycle_row(name: str, batches, args, device: torch.device) -> dict:
    from upcycle.tasks.contrastive import chunk_overhead, lay_out_pairs, pair_loss
    from upcycle.training.batches_ahead import BatchesAhead
    from upcycle.training.loss.objective import Objective
    from upcycle.training.optimizer import make_optimizer
    from upcycle.training.step import StepSetup, train_step

    model, _ = encoder("moe" in name, device)
    optimizer = make_optimizer(model, TrainConfig(lr=LR), fused=device.type == "cuda")
    reg = Objective(model, RegularizerConfig(load_balance=0.01 if "moe" in name else 0.0)).to(device)
    overhead = float("inf") if name.endswith("padded") else (args.overhead if args.overhead is not None
                                                                else chunk_overhead(device))
    acc = Autocast(device)

    def make(step):
        return lay_out_pairs(batches.batch(step), overhead, pin=device.type == "cuda")

    times, every, real, positions = [], [], 0, 0
    with BatchesAhead(make, args.warmup + args.steps) as ahead:
        for step in range(args.warmup + args.steps):
            sync(device)
            start = time.perf_counter()
            laid = ahead.get(step)
            setup = StepSetup(lambda m, b: pair_loss(m, b, TEMPERATURE), lambda b: b["real_tokens"], acc, clip_grad=1.0)
            result = train_step(model, laid, optimizer, reg, setup, step=step)
            sync(device)
            every.append(round(time.perf_counter() - start, 4))
            if step >= args.warmup:
                times.append(every[-1])
                real += laid["real_tokens"]
                positions += laid["positions"]
    seconds = statistics.median(times)
    out = {"real_tokens_per_s": real / len(times) / seconds, "step_s_median": seconds, "steps": len(times),
           "real_tokens_per_step": real / len(times), "positions_per_real_token": positions / real,
           "chunks_per_step": len(laid["chunks"]), "overhead_positions": overhead, "final_loss": result.loss["task"],
           "step_seconds": every}
    del model, optimizer, reg
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def sentence_transformers_row(batches, pairs, args, device: torch.device) -> dict:
    """sentence-transformers' own trainer on the dense encoder, its batches in upcycle's order."""
    try:
        import datasets
        from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
        from sentence_transformers.losses import MultipleNegativesRankingLoss
        from sentence_transformers.training_args import SentenceTransformerTrainingArguments
        from transformers import TrainerCallback
    except ImportError as e:
        return {"skipped": f"needs sentence-transformers and datasets ({e})"}
    from torch.utils.data import BatchSampler, SequentialSampler

    from upcycle.data.assets import minilm_path

    steps = args.warmup + args.steps
    picked = torch.cat([batches._epoch_plan(0)[0][s] for s in range(steps)]).tolist()
    train = pairs.subset(picked)
    dataset = datasets.Dataset.from_dict({"anchor": train.queries, "positive": train.documents})
    model = SentenceTransformer(str(minilm_path()), device=str(device))
    model.max_seq_length = args.sequence_length
    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            sync(device)
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            sync(device)
            times.append(time.perf_counter() - self.start)

    class InOrder(SentenceTransformerTrainer):
        def get_batch_sampler(self, dataset, batch_size, drop_last, *a, **k):
            return BatchSampler(SequentialSampler(range(len(dataset))), batch_size, drop_last=True)

    targs = SentenceTransformerTrainingArguments(
        output_dir=str(args.scratch), per_device_train_batch_size=batches.batch_size, learning_rate=LR,
        num_train_epochs=1, max_steps=steps, warmup_steps=0, lr_scheduler_type="constant", max_grad_norm=1.0,
        bf16=device.type == "cuda", save_strategy="no", report_to=[], logging_steps=10**9, seed=0,
        dataloader_drop_last=True, use_cpu=device.type == "cpu", disable_tqdm=True)
    trainer = InOrder(model=model, args=targs, train_dataset=dataset,
                      loss=MultipleNegativesRankingLoss(model, scale=1 / TEMPERATURE), callbacks=[Clock()])
    trainer.train()
    timed = times[args.warmup:]
    masks = [batches.batch(s)["attention_mask"] for s in range(args.warmup, steps)]
    real = sum(int(m.sum()) for m in masks)
    seconds = statistics.median(timed)
    # sentence-transformers pads the queries and the documents of a batch each to their own longest
    positions = sum(int(m.sum(-1).max(0).values.sum()) * batches.batch_size for m in masks)
    return {"real_tokens_per_s": real / len(timed) / seconds, "step_s_median": seconds, "steps": len(timed),
            "real_tokens_per_step": real / len(timed), "positions_per_real_token": positions / real,
            "trainer": f"sentence-transformers {__import__('sentence_transformers').__version__} "
                       "SentenceTransformerTrainer, MultipleNegativesRankingLoss"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch-size", type=int, action="append", help="pairs a step (repeatable; CPU: 64 and 512)")
    p.add_argument("--sequence-length", type=int, default=64)
    p.add_argument("--steps", type=int, default=None, help="timed steps (CPU 5, GPU 20)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rows", default=",".join(ROWS))
    p.add_argument("--overhead", type=float, default=None, help="chunk overhead in positions (default: the device's)")
    p.add_argument("--out", type=output_file, default=RESULTS / "contrastive_step.json")
    p.add_argument("--add", action="store_true", help="add these batch sizes to --out's (same device) instead of "
                                                      "replacing the file")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("contrastive_step: --device cuda, but torch sees no CUDA GPU", file=sys.stderr)
        return 2
    rows = [r for r in args.rows.split(",") if r]
    if unknown := set(rows) - set(ROWS):
        print(f"contrastive_step: unknown rows {sorted(unknown)}; known: {', '.join(ROWS)}", file=sys.stderr)
        return 2
    sizes = args.batch_size or ([64, 512] if device.type == "cpu" else [512])
    args.steps = args.steps or (5 if device.type == "cpu" else 20)
    if min(sizes) < 2 or args.steps < 1 or args.warmup < 0 or args.sequence_length < 2:
        print("contrastive_step: --batch-size >= 2, --steps >= 1, --warmup >= 0, --sequence-length >= 2",
              file=sys.stderr)
        return 2
    if args.out.exists() and args.out.is_dir():
        print(f"contrastive_step: --out {args.out} is a folder; give a .json file", file=sys.stderr)
        return 2
    before = None
    if args.add and args.out.is_file():       # read before any work: a file --add cannot extend is refused now
        try:
            before = json.loads(args.out.read_text())
            before["batches"], before["command"], before["device"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"contrastive_step: --add: {args.out} is not a result of this benchmark ({e})", file=sys.stderr)
            return 2
    import tempfile

    from upcycle.data.assets import minilm_path
    from upcycle.data.text_pairs import load_text_pairs
    from upcycle.tasks.contrastive import PairBatches

    torch.manual_seed(0)
    tokenizer = encoder(False, torch.device("cpu"))[1]
    train = load_text_pairs(None)[0]
    given = argv if argv is not None else sys.argv[1:]
    results = {"machine": machine(device if device.type == "cuda" else None), "torch": torch.__version__,
               "device": str(device), "model": str(minilm_path().name), "sequence_length": args.sequence_length,
               "command": "python benchmarks/speed/contrastive_step.py " + " ".join(given),
               "batches": {}}
    with tempfile.TemporaryDirectory() as scratch:
        args.scratch = Path(scratch)
        for size in sizes:
            batches = PairBatches(tokenizer, train, size, seed=0, max_length=args.sequence_length)
            table = {}
            for row in rows:
                print(f"[contrastive_step] batch {size}: {row}", flush=True)
                table[row] = (sentence_transformers_row(batches, train, args, device) if row == "sentence_transformers"
                              else upcycle_row(row, batches, args, device))
                print(f"    {json.dumps(table[row])}", flush=True)
            ratios = {}
            st = table.get("sentence_transformers", {})
            if "real_tokens_per_s" in st and "upcycle_dense" in table:
                ratios["upcycle_dense_over_sentence_transformers"] = (table["upcycle_dense"]["real_tokens_per_s"]
                                                                      / st["real_tokens_per_s"])
            if "upcycle_dense" in table and "upcycle_moe" in table:
                ratios["moe_step_over_dense_step"] = (table["upcycle_moe"]["step_s_median"]
                                                      / table["upcycle_dense"]["step_s_median"])
            results["batches"][str(size)] = {"rows": table, "ratios": ratios}
    if before is not None:
        if before["device"] == results["device"]:
            results["command"] = f"{before['command']}; {results['command']}"
            results["batches"] = {**before["batches"], **results["batches"]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(json.dumps(results, indent=2) + "\n")
    tmp.replace(args.out)
    print(json.dumps({s: b["ratios"] for s, b in results["batches"].items()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Run by tests/commands/test_memory_plan.py (alone, or by `accelerate launch` in several processes): for each config
of a JSON list, the memory plan of its run on this process's layout and the peak measured while the run's own parts
(`make_accelerator`, `load_model`, `prepare`, `train_step`) load the model and take three steps, every batch with
a padded token (the plan's case: the model's masked attention path). Writes OUT.RANK.json: a list of
{"plan", "measured", "parts"}."""

from __future__ import annotations

import functools
import json
import sys

from upcycle.checkpoint.loading import load_model
from upcycle.config import TrainConfig
from upcycle.config_reader import build
from upcycle.tasks.make import make_task
from upcycle.training.memory.peak import measure_peak
from upcycle.training.memory.plan import plan_memory
from upcycle.training.parallel.accelerator import make_accelerator, prepare
from upcycle.training.parts import assemble
from upcycle.training.step import StepSetup, micro_batches, train_step


def measured(cfg: TrainConfig) -> tuple[int, int]:
    """(the peak of three training steps, the model's load included, this process's rank)."""
    accelerator = make_accelerator(cfg)
    task = make_task(cfg, *load_model(cfg.model))
    micro = cfg.batch_size // (accelerator.num_processes * cfg.grad_accum)

    def work() -> None:
        model, _ = load_model(cfg.model)
        model.train()
        parts = prepare(model, cfg, accelerator, functools.partial(assemble, cfg=cfg))     # as the trainer does
        freezer = parts.freezer
        for step in range(3):
            batch = task.train.batch(step)
            if "attention_mask" in batch:
                batch["attention_mask"][:, -1] = 0
            batches = micro_batches(batch, accelerator.process_index, micro, cfg.grad_accum)
            batches = [task.layout(b, accelerator.device, accelerator.num_processes) for b in batches]
            train_step(parts.model, batches, parts.optimizer, parts.objective,
                       StepSetup(task.loss, task.tokens, accelerator, parts.scheduler, freezer, cfg.clip_grad),
                       step=step)

    return measure_peak(work).peak_bytes, accelerator.process_index


def main(configs: str, out: str) -> None:
    rows, rank = [], 0
    for data in json.loads(open(configs).read()):
        cfg = build(TrainConfig, data)
        plan = plan_memory(cfg, detail=False)
        peak, rank = measured(cfg)
        rows.append({"plan": plan.peak_bytes, "measured": peak, "parts": plan.parts,
                     "checkpointing": cfg.activation_checkpointing, "sharding": plan.layout.sharding})
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(rows, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])

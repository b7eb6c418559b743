"""`upcycle train`: the one explicit training loop (docs/design.md principle 9), on Hugging Face Accelerate, wired
from parts with one job each, in sub-packages by job: parallel/ (the Accelerator, DDP or FSDP2, sharding,
activation checkpointing), loss/ (the objective: task loss, router regularizers, the EESD teacher), memory/ (the
memory plan made before any weight loads), run/ (what OUT may do, the checkpoint to resume, whole state written
atomically, the log and trackers; the format others read is `upcycle.runs`); beside this loop: optimizer.py and
schedule.py, freezing.py, step.py (one step), stopping.py (a clean stop on Ctrl-C or SIGTERM); the tasks (what is
trained and evaluated) are `upcycle.tasks`.

    for step in steps:        # the global batch of a step depends on (seed, step) only
        one_step -> a log line; a checkpoint every N steps; an evaluation every M steps; stop cleanly on Ctrl-C
    finish: last checkpoint, last evaluation, OUT/model

Resuming restores the whole state and the data order, so the run continues as if never stopped.
OUT: run_config.yaml  log.jsonl  checkpoints/step-NNNNNNN/  model/ (an upcycle folder for MoE models, a plain
transformers folder for dense ones)  tensorboard/ or wandb/ (with report_to)
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from pathlib import Path

from ..checkpoint.loading import load_model
from ..config import TrainConfig, to_dict
from ..core.moe import moe_layers
from ..metrics.routing import record_stats
from ..outputs.job import run_job
from ..tasks.evaluate import progress_bars
from ..tasks.make import make_task
from .batches_ahead import BatchesAhead
from .parallel.accelerator import make_accelerator, own_forward, prepare
from .parts import assemble
from .run.checkpointer import Checkpointer, finite_parameters
from .run.folder import (
    LOG,
    RunFolder,
    check_resumable,
    checkpoints,
    finished_run,
    resume_point,
)
from .run.log import RunLog
from .run.trackers import Trackers
from .run_plan import TrainPlan, make_train_plan
from .step import StepResult, StepSetup, any_process, micro_batches, train_step
from .stopping import StopFlag, TrainingStopped, check_skip


def train(cfg: TrainConfig, out: str | os.PathLike, *, resume: bool = False, overwrite: bool = False,
          stop_after: int | None = None, progress: bool = True, recipe: str | None = None) -> dict:
    """Run (or resume) the training run in `out`; returns a summary. `stop_after` ends the run early at that
    step with a checkpoint, as an interruption would (resume later to finish the schedule). `overwrite` lets a
    new run replace an existing OUT that upcycle wrote, only once the new run holds a checkpoint. `recipe`: the
    recipe file the config came from, an input like the others."""
    # everything decided from the config alone, the memory plan included: refused before any weight is read
    plan = make_train_plan(cfg, out, resume=resume, overwrite=overwrite, stop_after=stop_after, recipe=recipe)
    accelerator = make_accelerator(cfg)
    plan = dataclasses.replace(plan, main_process=accelerator.is_main_process)
    return run_job(plan, plan.out, lambda claim: _train(plan, accelerator, progress), overwrite=plan.overwrite)


def _train(plan: TrainPlan, accelerator, progress: bool) -> dict:
    from accelerate.utils import set_seed

    cfg, out, resume, stop_after = plan.cfg, plan.out, plan.resume, plan.stop_after
    # Every check before anything is written: the OUT location, the checkpoint to resume, the model, the data.
    if resume:
        check_resumable(out)
    resume_from = resume_point(cfg, out, accelerator.num_processes) if resume else None
    if (finished := finished_run(cfg, out, resume_from)) is not None:
        return finished
    set_seed(cfg.seed)
    model, tokenizer = load_model(cfg.model)
    model.train()
    task = make_task(cfg, model, tokenizer, kind=plan.decided_task)      # the plan's, decided once
    task.check_forward(plan.micro_batch)
    accelerator.wait_for_everyone()
    with RunFolder(out, accelerator, resume=resume).undone_on_failure() as run:
        return _Training(plan, run, accelerator, model, tokenizer, task, resume_from).run(stop_after, progress)


class _Training:
    """One run from set-up to finish; each method is one phase of `train`, in the order they run."""

    def __init__(self, plan: TrainPlan, run: RunFolder, accelerator, model, tokenizer, task,
                 resume_from: Path | None) -> None:
        cfg = plan.cfg
        self.cfg, self.folder, self.acc, self.tokenizer, self.task = cfg, run, accelerator, tokenizer, task
        self.is_main, self.rank = accelerator.is_main_process, accelerator.process_index
        self.micro = plan.micro_batch
        if self.is_main and resume_from is None:
            run.record(cfg)
        self.parts = prepare(model, cfg, accelerator, functools.partial(assemble, cfg=cfg))
        self.freezer = self.parts.freezer
        self.checkpointer = Checkpointer(run, accelerator, self.parts, keep=cfg.keep_checkpoints)
        self.state = {"step": 0, "tokens": 0} if resume_from is None else self.checkpointer.load(resume_from)
        self.layers = moe_layers(self.parts.inner)   # upcycle's own MoE layers (none: dense or stock MoE)
        self.router_steps = round(cfg.regularizers.router_until * cfg.steps)
        self.skipped = 0
        if self.is_main and resume_from is not None:
            self.checkpointer.drop_partial()
        # started in `run`, or for a run staged beside an existing OUT once it is OUT (`save_checkpoint`)
        self.trackers = Trackers(cfg.report_to, to_dict(cfg), enabled=self.is_main, resumed_at=self.state["step"])
        self.log = RunLog(run.path / LOG, self.trackers, is_main=self.is_main,
                          resumed_at=None if resume_from is None else self.state["step"])
        self.progress = False

    def run(self, stop_after: int | None, progress: bool) -> dict:
        """Evaluate the starting model, train to the end (or to `stop_after`, or a stop request), finish."""
        from tqdm.auto import tqdm

        end = self.cfg.steps if stop_after is None else min(self.cfg.steps, stop_after)
        self.progress = progress and self.is_main
        try:
            if not self.folder.staged:
                self.trackers.start(self.folder.path)
            first_eval = self.evaluate(0) if self.state["step"] == 0 else None
            self.bar = tqdm(total=self.cfg.steps, initial=self.state["step"], disable=not self.progress,
                            desc="train", unit="step")
            interrupted = self.loop(end)
            self.bar.close()
            return self.finish(first_eval, interrupted)
        finally:
            self.trackers.close()          # also when the run fails: the event file is closed, wandb finishes
            if not self.folder.provisional:
                self.folder.remember()     # what the trackers wrote to the end, and the whole log

    def loop(self, end: int) -> bool:
        """Steps up to `end`, with checkpoints and evaluations on their schedules; True if stopped by a signal."""
        cfg = self.cfg
        with StopFlag() as stop, BatchesAhead(self.step_batches, end) as self.ahead:
            for step in range(self.state["step"], end):
                if not self.one_step(step):
                    continue       # a skipped step: no stop check, checkpoint or evaluation after it
                done = self.state["step"]
                if any_process(self.acc, stop.requested) and done < end:   # every process stops at the same step
                    return True
                if cfg.checkpoint_every and done % cfg.checkpoint_every == 0 and done < end:
                    self.save_checkpoint(done)
                if cfg.eval_every and done % cfg.eval_every == 0 and done < cfg.steps:
                    self.evaluate(done)
        return False

    def one_step(self, step: int) -> bool:
        """Step `step` (0-based) on this process's share of its global batch, logged; False if it was skipped."""
        cfg, parts = self.cfg, self.parts
        started = time.perf_counter()
        batches = self.ahead.get(step)
        setup = StepSetup(self.task.loss, self.task.tokens, self.acc, parts.scheduler, self.freezer, cfg.clip_grad)
        result = train_step(parts.model, batches, parts.optimizer, parts.objective, setup, step=step,
                            router=step < self.router_steps)
        if result.skipped is not None:
            self.skip(step, result)
            return False
        self.state["step"], self.state["tokens"] = step + 1, self.state["tokens"] + result.tokens
        seconds = time.perf_counter() - started
        self.log.write({"step": step + 1, "lr": result.lr, "loss": result.loss, "tokens": result.tokens,
                        "tokens_per_s": result.tokens / seconds, "seconds": round(seconds, 4),
                        "grad_norm": result.grad_norm, "frozen_rules": self.freezer.active_rules(step),
                        "layers": {name: record_stats(r) for name, r in parts.objective.records().items()}})
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{result.loss['total']:.4f}", tok_s=f"{result.tokens / seconds:,.0f}")
        return True

    def step_batches(self, step: int) -> list[dict]:
        """This process's micro-batches of step `step`, laid out by the task for the device (made ahead)."""
        batches = micro_batches(self.task.train.batch(step), self.rank, self.micro, self.cfg.grad_accum)
        return [self.task.layout(b, self.acc.device, self.acc.num_processes) for b in batches]

    def skip(self, step: int, result: StepResult) -> None:
        """A step that did not update the weights: stop the run, or log it and go on (on_nonfinite: skip)."""
        check_skip(self.cfg, step, result.skipped, self.skipped)
        self.skipped += 1
        self.state["step"] = step + 1
        self.log.write({"step": step + 1, "lr": result.lr, "skipped": result.skipped})
        self.bar.update(1)

    def evaluate(self, step: int) -> dict | None:
        # a sharded model runs only with every process: each evaluates the whole set, the main one writes it; with
        # the model's own forward (float32, as `upcycle eval` computes), so that the two agree
        with progress_bars(f"eval at step {step}" if self.progress else None), own_forward(self.parts.inner):
            result = self.task.evaluate(self.parts.inner) if self.is_main or self.parts.sharded else None
        self.acc.wait_for_everyone()
        if result is not None:
            self.log.write({"step": step, "eval": result})
        return result

    def save_checkpoint(self, step: int) -> None:
        self.checkpointer.save(step, self.state["tokens"])
        self.trackers.start(self.folder.path)      # a staged run is OUT now (a no-op once started)

    def finish(self, first_eval: dict | None, interrupted: bool) -> dict:
        """The last checkpoint; at the schedule's end, the last evaluation and the final model; the summary."""
        step = self.state["step"]
        if not finite_parameters(self.parts.inner, self.acc):
            raise TrainingStopped(f"step {step}: the weights are no longer finite; nothing of this state is kept")
        self.save_checkpoint(step)
        summary = {"step": step, "steps": self.cfg.steps, "tokens": self.state["tokens"], "interrupted": interrupted,
                   "skipped_steps": self.skipped,
                   "checkpoint": str(checkpoints(self.folder.path)[-1]) if self.is_main else None}
        if step >= self.cfg.steps:
            summary["eval_before"] = first_eval
            summary["eval_after"] = self.evaluate(step)
            self.checkpointer.save_model(self.tokenizer, moe=bool(self.layers))
            if self.is_main:
                summary["model"] = str(self.folder.path / "model")
        self.acc.wait_for_everyone()
        self.log.close()
        self.acc.end_training()
        return summary

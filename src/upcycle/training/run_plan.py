"""`upcycle train` decided as one value before any weight loads (`make_train_plan`), then run by the loop.

    OUT          what the run does with it: start, resume, or replace a run upcycle wrote (`run.folder`)
    layout       its processes, how they share the model (one, DDP, FSDP2), the device, mixed precision
    micro-batch  the rows each process runs per forward: batch_size / (processes x grad_accum)
    task         causal_lm, clip or contrastive, from the model's config (the memory plan builds it weightless)
    memory       the memory plan per device (`memory.plan`): a run that cannot fit is refused here
    inputs       what OUT must never be

`upcycle train --dry-run` (or `--dry-run`) prints the plan (and writes nothing, an existing OUT included: what would
happen to it is a line of the plan); `train` hands the same value to the runner (`outputs.job.run_job`), so what
was printed is what runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from ..config import TrainConfig
from ..errors import UpcycleError
from ..outputs.claims import Input
from ..outputs.job import Claiming
from .memory.plan import Layout, MemoryPlan, check_fits, describe, local_layout, micro_batch
from .run.folder import check_request, train_inputs
from .run.trackers import check_available


@dataclass(frozen=True)
class TrainPlan:
    """What a run decided before loading anything (module docstring)."""

    cfg: TrainConfig
    out: Path
    resume: bool
    overwrite: bool                 # as `run.folder.check_request` settled it (a never-started run starts again)
    stop_after: int | None
    layout: Layout
    micro_batch: int
    memory: MemoryPlan | None       # None: no plan could be made for this model (said in one line; not refused)
    given: list[Input]
    out_refused: str | None = None  # --dry-run only: why the run would be refused its OUT
    main_process: bool = True       # accelerate's main process, which holds OUT's lock (the trainer sets it)
    kind: ClassVar[str] = "train"   # the output's kind (`outputs.job.Plan`)

    @property
    def claiming(self) -> Claiming:
        """A resumed run adds to its own OUT; of a distributed run's processes, the main one holds the lock."""
        return Claiming(existing="continue" if self.resume else "refuse", lock=self.main_process)

    def summary(self) -> dict:
        """The decisions as plain values."""
        lay, cfg = self.layout, self.cfg
        return {"model": cfg.model, "out": str(self.out), "task": self.task, "resume": self.resume,
                "overwrite": self.overwrite, "stop_after": self.stop_after, "steps": cfg.steps,
                "batch_size": cfg.batch_size, "processes": lay.processes, "grad_accum": cfg.grad_accum,
                "micro_batch": self.micro_batch, "out_refused": self.out_refused}

    @property
    def decided_task(self) -> str | None:
        """The task, as the memory plan decided it from the model's config (None without a memory plan: the
        run decides it from the loaded model)."""
        return self.memory.task if self.memory is not None else None

    @property
    def task(self) -> str:
        return self.memory.task if self.memory is not None else (self.cfg.task or "from the model")

    def describe(self) -> str:
        """The plan as lines for a person (`upcycle train --dry-run`)."""
        lay, cfg = self.layout, self.cfg
        what = ("refused: " + self.out_refused if self.out_refused else "resume the run in it" if self.resume
                else "replace the run upcycle wrote there" if self.overwrite else "a new run folder")
        lines = [f"run plan for training {cfg.model} into {self.out}: {what}",
                 f"  task {self.task}; {cfg.steps} steps of {cfg.batch_size} rows "
                 f"({lay.processes} process(es) x {cfg.grad_accum} micro-batch(es) of {self.micro_batch})"
                 + (f", stopping after step {self.stop_after}" if self.stop_after else "")]
        if self.memory is None:
            return "\n".join([*lines, "  no memory plan for this model (the run starts unchecked)"])
        return "\n".join([*lines, describe(self.memory, cfg.model)])


def make_train_plan(cfg: TrainConfig, out: str | Path, *, resume: bool = False, overwrite: bool = False,
                    stop_after: int | None = None, recipe: str | None = None, printing: bool = False) -> TrainPlan:
    """The plan of training as `cfg` says into `out` (module docstring). `printing` (`--dry-run`): a run that does not
    fit, or an OUT it would be refused, is part of what is printed, not an error; and the activations under
    every checkpointing mode are planned too."""
    out = Path(out).expanduser()
    out_refused = None
    try:
        overwrite = check_request(cfg, out, resume=resume, overwrite=overwrite, stop_after=stop_after)
    except UpcycleError as e:
        if not printing:
            raise
        out_refused = str(e)
    check_available(cfg.report_to)
    layout = local_layout(cfg)
    micro = micro_batch(cfg, layout.processes)
    memory = check_fits(cfg, layout, refuse=not printing, detail=printing)
    return TrainPlan(cfg, out, resume, overwrite, stop_after, layout, micro, memory, train_inputs(cfg, recipe),
                     out_refused)

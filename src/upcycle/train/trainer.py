"""`upcycle train`: the one explicit training loop (docs/design.md principle 9), on Hugging Face Accelerate.

    train():  Accelerator -> check OUT, the checkpoint to resume, the model, the data -> run folder
              (the config checked its keys when it was built)
    _Training: set-up (optimizer, schedule, freezing, regularizers, resume) -> evaluate -> loop -> finish
        for step in steps:             # the global batch of a step depends on (seed, step) only
            one_step: this process's micro-batches -> `upcycle.train.step.train_step` -> one JSONL log line
            checkpoint every N steps (atomically); evaluate every M steps; stop cleanly on Ctrl-C
        finish: last checkpoint, last evaluation, OUT/model

The optimizer is AdamW with fresh state (CLIP-UP: optimizer state is re-initialized after upcycling), linear
warmup then linear or cosine decay. `accelerate launch` runs the same loop on many processes: DDP, or FSDP2
(`--use_fsdp --fsdp_version 2`; `upcycle.train.sharding`: each process holds a shard of the weights, optimizer
state and EMA teacher; DeepSpeed and Megatron are refused). Checkpoints (`upcycle.train.run_state`: model,
optimizer, schedule, step, EMA teacher, every process's RNG, in safetensors/JSON with a manifest of sizes and
hashes) hold whole state (gathered under FSDP) and are written to a temporary folder and renamed, so a
checkpoint is either complete or absent. Resuming restores all of it and the data order, so the run continues
as if never stopped.

What OUT may and may not do (validation first, staging, verified resume) is `upcycle.train.run_folder`'s job.
Each log line also goes to TensorBoard or W&B with `report_to` (`upcycle.train.trackers`), and every evaluation
shows a progress bar (`upcycle.train.evaluate.progress_bars`).

Output folder OUT:  run_config.yaml   log.jsonl   checkpoints/step-NNNNNNN/   model/ (the final model; an upcycle
folder for MoE models, a plain transformers folder for dense ones)   tensorboard/ or wandb/ (with report_to)
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import torch
import yaml
from torch import nn

from ..analysis.routing import record_stats
from ..checkpoint.folders import Input, claim_output, inputs
from ..checkpoint.loading import load_model
from ..checkpoint.upcycle_format import save_folder_files, save_tokenizer
from ..config import TrainConfig, to_dict
from ..core.moe import moe_layers
from ..data.assets import model_inputs, recorded_location
from ..errors import UpcycleError
from ..files import atomic_directory, json_text, replace_directory
from . import run_state, sharding
from .evaluate import progress_bars
from .freezing import Freezer
from .objective import Objective
from .run_folder import (  # noqa: F401  (RUN_CONFIG, checkpoints, saved_config: the trainer's public names)
    CHECKPOINTS,
    INPUTS,
    LOG,
    RUN_CONFIG,
    RunFolder,
    check_fresh_out,
    checkpoints,
    never_started,
    read_log,
    resume_point,
    saved_config,
)
from .step import StepResult, any_process, train_step
from .tasks import make_task
from .trackers import Trackers, check_available


class TrainingStopped(UpcycleError):
    """The run stopped before its end for a reason the user must see (non-finite loss, a second Ctrl-C); the
    message says what OUT holds now."""


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of cfg.lr at `step` (0-based): linear warmup, then linear/cosine decay to min_lr_ratio."""
    warmup = round(cfg.warmup * cfg.steps)
    if step < warmup:
        return (step + 1) / warmup
    if cfg.schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(1, cfg.steps - warmup)
    shape = 1.0 - progress if cfg.schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


class StopFlag:
    """Ctrl-C (SIGINT) or SIGTERM asks the loop to stop after the current step; a second Ctrl-C aborts."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def train_inputs(cfg: TrainConfig, recipe: str | None = None) -> list[Input]:
    """Every path a run reads, for the output checks: the model (the embedded model's cache and wheel too), its
    data and held-out data, the recipe."""
    return [*(Input(what, path) for what, path in model_inputs(cfg.model)),
            *inputs(("training data", cfg.data), ("held-out data", cfg.eval_data), ("recipe", recipe))]


def train(cfg: TrainConfig, out: str | os.PathLike, *, resume: bool = False, overwrite: bool = False,
          stop_after: int | None = None, progress: bool = True, recipe: str | None = None) -> dict:
    """Run (or resume) the training run in `out`; returns a summary. `stop_after` ends the run early at that
    step with a checkpoint, as an interruption would (resume later to finish the schedule). `overwrite` lets a
    new run replace an existing OUT that upcycle wrote, only once the new run holds a checkpoint. `recipe`: the
    recipe file the config came from, an input like the others."""
    if resume and overwrite:
        raise UpcycleError("--resume continues the run in OUT and --overwrite replaces it: give one of them")
    if stop_after is not None and stop_after < 1:
        raise UpcycleError(f"stop_after must be a step from 1 to steps ({cfg.steps}), got {stop_after}")
    out = Path(out).expanduser()
    if not resume and not overwrite and never_started(out):
        print(f"[upcycle] {out} holds a run that stopped before its first checkpoint (nothing to resume): "
              f"starting it again", file=sys.stderr)
        overwrite = True
    if not resume:
        check_fresh_out(out, overwrite)
    check_available(cfg.report_to)
    accelerator = _accelerator(cfg)
    with claim_output(out, kind="train", given=train_inputs(cfg, recipe), overwrite=overwrite,
                      existing="continue" if resume else "refuse", lock=accelerator.is_main_process):
        return _train(cfg, out, accelerator, resume, stop_after, progress)


def _train(cfg: TrainConfig, out: Path, accelerator, resume: bool, stop_after: int | None, progress: bool) -> dict:
    from accelerate.utils import set_seed

    # Every check before anything is written: the OUT location, the checkpoint to resume, the model, the data.
    resume_from = resume_point(cfg, out, accelerator.num_processes) if resume else None
    if resume_from is not None and run_state.step_of(resume_from) >= cfg.steps and (out / "model").is_dir():
        step = run_state.step_of(resume_from)
        print(f"[upcycle] the run in {out} finished at step {step} of {cfg.steps}: nothing to resume, nothing "
              f"written", file=sys.stderr)
        return {"step": step, "steps": cfg.steps, "interrupted": False, "finished_before": True,
                "checkpoint": str(resume_from), "model": str(out / "model")}
    set_seed(cfg.seed)
    model, tokenizer = load_model(cfg.model)
    model.train()
    task = make_task(cfg, model, tokenizer)
    if hasattr(task, "check_forward_pairs"):       # a task whose loss needs several examples per forward
        task.check_forward_pairs(cfg.batch_size // (accelerator.num_processes * cfg.grad_accum))
    accelerator.wait_for_everyone()
    run = RunFolder(out, accelerator, resume=resume)
    try:
        return _Training(cfg, run, accelerator, model, tokenizer, task, resume_from).run(stop_after, progress)
    except KeyboardInterrupt:
        run.discard()
        raise KeyboardInterrupt(f"aborted; {run.state()}") from None
    except TrainingStopped as e:
        run.discard()
        raise TrainingStopped(f"{e}; {run.state()}") from None
    except BaseException:
        run.discard()
        raise


def _accelerator(cfg: TrainConfig):
    """The run's Accelerator, refused for DeepSpeed, Megatron, FSDP1 and a batch that does not split evenly."""
    from accelerate import Accelerator, DistributedDataParallelKwargs

    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        # Accelerate keeps one state per process: without a reset, a second run in the same Python process with
        # another mixed_precision is refused. Under `accelerate launch` (WORLD_SIZE > 1) the launcher's state stays.
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    # cpu=True on a machine with no accelerator: it is what makes `accelerate launch` start gloo CPU processes
    # (without it each process would run alone); find_unused_parameters: an expert may get no token in a batch.
    accelerator = Accelerator(mixed_precision=_mixed_precision(cfg.mixed_precision), cpu=not _has_accelerator(),
                              kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])
    world = accelerator.num_processes
    if accelerator.distributed_type.name in ("DEEPSPEED", "MEGATRON_LM"):
        # upcycle.train.run_state writes whole state gathered by upcycle.train.sharding (FSDP2); these engines
        # shard differently, and a checkpoint that resumes wrong is worse than none
        raise UpcycleError(f"`upcycle train` runs on one process, DDP or FSDP2; "
                           f"{accelerator.distributed_type.name} is not supported")
    sharded_by = _sharding(accelerator)
    if sharded_by is not None:
        sharding.check_version()
        if sharded_by == "cpu":
            # every CPU process loads the whole model: transformers' rank-0-only loading (Accelerate's
            # cpu_ram_efficient_loading) leaves the other ranks empty for Accelerate's GPU preparation to fill
            os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "false"
    if cfg.batch_size % (world * cfg.grad_accum):
        raise UpcycleError(f"batch_size {cfg.batch_size} must be divisible by processes x grad_accum = "
                           f"{world} x {cfg.grad_accum}")
    return accelerator


def _sharding(accelerator) -> str | None:
    """Who shards the model under FSDP: "accelerate" (its plugin, in `prepare`; GPUs), "cpu" (CPU processes,
    where Accelerate leaves the plugin unused: `sharding.shard_on_cpu`), or None (not FSDP)."""
    kind = accelerator.distributed_type.name
    if kind == "FSDP":
        return "accelerate"
    return "cpu" if kind == "MULTI_CPU" and sharding.requested() else None


class _Training:
    """One run from set-up to finish; each method is one phase of `train`, in the order they run."""

    def __init__(self, cfg: TrainConfig, run: RunFolder, accelerator, model: nn.Module, tokenizer, task,
                 resume_from: Path | None) -> None:
        """Set-up: run config, freezing rules, regularizers, optimizer and schedule, the checkpoint to resume."""
        self.cfg, self.folder, self.acc, self.tokenizer, self.task = cfg, run, accelerator, tokenizer, task
        self.is_main, self.world = accelerator.is_main_process, accelerator.num_processes
        self.rank = accelerator.process_index
        self.micro = cfg.batch_size // (self.world * cfg.grad_accum)
        if self.is_main and resume_from is None:
            (run.path / RUN_CONFIG).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
            # what the run read, as paths that mean the same from any directory (`upcycle analyze RUN`)
            (run.path / INPUTS).write_text(json.dumps({key: recorded_location(value) if key == "model" else
                                                       _absolute(value) for key, value in
                                                       (("model", cfg.model), ("data", cfg.data),
                                                        ("eval_data", cfg.eval_data))}, indent=1) + "\n")
        self.freezer = Freezer(model, cfg.train, cfg.freeze, cfg.steps)
        self.sharding = _sharding(accelerator)
        self.sharded = self.sharding is not None
        # under FSDP the regularizers come after sharding (`_prepare`): the EMA teacher copies each process's shard
        self.reg = None if self.sharded else Objective(model, cfg.regularizers)
        self._prepare(model)
        self.state = {"step": 0, "tokens": 0}
        if resume_from is not None:
            self.state = run_state.load(resume_from, model=self.inner, optimizer=self.optimizer,
                                        scheduler=self.scheduler, rank=self.rank, device=accelerator.device,
                                        teacher=self.reg.teacher, sharded=self.sharded)
        self.layers = moe_layers(self.inner)   # upcycle's own MoE layers (none for a dense or a stock MoE model)
        self.router_steps = round(cfg.regularizers.router_until * cfg.steps)
        self.skipped = 0
        self.log = self._open_log(resumed=resume_from is not None)
        # started in `run`, or for a run staged beside an existing OUT once it is OUT (`save_checkpoint`)
        self.trackers = Trackers(cfg.report_to, to_dict(cfg), enabled=self.is_main, resumed_at=self.state["step"])
        self.progress = False

    def _prepare(self, model: nn.Module) -> None:
        """Optimizer and schedule; model and optimizer through Accelerate. Under FSDP the model is sharded first
        (on CPU processes here, on GPUs by Accelerate's plugin in `prepare`), then the freezing rules and the
        regularizers take its sharded parameters."""
        cfg, accelerator = self.cfg, self.acc
        self.dtypes = {name: p.dtype for name, p in model.named_parameters()}   # the final model's, under FSDP
        if self.sharded:
            sharding.check_dtypes(model, accelerator.mixed_precision)
        if self.sharding == "cpu":
            sharding.shard_on_cpu(model, self.world, accelerator.mixed_precision)
        optimizer = make_optimizer(model, cfg, fused=accelerator.device.type == "cuda" and not self.sharded)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg))
        if self.sharding == "cpu":       # the optimizer only: Accelerate would wrap the sharded model in DDP
            self.model, self.optimizer = model, accelerator.prepare(optimizer)
        else:
            self.model, self.optimizer = accelerator.prepare(model, optimizer)
        self.inner = accelerator.unwrap_model(self.model)
        if cfg.compile:         # the step runs the compiled model; checkpoints, teacher and losses read `inner`
            self.model = torch.compile(self.model)
        if self.sharded:
            self.freezer.rebind(self.inner)
            self.reg = Objective(self.inner, cfg.regularizers)
        else:        # built on the CPU before `prepare` moved the model (a no-op on CPU runs)
            self.reg.to(accelerator.device)

    def _open_log(self, *, resumed: bool):
        """The log, open for appending (main process); a resumed run first drops what came after its checkpoint."""
        log_path = self.folder.path / LOG
        if self.is_main and resumed:
            for stale in (self.folder.path / CHECKPOINTS).glob(".step-*.tmp"):   # a checkpoint write cut off by a crash
                shutil.rmtree(stale, ignore_errors=True)
            if log_path.exists():      # drop lines written after the checkpoint we resume from, and torn lines
                log_path.write_text("".join(line + "\n" for line in read_log(log_path, self.state["step"])))
        return log_path.open("a") if self.is_main else None

    def run(self, stop_after: int | None, progress: bool) -> dict:
        """Evaluate the starting model, train to the end (or to `stop_after`, or a stop request), finish."""
        from tqdm.auto import tqdm

        cfg = self.cfg
        end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
        self.progress = progress and self.is_main
        try:
            if not self.folder.staged:
                self.trackers.start(self.folder.path)
            first_eval = self.evaluate(0) if self.state["step"] == 0 else None
            self.bar = tqdm(total=cfg.steps, initial=self.state["step"], disable=not self.progress,
                            desc="train", unit="step")
            interrupted = self.loop(end)
            self.bar.close()
            return self.finish(first_eval, interrupted)
        finally:
            self.trackers.close()          # also when the run fails: the event file is closed, wandb finishes

    def loop(self, end: int) -> bool:
        """Steps up to `end`, with checkpoints and evaluations on their schedules; True if stopped by a signal."""
        cfg = self.cfg
        with StopFlag() as stop:
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
        cfg, micro = self.cfg, self.micro
        started = time.perf_counter()
        share = micro * cfg.grad_accum
        mine = {k: v[self.rank * share:(self.rank + 1) * share] for k, v in self.task.train.batch(step).items()}
        batches = [{k: v[m * micro:(m + 1) * micro] for k, v in mine.items()} for m in range(cfg.grad_accum)]
        result = train_step(self.model, batches, self.optimizer, self.reg, task_loss=self.task.loss,
                            tokens=self.task.tokens, accelerator=self.acc, scheduler=self.scheduler,
                            freezer=self.freezer, step=step, clip_grad=cfg.clip_grad, router=step < self.router_steps)
        if result.skipped is not None:
            self.skip(step, result)
            return False
        self.state["step"], self.state["tokens"] = step + 1, self.state["tokens"] + result.tokens
        seconds = time.perf_counter() - started
        self.write({"step": step + 1, "lr": result.lr, "loss": result.loss, "tokens": result.tokens,
                    "tokens_per_s": result.tokens / seconds, "seconds": round(seconds, 4),
                    "grad_norm": result.grad_norm, "frozen_rules": self.freezer.active_rules(step),
                    "layers": {name: record_stats(record) for name, record in self.reg.records().items()}})
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{result.loss['total']:.4f}", tok_s=f"{result.tokens / seconds:,.0f}")
        return True

    def skip(self, step: int, result: StepResult) -> None:
        """A step that did not update the weights: stop the run, or log it and go on (on_nonfinite: skip)."""
        cfg = self.cfg
        if cfg.on_nonfinite == "stop" or self.skipped >= cfg.max_skipped_steps:
            raise TrainingStopped(
                f"step {step + 1}: {result.skipped}; training diverged and the run stopped without updating the "
                "weights" + ("" if cfg.on_nonfinite == "stop" else f" ({self.skipped} steps were already skipped)")
                + ". Lower the learning rate, or set on_nonfinite: skip to skip such steps")
        self.skipped += 1
        self.state["step"] = step + 1
        self.write({"step": step + 1, "lr": result.lr, "skipped": result.skipped})
        self.bar.update(1)

    def write(self, record: dict) -> None:
        """One log line (main process), and the same record to the tracker (`report_to`)."""
        if self.log is not None:
            self.log.write(json_text(record) + "\n")
            self.log.flush()
        self.trackers.log(record)

    def evaluate(self, step: int) -> dict | None:
        # a sharded model runs only with every process: each evaluates the whole set, the main one writes it
        with progress_bars(f"eval at step {step}" if self.progress else None):
            result = self.task.evaluate(self.inner) if self.is_main or self.sharded else None
        self.acc.wait_for_everyone()
        if result is not None:
            self.write({"step": step, "eval": result})
        return result

    def save_checkpoint(self, step: int) -> None:
        """Every process's RNG, then the main process's state, into a temporary folder renamed when complete."""
        folder = self.folder.path / CHECKPOINTS
        tmp = folder / f".step-{step:07d}.tmp"
        if self.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self.acc.wait_for_everyone()
        run_state.save_rng(tmp, self.rank)
        model_state, optimizer_state, teacher_state = self._whole_state()
        if self.is_main:
            with self._whole_model(model_state) as model:
                run_state.save_main(tmp, model=model, optimizer_state=optimizer_state, scheduler=self.scheduler,
                                    step=step, tokens=self.state["tokens"], teacher_state=teacher_state)
        self.acc.wait_for_everyone()
        if self.is_main:
            run_state.write_manifest(tmp, step=step, processes=self.world)
            replace_directory(tmp, folder / f"step-{step:07d}")
            for old in checkpoints(self.folder.path)[:-self.cfg.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)
        self.folder.committed()
        self.trackers.start(self.folder.path)      # a staged run is OUT now (a no-op once started)

    def _whole_state(self) -> tuple[dict | None, dict | None, dict | None]:
        """(model, optimizer, teacher) state for the main process to write: the optimizer's and teacher's own
        state dicts (the model is written from itself), or under FSDP all three gathered whole, every process
        taking part; None on the other processes."""
        teacher = self.reg.teacher
        if not self.sharded:
            if not self.is_main:
                return None, None, None
            return None, self.optimizer.state_dict(), None if teacher is None else teacher.state_dict()
        keep = self.is_main
        model = sharding.full_model_state(self.inner, keep)
        optimizer = sharding.full_optimizer_state(self.optimizer, keep)
        teachers = None if teacher is None else {
            layer: {k: sharding.gather(v, keep) for k, v in state.items()}
            for layer, state in teacher.state_dict()["teachers"].items()}
        if not keep:
            return None, None, None
        return model, optimizer, None if teachers is None else {"teachers": teachers}

    def _whole_model(self, state: dict | None, dtypes: dict | None = None):
        """The model to write: itself, or under FSDP itself with the gathered whole tensors in place."""
        if state is None:
            return contextlib.nullcontext(self.inner)
        return sharding.full_parameters(self.inner, state, dtypes)

    def finish(self, first_eval: dict | None, interrupted: bool) -> dict:
        """The last checkpoint; at the schedule's end, the last evaluation and the final model; the summary."""
        step = self.state["step"]
        if not _finite_parameters(self.inner, self.acc):
            raise TrainingStopped(f"step {step}: the weights are no longer finite; nothing of this state is kept")
        self.save_checkpoint(step)
        summary = {"step": step, "steps": self.cfg.steps, "tokens": self.state["tokens"], "interrupted": interrupted,
                   "skipped_steps": self.skipped,
                   "checkpoint": str(checkpoints(self.folder.path)[-1]) if self.is_main else None}
        if step >= self.cfg.steps:
            summary["eval_before"] = first_eval
            summary["eval_after"] = self.evaluate(step)
            self.save_model()
            if self.is_main:
                summary["model"] = str(self.folder.path / "model")
        self.acc.wait_for_everyone()
        if self.log is not None:
            self.log.close()
        self.acc.end_training()
        return summary

    def save_model(self) -> None:
        """OUT/model (written by the main process; under FSDP every process first helps gather the weights,
        written in the dtypes the model was loaded in): an upcycle folder for a model with upcycle's MoE layers,
        else a plain transformers folder."""
        state = sharding.full_model_state(self.inner, self.is_main) if self.sharded else None
        if not self.is_main:
            return
        with self._whole_model(state, self.dtypes) as model, \
                atomic_directory(self.folder.path / "model", overwrite=True) as tmp:
            if self.layers:
                save_folder_files(model, tmp, tokenizer=self.tokenizer)
            else:
                model.save_pretrained(tmp)
                if self.tokenizer is not None:
                    save_tokenizer(self.tokenizer, tmp)


def _absolute(path: str | None) -> str | None:
    """A data path as an absolute path when it is a file here (names such as 'digits' stay as they are)."""
    return str(Path(path).expanduser().resolve()) if path is not None and Path(path).expanduser().exists() else path


def make_optimizer(model: nn.Module, cfg: TrainConfig, *, fused: bool = False) -> torch.optim.AdamW:
    """The run's AdamW (fresh state: CLIP-UP re-initializes it after upcycling); `fused`: one kernel for every
    parameter's update, on a GPU (on the CPU the default implementation runs, whose numbers the CPU runs and
    checkpoints of earlier versions have)."""
    return torch.optim.AdamW(_param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=tuple(cfg.betas),
                             **({"fused": True} if fused else {}))


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Matrices decay; biases, norms and the 1-D rest do not (nanoGPT's rule)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def _has_accelerator() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return torch.cuda.is_available() or bool(mps is not None and mps.is_available())


def _mixed_precision(choice: str) -> str:
    if choice != "auto":
        return choice
    return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"


def _finite_parameters(model: nn.Module, accelerator) -> bool:
    """Every weight finite on every process (each checks its own shard under FSDP)."""
    finite = all(bool(torch.isfinite(sharding.local(p)).all()) for p in model.parameters())
    return not any_process(accelerator, not finite)

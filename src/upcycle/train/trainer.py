"""`upcycle train`: the one explicit training loop (DESIGN principle 9), on Hugging Face Accelerate.

    for step in steps:                                   # the global batch of a step depends on (seed, step) only
        for micro-batch of this process:                 # batch_size = micro x processes x grad_accum
            loss = task loss + sum_r lambda_r L_r + lambda_EESD L_EESD      (objective.Regularized)
            backward(loss / grad_accum)                  # DDP averages over processes
        freeze rules -> clip -> AdamW -> restore frozen rows -> LR schedule -> EMA teacher, aux-free bias
        log one JSONL line; checkpoint every N steps (atomically); stop cleanly on Ctrl-C

The optimizer is AdamW with fresh state (CLIP-UP: optimizer state is re-initialized after upcycling), linear
warmup then linear or cosine decay. `accelerate launch` runs the same loop on many processes (DDP; sharded
engines are refused until their checkpoints are built); checkpoints (`upcycle.train.checkpoint`: model, optimizer,
schedule, step, EMA teacher, every process's RNG, in safetensors/JSON with a manifest of sizes and hashes) are
written to a temporary folder and renamed, so a checkpoint is either complete or absent. Resuming restores all
of it and the data order, so the run continues as if never stopped.

What OUT may and may not do (validation first, staging, verified resume) is `upcycle.train.run_folder`'s job.

Output folder OUT:  run_config.yaml   log.jsonl   checkpoints/step-NNNNNNN/   model/ (the final model; an upcycle
folder for MoE models, a plain transformers folder for dense ones)
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import time
from pathlib import Path

import torch
import yaml
from torch import nn

from ..config import TrainConfig, to_dict
from ..conversion.io import save
from ..conversion.loading import load_model
from ..core.moe import RoutingRecord, moe_layers
from ..errors import UpcycleError
from ..files import atomic_directory
from . import checkpoint
from .freezing import Freezer
from .objective import Regularized
from .run_folder import (  # noqa: F401  (RUN_CONFIG, checkpoints, saved_config: the trainer's public names)
    CHECKPOINTS,
    LOG,
    RUN_CONFIG,
    RunFolder,
    check_fresh_out,
    checkpoints,
    read_log,
    resume_point,
    saved_config,
)
from .tasks import TASKS, make_task


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


def _in_range(where: str, value, low: float, high: float, *, low_open: bool = False, high_open: bool = False,
              ) -> None:
    """Refuse a non-finite or out-of-range number with the key's name and the allowed interval."""
    ok = isinstance(value, (int, float)) and math.isfinite(value) and (value > low if low_open else value >= low) \
        and (value < high if high_open else value <= high)
    if not ok:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise UpcycleError(f"{where} must be a finite number in {interval}, got {value!r}")


def validate(cfg: TrainConfig) -> None:
    """Every setting in range before anything loads: a NaN or infinite learning rate, a negative coefficient or a
    fraction outside [0, 1] would otherwise train silently into NaN weights."""
    if cfg.task is not None and cfg.task not in TASKS:
        raise UpcycleError(f"task must be one of {TASKS}, got {cfg.task!r}")
    if cfg.schedule not in ("linear", "cosine", "constant"):
        raise UpcycleError(f"schedule must be linear, cosine or constant, got {cfg.schedule!r}")
    if cfg.mixed_precision not in ("auto", "no", "bf16", "fp16"):
        raise UpcycleError(f"mixed_precision must be auto, no, bf16 or fp16, got {cfg.mixed_precision!r}")
    if cfg.on_nonfinite not in ("stop", "skip"):
        raise UpcycleError(f"on_nonfinite must be stop or skip, got {cfg.on_nonfinite!r}")
    for name in ("steps", "batch_size", "grad_accum", "sequence_length", "keep_checkpoints", "eval_tokens"):
        if getattr(cfg, name) < 1:
            raise UpcycleError(f"{name} must be >= 1, got {getattr(cfg, name)}")
    for name in ("checkpoint_every", "eval_every", "max_skipped_steps"):
        if getattr(cfg, name) < 0:
            raise UpcycleError(f"{name} must be >= 0, got {getattr(cfg, name)}")
    _in_range("lr", cfg.lr, 0, math.inf, low_open=True, high_open=True)
    _in_range("warmup", cfg.warmup, 0, 1, high_open=True)
    _in_range("min_lr_ratio", cfg.min_lr_ratio, 0, 1)
    _in_range("weight_decay", cfg.weight_decay, 0, math.inf, high_open=True)
    if len(cfg.betas) != 2:
        raise UpcycleError(f"betas must be a pair, got {list(cfg.betas)}")
    for i, beta in enumerate(cfg.betas):
        _in_range(f"betas[{i}]", beta, 0, 1, high_open=True)
    if cfg.clip_grad is not None:
        _in_range("clip_grad", cfg.clip_grad, 0, math.inf, low_open=True, high_open=True)
    r = cfg.regularizers
    for name in ("load_balance", "z_loss", "limoe_local", "limoe_global", "dpsl", "eesd", "aux_free_rate"):
        _in_range(f"regularizers.{name}", getattr(r, name), 0, math.inf, high_open=True)
    _in_range("regularizers.limoe_m", r.limoe_m, 1, math.inf, high_open=True)
    _in_range("regularizers.eesd_beta", r.eesd_beta, 0, 1, high_open=True)
    _in_range("regularizers.eesd_uncertain_fraction", r.eesd_uncertain_fraction, 0, 1, low_open=True)
    _in_range("regularizers.router_until", r.router_until, 0, 1)
    alphas = r.dpsl_alpha if isinstance(r.dpsl_alpha, list) else [r.dpsl_alpha]
    for alpha in (a for row in alphas for a in (row if isinstance(row, list) else [row])):
        _in_range("regularizers.dpsl_alpha", alpha, 0, math.inf, low_open=True, high_open=True)


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


def _layer_stats(record: RoutingRecord | None) -> dict | None:
    """Routing entropy (nats), load CoV over experts and dropped token-slot fraction of one forward."""
    if record is None:
        return None
    from ..analysis.routing import load_cov, router_load, routing_entropy

    with torch.no_grad():
        probs = record.probs_TE.detach()
        load = router_load(record.topk_ids_TK, probs.shape[1], record.mask_T)
        kept = record.kept_TK
        if kept is not None and record.mask_T is not None:
            kept = kept[record.mask_T]
        dropped = 0.0 if kept is None else float(1.0 - kept.float().mean())
        return {"entropy": round(routing_entropy(probs, record.mask_T), 5), "load_cov": round(load_cov(load), 5),
                "dropped": round(dropped, 5)}


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


def _finite_parameters(model: nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def train(cfg: TrainConfig, out: str | os.PathLike, *, resume: bool = False, overwrite: bool = False,
          stop_after: int | None = None, progress: bool = True) -> dict:
    """Run (or resume) the training run in `out`; returns a summary. `stop_after` ends the run early at that
    step with a checkpoint, as an interruption would (resume later to finish the schedule). `overwrite` lets a
    new run replace an existing OUT, only once the new run holds a checkpoint."""
    from accelerate import Accelerator, DistributedDataParallelKwargs
    from accelerate.utils import set_seed

    validate(cfg)
    if resume and overwrite:
        raise UpcycleError("--resume continues the run in OUT and --overwrite replaces it: give one of them")
    out = Path(out).expanduser()
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
    if accelerator.distributed_type.name in ("FSDP", "DEEPSPEED", "MEGATRON_LM"):
        # upcycle.train.checkpoint writes the full model and optimizer state from one process (exact under DDP); a
        # sharded engine would need its shards gathered, which is not built yet, and a checkpoint that resumes
        # wrong is worse than none
        raise UpcycleError(f"`upcycle train` checkpoints are built for single-process and DDP runs; "
                           f"{accelerator.distributed_type.name} is not supported yet")
    if cfg.batch_size % (world * cfg.grad_accum):
        raise UpcycleError(f"batch_size {cfg.batch_size} must be divisible by processes x grad_accum = "
                           f"{world} x {cfg.grad_accum}")
    # Every check before anything is written: the OUT location, the checkpoint to resume, the model, the data.
    resume_from = resume_point(cfg, out, world) if resume else None
    if not resume:
        check_fresh_out(cfg, out, overwrite)
    set_seed(cfg.seed)
    model, tokenizer = load_model(cfg.model)
    model.train()
    task = make_task(cfg, model, tokenizer)
    accelerator.wait_for_everyone()
    run = RunFolder(out, accelerator, resume=resume)
    try:
        return _run(cfg, run, accelerator, model, tokenizer, task, resume_from, stop_after, progress)
    except KeyboardInterrupt:
        run.discard()
        raise KeyboardInterrupt(f"aborted; {run.state()}") from None
    except TrainingStopped as e:
        run.discard()
        raise TrainingStopped(f"{e}; {run.state()}") from None
    except BaseException:
        run.discard()
        raise


def _run(cfg: TrainConfig, run: RunFolder, accelerator, model: nn.Module, tokenizer, task,
         resume_from: Path | None, stop_after: int | None, progress: bool) -> dict:
    from tqdm.auto import tqdm

    is_main, world, rank = accelerator.is_main_process, accelerator.num_processes, accelerator.process_index
    micro = cfg.batch_size // (world * cfg.grad_accum)
    if is_main and resume_from is None:
        (run.path / RUN_CONFIG).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    freezer = Freezer(model, cfg.train, cfg.freeze, cfg.steps)
    reg = Regularized(model, cfg.regularizers)
    optimizer = torch.optim.AdamW(_param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=tuple(cfg.betas))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg))
    model, optimizer = accelerator.prepare(model, optimizer)
    inner = accelerator.unwrap_model(model)
    state = {"step": 0, "tokens": 0}
    if resume_from is not None:
        state = checkpoint.load(resume_from, model=inner, optimizer=optimizer, scheduler=scheduler, rank=rank,
                                device=accelerator.device, teacher=reg.teacher)
    layers = moe_layers(inner)      # upcycle's own MoE layers (none for a dense or a stock MoE model)
    end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    router_steps = round(cfg.regularizers.router_until * cfg.steps)

    log_path = run.path / LOG
    if is_main and resume_from is not None:
        for stale in (run.path / CHECKPOINTS).glob(".step-*.tmp"):      # a checkpoint write cut off by a crash
            shutil.rmtree(stale, ignore_errors=True)
        if log_path.exists():      # drop lines written after the checkpoint we resume from, and torn lines
            log_path.write_text("".join(line + "\n" for line in read_log(log_path, state["step"])))
    log = log_path.open("a") if is_main else None

    def write(record: dict) -> None:
        if log is not None:
            log.write(json.dumps(record) + "\n")
            log.flush()

    def evaluate(step: int) -> dict | None:
        result = task.evaluate(inner) if is_main else None
        accelerator.wait_for_everyone()
        if result is not None:
            write({"step": step, "eval": result})
        return result

    def save_checkpoint(step: int) -> None:
        folder = run.path / CHECKPOINTS
        tmp = folder / f".step-{step:07d}.tmp"
        if is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        accelerator.wait_for_everyone()
        checkpoint.save_rng(tmp, rank)
        if is_main:
            checkpoint.save_main(tmp, model=inner, optimizer=optimizer, scheduler=scheduler, step=step,
                                 tokens=state["tokens"], teacher=reg.teacher)
        accelerator.wait_for_everyone()
        if is_main:
            checkpoint.write_manifest(tmp, step=step, processes=world)
            final = folder / f"step-{step:07d}"
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            for old in checkpoints(run.path)[:-cfg.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)
        run.committed()

    def any_process(flag: bool) -> bool:
        """Whether `flag` holds on any process (all processes must take the same branch)."""
        value = torch.tensor([float(flag)], device=accelerator.device)
        if world > 1:
            value = accelerator.reduce(value, reduction="max")
        return value.item() > 0

    def nonfinite(sums: dict[str, float], grad_norm) -> str | None:
        """Why this step must not update the weights (NaN/inf loss or gradient), agreed by every process."""
        bad = [f"{k} loss {v}" for k, v in sums.items() if not math.isfinite(v)]
        if grad_norm is not None and not math.isfinite(float(grad_norm)):
            bad.append(f"gradient norm {float(grad_norm)}")
        return (", ".join(bad) or "non-finite values on another process") if any_process(bool(bad)) else None

    first_eval = evaluate(0) if state["step"] == 0 else None
    bar = tqdm(total=cfg.steps, initial=state["step"], disable=not (progress and is_main), desc="train",
               unit="step")
    interrupted, skipped = False, 0
    with StopFlag() as stop:
        for step in range(state["step"], end):
            started = time.perf_counter()
            global_batch = task.train.batch(step)
            mine = {k: v[rank * micro * cfg.grad_accum:(rank + 1) * micro * cfg.grad_accum]
                    for k, v in global_batch.items()}
            sums: dict[str, float] = {}
            tokens = 0
            for m in range(cfg.grad_accum):
                batch = {k: v[m * micro:(m + 1) * micro].to(accelerator.device) for k, v in mine.items()}
                sync = contextlib.nullcontext() if m == cfg.grad_accum - 1 else accelerator.no_sync(model)
                with sync, accelerator.autocast():
                    total, logged = reg.loss(task.loss(model, batch), router=step < router_steps)
                    accelerator.backward(total / cfg.grad_accum)
                for k, v in logged.items():
                    sums[k] = sums.get(k, 0.0) + v / cfg.grad_accum
                tokens += task.tokens(batch)
            freezer.before_step(step)
            trainable = [p for p in model.parameters() if p.grad is not None]
            # max_norm inf measures the norm without clipping, so a NaN gradient is seen with clipping off too
            grad_norm = accelerator.clip_grad_norm_(trainable, cfg.clip_grad or math.inf) if trainable else None
            lr = scheduler.get_last_lr()[0]
            why = nonfinite(sums, grad_norm)
            if why is not None:
                optimizer.zero_grad(set_to_none=True)
                freezer.after_step()
                if cfg.on_nonfinite == "stop" or skipped >= cfg.max_skipped_steps:
                    raise TrainingStopped(
                        f"step {step + 1}: {why}; training diverged and the run stopped without updating the weights"
                        + ("" if cfg.on_nonfinite == "stop" else f" ({skipped} steps were already skipped)")
                        + ". Lower the learning rate, or set on_nonfinite: skip to skip such steps")
                skipped += 1
                if reg.balancer is not None:
                    for counts in reg.balancer.counts.values():
                        counts.zero_()
                scheduler.step()
                state["step"] = step + 1
                write({"step": step + 1, "lr": lr, "skipped": why})
                bar.update(1)
                continue
            optimizer.step()
            freezer.after_step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if reg.balancer is not None and world > 1:   # every process moves the biases by the global load
                for counts in reg.balancer.counts.values():
                    counts.copy_(accelerator.reduce(counts, reduction="sum"))
            reg.after_optimizer_step()

            names = sorted(sums)
            values = torch.tensor([sums[k] for k in names] + [float(tokens)], device=accelerator.device,
                                  dtype=torch.float64)
            if world > 1:
                values = accelerator.reduce(values, reduction="sum")
                values[:-1] /= world
            loss_terms = {k: float(v) for k, v in zip(names, values[:-1].tolist(), strict=True)}
            tokens = int(values[-1])
            state["step"], state["tokens"] = step + 1, state["tokens"] + tokens
            seconds = time.perf_counter() - started
            write({"step": step + 1, "lr": lr, "loss": loss_terms, "tokens": tokens, "tokens_per_s": tokens / seconds,
                   "seconds": round(seconds, 4),
                   "grad_norm": None if grad_norm is None else float(grad_norm),
                   "frozen_rules": freezer.active_rules(step),
                   "layers": {name: _layer_stats(record) for name, record in reg.records().items()}})
            bar.update(1)
            bar.set_postfix(loss=f"{loss_terms['total']:.4f}", tok_s=f"{tokens / seconds:,.0f}")

            if any_process(stop.requested) and state["step"] < end:     # every process stops at the same step
                interrupted = True
                break
            if cfg.checkpoint_every and state["step"] % cfg.checkpoint_every == 0 and state["step"] < end:
                save_checkpoint(state["step"])
            if cfg.eval_every and state["step"] % cfg.eval_every == 0 and state["step"] < cfg.steps:
                evaluate(state["step"])
    bar.close()

    if not _finite_parameters(inner):
        raise TrainingStopped(f"step {state['step']}: the weights are no longer finite; nothing of this state is kept")
    save_checkpoint(state["step"])
    summary = {"step": state["step"], "steps": cfg.steps, "tokens": state["tokens"], "interrupted": interrupted,
               "skipped_steps": skipped, "checkpoint": str(checkpoints(run.path)[-1]) if is_main else None}
    if state["step"] >= cfg.steps:
        summary["eval_before"] = first_eval
        summary["eval_after"] = evaluate(state["step"])
        if is_main:
            with atomic_directory(run.path / "model", overwrite=True) as tmp:
                if layers:
                    save(inner, tmp, tokenizer=tokenizer)
                else:
                    inner.save_pretrained(tmp)
                    if tokenizer is not None:
                        tokenizer.save_pretrained(tmp)
            summary["model"] = str(run.path / "model")
    accelerator.wait_for_everyone()
    if log is not None:
        log.close()
    accelerator.end_training()
    return summary

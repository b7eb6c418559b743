"""`upcycle train`: the one explicit training loop (DESIGN principle 9), on Hugging Face Accelerate.

    for step in steps:                                   # the global batch of a step depends on (seed, step) only
        for micro-batch of this process:                 # batch_size = micro x processes x grad_accum
            loss = task loss + sum_r lambda_r L_r + lambda_EESD L_EESD      (objective.Regularized)
            backward(loss / grad_accum)                  # DDP averages over processes
        freeze rules -> clip -> AdamW -> restore frozen rows -> LR schedule -> EMA teacher, aux-free bias
        log one JSONL line; checkpoint every N steps (atomically); stop cleanly on Ctrl-C

The optimizer is AdamW with fresh state (CLIP-UP: optimizer state is re-initialized after upcycling), linear
warmup then linear or cosine decay. `accelerate launch` runs the same loop on many processes (DDP, FSDP,
DeepSpeed); checkpoints are Accelerate's `save_state` (model, optimizer, RNG of every process) plus the
schedule, the step and the EMA teacher, written to a temporary folder and renamed, so a checkpoint is either
complete or absent. Resuming restores all of it and the data order, so the run continues as if never stopped.

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

from .config import TrainConfig, build, to_dict
from .errors import UpcycleError
from .freezing import Freezer
from .io import atomic_directory, save
from .moe import RoutingRecord
from .objective import Regularized
from .surgery import moe_layers
from .tasks import TASKS, load_model, make_task

RUN_CONFIG = "run_config.yaml"
LOG = "log.jsonl"
CHECKPOINTS = "checkpoints"
# keys that may differ when resuming: they change what is written, not what is computed
RESUMABLE_CHANGES = {"checkpoint_every", "keep_checkpoints", "eval_every", "overwrite"}


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


def validate(cfg: TrainConfig) -> None:
    if cfg.task is not None and cfg.task not in TASKS:
        raise UpcycleError(f"task must be one of {TASKS}, got {cfg.task!r}")
    if cfg.schedule not in ("linear", "cosine", "constant"):
        raise UpcycleError(f"schedule must be linear, cosine or constant, got {cfg.schedule!r}")
    if cfg.mixed_precision not in ("auto", "no", "bf16", "fp16"):
        raise UpcycleError(f"mixed_precision must be auto, no, bf16 or fp16, got {cfg.mixed_precision!r}")
    for name in ("steps", "batch_size", "grad_accum", "sequence_length", "keep_checkpoints"):
        if getattr(cfg, name) < 1:
            raise UpcycleError(f"{name} must be >= 1, got {getattr(cfg, name)}")
    if not 0 <= cfg.warmup < 1:
        raise UpcycleError(f"warmup is a fraction of the steps in [0, 1), got {cfg.warmup}")
    if not 0 <= cfg.regularizers.router_until <= 1:
        raise UpcycleError(f"regularizers.router_until is a fraction of the steps in [0, 1], got "
                           f"{cfg.regularizers.router_until}")
    if cfg.lr <= 0 or len(cfg.betas) != 2:
        raise UpcycleError("lr must be > 0 and betas a pair")


class Progress:
    """The trainer's own resumable state (checkpointed with Accelerate's custom objects)."""

    def __init__(self) -> None:
        self.step, self.tokens = 0, 0

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens": self.tokens}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.tokens = int(state["step"]), int(state["tokens"])


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
    from .analysis.routing import load_cov, router_load, routing_entropy

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


def checkpoints(out: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    folder = out / CHECKPOINTS
    return sorted(p for p in folder.glob("step-*") if p.is_dir()) if folder.exists() else []


def _check_out(cfg: TrainConfig, out: Path, resume: bool) -> None:
    """Refuse an OUT that would be clobbered, or a resume that would not continue the same run."""
    if resume:
        saved_file = out / RUN_CONFIG
        if not saved_file.exists():
            raise UpcycleError(f"cannot resume: {out} has no {RUN_CONFIG}")
        saved = to_dict(build(TrainConfig, yaml.safe_load(saved_file.read_text())))
        differ = {k for k, v in to_dict(cfg).items() if saved[k] != v} - RESUMABLE_CHANGES
        if differ:
            raise UpcycleError(f"cannot resume with a different run config ({', '.join(sorted(differ))} differ "
                               f"from {saved_file}); resuming continues the same run")
    elif out.exists() and any(out.iterdir()) and not cfg.overwrite:
        raise UpcycleError(f"output {out} already exists (pass --resume to continue its run, --overwrite to "
                           f"replace it)")


def _start_out(cfg: TrainConfig, out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    (out / RUN_CONFIG).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


def _has_accelerator() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return torch.cuda.is_available() or bool(mps is not None and mps.is_available())


def _mixed_precision(choice: str) -> str:
    if choice != "auto":
        return choice
    return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"


def train(cfg: TrainConfig, out: str | os.PathLike, *, resume: bool = False, stop_after: int | None = None,
          progress: bool = True) -> dict:
    """Run (or resume) the training run in `out`; returns a summary. `stop_after` ends the run early at that
    step with a checkpoint, as an interruption would (resume later to finish the schedule)."""
    from accelerate import Accelerator, DistributedDataParallelKwargs
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm

    validate(cfg)
    out = Path(out)
    # cpu=True on a machine with no accelerator: it is what makes `accelerate launch` start gloo CPU processes
    # (without it each process would run alone); find_unused_parameters: an expert may get no token in a batch.
    accelerator = Accelerator(mixed_precision=_mixed_precision(cfg.mixed_precision), cpu=not _has_accelerator(),
                              kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])
    is_main, world, rank = accelerator.is_main_process, accelerator.num_processes, accelerator.process_index
    if cfg.batch_size % (world * cfg.grad_accum):
        raise UpcycleError(f"batch_size {cfg.batch_size} must be divisible by processes x grad_accum = "
                           f"{world} x {cfg.grad_accum}")
    micro = cfg.batch_size // (world * cfg.grad_accum)
    _check_out(cfg, out, resume)          # every process checks before any of them writes
    accelerator.wait_for_everyone()
    if is_main and not resume:
        _start_out(cfg, out)
    accelerator.wait_for_everyone()
    set_seed(cfg.seed)

    model, tokenizer = load_model(cfg.model)
    model.train()
    task = make_task(cfg, model, tokenizer)
    freezer = Freezer(model, cfg.train, cfg.freeze, cfg.steps)
    reg = Regularized(model, cfg.regularizers)
    optimizer = torch.optim.AdamW(_param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=tuple(cfg.betas))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg))
    model, optimizer = accelerator.prepare(model, optimizer)
    state = Progress()
    accelerator.register_for_checkpointing(scheduler, state)
    if reg.teacher is not None:
        accelerator.register_for_checkpointing(reg.teacher)
    if resume:
        found = checkpoints(out)
        if not found:
            raise UpcycleError(f"cannot resume: {out / CHECKPOINTS} holds no checkpoint")
        accelerator.load_state(str(found[-1]))
    inner = accelerator.unwrap_model(model)
    layers = moe_layers(inner)
    end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    router_steps = round(cfg.regularizers.router_until * cfg.steps)

    log_path = out / LOG
    if is_main and resume and log_path.exists():   # drop lines written after the checkpoint we resume from
        kept = [line for line in log_path.read_text().splitlines()
                if line and json.loads(line)["step"] <= state.step]
        log_path.write_text("".join(line + "\n" for line in kept))
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
        folder = out / CHECKPOINTS
        tmp = folder / f".step-{step:07d}.tmp"
        if is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            folder.mkdir(exist_ok=True)
        accelerator.wait_for_everyone()
        accelerator.save_state(str(tmp))
        accelerator.wait_for_everyone()
        if is_main:
            final = folder / f"step-{step:07d}"
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            for old in checkpoints(out)[:-cfg.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)
        accelerator.wait_for_everyone()

    first_eval = evaluate(0) if state.step == 0 else None
    bar = tqdm(total=cfg.steps, initial=state.step, disable=not (progress and is_main), desc="train", unit="step")
    interrupted = False
    with StopFlag() as stop:
        for step in range(state.step, end):
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
            grad_norm = (accelerator.clip_grad_norm_(trainable, cfg.clip_grad) if cfg.clip_grad and trainable
                         else None)
            optimizer.step()
            freezer.after_step()
            lr = scheduler.get_last_lr()[0]
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
            state.step, state.tokens = step + 1, state.tokens + tokens
            seconds = time.perf_counter() - started
            write({"step": step + 1, "lr": lr, "loss": loss_terms, "tokens": tokens, "tokens_per_s": tokens / seconds,
                   "seconds": round(seconds, 4),
                   "grad_norm": None if grad_norm is None else float(grad_norm),
                   "frozen_rules": freezer.active_rules(step),
                   "layers": {name: _layer_stats(layer.last_record) for name, layer in layers.items()}})
            bar.update(1)
            bar.set_postfix(loss=f"{loss_terms['total']:.4f}", tok_s=f"{tokens / seconds:,.0f}")

            flag = torch.tensor([float(stop.requested)], device=accelerator.device)
            if world > 1:       # all processes must agree to stop at the same step
                flag = accelerator.reduce(flag, reduction="max")
            if flag.item() > 0 and state.step < end:
                interrupted = True
                break
            if cfg.checkpoint_every and state.step % cfg.checkpoint_every == 0 and state.step < end:
                save_checkpoint(state.step)
            if cfg.eval_every and state.step % cfg.eval_every == 0 and state.step < cfg.steps:
                evaluate(state.step)
    bar.close()

    save_checkpoint(state.step)
    summary = {"step": state.step, "steps": cfg.steps, "tokens": state.tokens, "interrupted": interrupted,
               "checkpoint": str(checkpoints(out)[-1]) if is_main else None}
    if state.step >= cfg.steps:
        summary["eval_before"] = first_eval
        summary["eval_after"] = evaluate(state.step)
        if is_main:
            with atomic_directory(out / "model", overwrite=True) as tmp:
                if layers:
                    save(inner, tmp, tokenizer=tokenizer)
                else:
                    inner.save_pretrained(tmp)
                    if tokenizer is not None:
                        tokenizer.save_pretrained(tmp)
            summary["model"] = str(out / "model")
    accelerator.wait_for_everyone()
    if log is not None:
        log.close()
    accelerator.end_training()
    return summary

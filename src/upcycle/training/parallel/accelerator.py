"""Where a run computes: the Accelerator (one process, DDP, or FSDP2; DeepSpeed and Megatron refused), and the
run's parts put on it. The parts (freezer, optimizer and schedule, objective) are the trainer's to make
(`training.parts.assemble`, handed to `prepare`): this layer says when, on which parameters, and with which AdamW
implementation. Under FSDP the model is sharded (on CPU processes here with `upcycle.training.parallel.sharding`,
before the optimizer; on GPUs by Accelerate's plugin in `prepare`), then the freezing rules and the regularizers
take its sharded parameters, so the EMA teacher copies each process's shard."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...config import TrainConfig
from ...errors import UpcycleError
from ...machine import launcher_count
from . import sharding


def make_accelerator(cfg: TrainConfig):
    """The run's Accelerator, refused for DeepSpeed, Megatron, FSDP1 and a batch that does not split evenly."""
    from accelerate import Accelerator, DistributedDataParallelKwargs

    if launcher_count("WORLD_SIZE", 1) == 1:
        # Accelerate keeps one state per process: without a reset, a second run in the same Python process with
        # another mixed_precision is refused. Under `accelerate launch` (WORLD_SIZE > 1) the launcher's state stays.
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    # cpu=True on a machine with no accelerator: it is what makes `accelerate launch` start gloo CPU processes
    # (without it each process would run alone); find_unused_parameters: an expert may get no token in a batch.
    accelerator = Accelerator(mixed_precision=resolve_mixed_precision(cfg.mixed_precision), cpu=not _has_accelerator(),
                              kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])
    world = accelerator.num_processes
    if accelerator.distributed_type.name in ("DEEPSPEED", "MEGATRON_LM"):
        # upcycle.training.run.state writes whole state gathered by upcycle.training.parallel.sharding (FSDP2);
        # these engines shard differently, and a checkpoint that resumes wrong is worse than none
        raise UpcycleError(f"`upcycle train` runs on one process, DDP or FSDP2; "
                           f"{accelerator.distributed_type.name} is not supported")
    sharded_by = sharding_of(accelerator)
    if sharded_by is not None:
        sharding.check_version()
        if sharded_by == "cpu":
            # every CPU process loads the whole model: transformers' rank-0-only loading (Accelerate's
            # cpu_ram_efficient_loading) leaves the other ranks empty for Accelerate's GPU preparation to fill
            os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "false"
    share_cores(launcher_count("LOCAL_WORLD_SIZE", world))
    if cfg.batch_size % (world * cfg.grad_accum):
        raise UpcycleError(f"batch_size {cfg.batch_size} must be divisible by processes x grad_accum = "
                           f"{world} x {cfg.grad_accum}")
    return accelerator


@contextlib.contextmanager
def own_forward(model: nn.Module):
    """The model's own forward within the block. With mixed precision, Accelerate's `prepare` replaces the
    model's forward with one that runs it under autocast (keeping the original as `_original_forward`); an
    evaluation measures the float32 model, as `upcycle eval` of the saved folder computes it, so that a run's
    evaluations and `upcycle eval` agree on any device."""
    original = model.__dict__.get("_original_forward")
    wrapped = model.__dict__.get("forward")
    if original is None or wrapped is None:
        yield model
        return
    model.forward = original
    try:
        yield model
    finally:
        model.forward = wrapped


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def share_cores(processes: int) -> int:
    """Give this process its share of the machine's cores for torch's and the tokenizer's threads: each of P
    processes on one machine taking every core oversubscribes them P times over, and the sum of their work is then
    no faster than one process's (measured with three study processes on a 16-core GPU machine). An explicit
    OMP_NUM_THREADS wins. Returns the threads set."""
    given = os.environ.get("OMP_NUM_THREADS")
    explicit = int(given) if given and given.isdigit() and int(given) > 0 else None
    threads = explicit or max(1, usable_cores() // max(1, processes))
    torch.set_num_threads(threads)
    os.environ.setdefault("RAYON_RS_NUM_CPUS", str(threads))     # the Rust tokenizers' pool, read at its first use
    return threads


def sharding_of(accelerator) -> str | None:
    """Who shards the model under FSDP: "accelerate" (its plugin, in `prepare`; GPUs), "cpu" (CPU processes,
    where Accelerate leaves the plugin unused: `sharding.shard_on_cpu`), or None (not FSDP)."""
    kind = accelerator.distributed_type.name
    if kind == "FSDP":
        return "accelerate"
    return "cpu" if kind == "MULTI_CPU" and sharding.requested() else None


@dataclass
class Prepared:
    """The model as the step runs it (`model`: wrapped, maybe compiled) and as checkpoints, the teacher and the
    losses read it (`inner`), with its optimizer, schedule, objective and freezer, the dtypes the final model
    keeps, and whether it is sharded (FSDP)."""

    model: nn.Module
    inner: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    objective: Any          # loss.objective.Objective
    dtypes: dict[str, torch.dtype]
    sharded: bool
    freezer: Any            # freezing.Freezer


def prepare(model: nn.Module, cfg: TrainConfig, accelerator, assemble: Callable[..., Any]) -> Prepared:
    """The run's parts made by `assemble` (`training.parts.assemble` with the run's config) on this layout: AdamW
    fused on a GPU without FSDP, the model sharded before the optimizer on CPU processes; model and optimizer
    through Accelerate; under FSDP the parts bound to the sharded parameters."""
    sharded_by = sharding_of(accelerator)
    dtypes = {name: p.dtype for name, p in model.named_parameters()}   # the final model's, under FSDP
    if sharded_by is not None:
        sharding.check_dtypes(model, accelerator.mixed_precision)
    shard = None
    if sharded_by == "cpu":
        def shard(m: nn.Module) -> None:
            sharding.shard_on_cpu(m, accelerator.num_processes, accelerator.mixed_precision)
    fused = accelerator.device.type == "cuda" and sharded_by is None
    parts = assemble(model, optimizer_kind={"fused": True} if fused else {}, sharded=sharded_by is not None,
                     shard=shard)
    if sharded_by == "cpu":       # the optimizer only: Accelerate would wrap the sharded model in DDP
        model, optimizer = model, accelerator.prepare(parts.optimizer)
    else:
        model, optimizer = accelerator.prepare(model, parts.optimizer)
    inner = accelerator.unwrap_model(model)
    if cfg.compile:         # the step runs the compiled model; checkpoints, teacher and losses read `inner`
        model = torch.compile(model)
    if sharded_by is not None:
        parts.bind(inner)
    else:                   # built on the CPU before Accelerate moved the model: moved along
        parts.objective.to(accelerator.device)
    return Prepared(model, inner, optimizer, parts.scheduler, parts.objective, dtypes, sharded_by is not None,
                    parts.freezer)


def _has_accelerator() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return torch.cuda.is_available() or bool(mps is not None and mps.is_available())


def resolve_mixed_precision(choice: str) -> str:
    if choice != "auto":
        return choice
    return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"

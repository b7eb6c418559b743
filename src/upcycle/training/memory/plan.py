"""The memory a training run takes on each device, planned from the model's config before any weight loads:
what `upcycle train --dry-run` prints and what `upcycle train` checks before it reads the weights.

The model is built of fake tensors (no memory, no weight read) and two of its training steps run on them
(`memory_simulation`): every tensor the step makes is followed from creation to release, so the activations,
autocast's weight copies, the loss's working set, a checkpointed block recomputed in the backward, the gradients
as they arrive and AdamW's temporaries are each where the real step has them. One process of the run holds, in
bytes:

  parameters    every parameter as it trains (FSDP2: this process's shard; float32 masters under mixed precision)
  gradients     the trained parameters' gradients computed by then (same dtype, same sharding)
  optimizer     AdamW's two moments of each trained parameter (from the second step on)
  teacher       EESD's float32 EMA copy of the MoE layers (sharded like the parameters)
  ddp_buckets   DDP's gradient buckets: a second copy of the gradients (several processes without FSDP2)
  gathered      FSDP2: the unsharded weights of the two blocks in flight and of the root (embeddings, head), and
                a block's unsharded gradients with the buffer they are reduce-scattered from
  activations   at the peak: what the forward kept for the backward and every temporary then alive

On the CPU these are the run's share of the process's memory: the process itself (Python with torch and transformers
imported, about `machine.PROCESS_BYTES`) comes on top, and the table says so.

The plan's peak is the simulated steps' most bytes at once with the sharded kinds scaled to one process's share,
plus what several processes add. `activations_by_mode` is what the forward keeps under each activation
checkpointing mode (`memory_trace`). Measured against: `training.peak_memory` (tests/commands/test_memory_plan.py on the
CPU, for one process, DDP and FSDP2; benchmarks/speed/train_mfu.py on a GPU).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ...config import CHECKPOINTING, TrainConfig
from ...core.moe import moe_layers
from ...errors import UpcycleError
from ...machine import PROCESS_BYTES, launcher_count
from .simulation import simulate_steps
from .trace import block_classes, fake_mode, shapes_only, trace_forward

GB = 10**9
SHARDINGS = ("single", "ddp", "fsdp2")


@dataclass(frozen=True)
class Layout:
    """Where a run computes: its processes, how they share the model, and the device each one has."""

    processes: int = 1
    sharding: str = "single"        # single, ddp, fsdp2
    device: str = "cpu"             # cuda or cpu
    device_name: str = "cpu"
    device_bytes: int = 0           # one process's device: a GPU's memory; on the CPU, RAM / local processes
    mixed_precision: str = "no"     # the autocast dtype: no, bf16, fp16

    def __post_init__(self) -> None:
        if self.sharding not in SHARDINGS:
            raise UpcycleError(f"sharding must be one of {', '.join(SHARDINGS)}, got {self.sharding!r}")
        if self.processes < 1 or (self.sharding != "single") != (self.processes > 1):
            raise UpcycleError(f"{self.processes} process(es) and sharding {self.sharding!r} do not go together")


@dataclass(frozen=True)
class MemoryPlan:
    layout: Layout
    task: str
    micro_batch: int                      # rows (sequences, pairs, image-caption pairs) per forward
    sequence_length: int
    checkpointing: str
    parts: dict[str, int]                 # bytes per process by part at the peak (module docstring); they sum to it
    activations_by_mode: dict[str, int]   # what the forward keeps under each checkpointing mode
    peak_bytes: int
    peak_at: str                          # the phase of the step where the peak falls
    budget_bytes: int
    notes: tuple[str, ...] = field(default_factory=tuple)
    gradient_bytes: int = 0               # every trained parameter's gradient, per process (at the peak: `parts`)

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.budget_bytes


def local_layout(cfg: TrainConfig) -> Layout:
    """The layout of the run being started: the launcher's processes and sharding (`accelerate launch` sets
    WORLD_SIZE, LOCAL_WORLD_SIZE and ACCELERATE_USE_FSDP), the device torch sees, the run's mixed precision."""
    from ..parallel.accelerator import resolve_mixed_precision
    from ..parallel.sharding import requested

    processes = launcher_count("WORLD_SIZE", 1)
    sharding = "single" if processes == 1 else "fsdp2" if requested() else "ddp"
    if torch.cuda.is_available():
        index = launcher_count("LOCAL_RANK", 0) % torch.cuda.device_count()
        properties = torch.cuda.get_device_properties(index)
        device, name, memory = "cuda", properties.name, properties.total_memory
    else:
        from ...core.grouped_ffn import CPU_MEMORY

        local = launcher_count("LOCAL_WORLD_SIZE", processes)
        device, name, memory = "cpu", "cpu", CPU_MEMORY // max(1, local)
    return Layout(processes, sharding, device, name, memory, resolve_mixed_precision(cfg.mixed_precision))


def budget(cfg: TrainConfig, layout: Layout) -> int:
    """The bytes one process may take: `memory_budget`, or the device's memory."""
    if cfg.memory_budget == "auto":
        return layout.device_bytes
    from ...checkpoint.writer import parse_size

    return parse_size(cfg.memory_budget, "memory_budget")


def plan_memory(cfg: TrainConfig, layout: Layout | None = None, *, detail: bool = True,
                build: Callable[[torch.dtype | None], nn.Module] | None = None) -> MemoryPlan:
    """The plan of `cfg`'s run on `layout` (default: `local_layout(cfg)`), from the model's config alone;
    `detail=False` leaves out the activations under each checkpointing mode (one traced forward less). `build`:
    instead of the model `cfg.model` names, one a benchmark makes (called inside the plan's fake mode with the
    dtype FSDP2 computes in, or None for the dtype it trains in)."""
    layout = layout or local_layout(cfg)
    budget(cfg, layout)                     # a bad memory_budget is refused before the model is built
    return _plan(cfg, layout, micro_batch(cfg, layout.processes), detail, build)


def micro_batch(cfg: TrainConfig, processes: int) -> int:
    """The rows one process runs per forward: batch_size / (processes x grad_accum), refused unless whole."""
    micro = cfg.batch_size // (processes * cfg.grad_accum)
    if micro < 1 or cfg.batch_size % (processes * cfg.grad_accum):
        raise UpcycleError(f"batch_size {cfg.batch_size} must be divisible by processes x grad_accum = "
                           f"{processes} x {cfg.grad_accum}")
    return micro


def _plan(cfg: TrainConfig, layout: Layout, micro: int, detail: bool, build) -> MemoryPlan:
    from ..parts import assemble

    n, fsdp, autocast = layout.processes, layout.sharding == "fsdp2", autocast_dtype(layout)
    # FSDP2 computes with the weights gathered in the autocast dtype and keeps float32 master shards (Accelerate's
    # preparation and `sharding.shard_on_cpu`); otherwise the weights train as they load
    mode = fake_mode()
    dtype = autocast if fsdp and autocast is not None else None
    if build is None:
        model = fake_model(cfg, mode, dtype)
    else:
        from ...checkpoint.skeleton import no_init

        with mode, no_init():
            model = build(dtype)
    model, task = _prepared(model, cfg)
    if task != "clip":          # rows past a position table: the run's own refusal, not a fake-tensor error
        from ...checkpoint.loading import check_sequence_length

        check_sequence_length(model, cfg.sequence_length)
    master = torch.float32 if fsdp and autocast is not None else None
    model.train()
    loss = task_loss(task, cfg, micro)
    activations = {}

    def traced(model: nn.Module) -> None:      # the trainable set chosen, no block checkpointed yet
        trace = trace_forward(model, loss, autocast_dtype=autocast)
        activations.update({m: trace.saved(m) for m in CHECKPOINTING})

    regularizers = dataclasses.replace(cfg.regularizers, dpsl=0.0)     # DPSL's Beta CDF reads values
    with mode:
        # the run's own parts (`training.parts.assemble`, as the trainer makes them): the same trainable set,
        # checkpointing, AdamW and objective; sharding is counted below, by the layout
        parts = assemble(model, cfg, optimizer_kind=_optimizer_kind(layout), regularizers=regularizers,
                         before_checkpointing=traced if detail else None)
        with shapes_only():
            simulation = simulate_steps(model, loss, parts.optimizer, parts.objective, autocast_dtype=autocast,
                                        clip_grad=cfg.clip_grad)

    params = _unique_parameters(model)
    grads_full = sum(_bytes(p) for p in params.values() if p.requires_grad)
    if fsdp:
        resident = sum(_shard(p, n, master) for p in params.values())
        grads = sum(_shard(p, n, master) for p in params.values() if p.requires_grad)
        share = grads / max(grads_full, 1)
        scale = {"grads": share, "optimizer": share, "teacher": 1 / n}
    else:
        resident, grads, scale = sum(_bytes(p) for p in params.values()), grads_full, {}
    peak, at, phase = simulation.peak(scale)
    # at the peak: the gradients computed by then, AdamW's state (from the second step on), the rest
    parts = {"parameters": resident, "gradients": at["grads"], "optimizer": at["optimizer"], "teacher": at["teacher"],
             "ddp_buckets": grads if layout.sharding == "ddp" else 0,
             "gathered": _gathered(model, layout, autocast) if fsdp else 0, "activations": at["other"]}
    notes = []
    if any(layer.config.capacity_factor_train for layer in moe_layers(model).values()):
        notes.append("expert capacity planned dropless (an upper bound)")
    if cfg.regularizers.dpsl:
        notes.append("DPSL's sorting left out ([tokens, experts] tensors)")
    total = sum(parts.values())
    return MemoryPlan(layout, task, micro, cfg.sequence_length, cfg.activation_checkpointing, parts, activations,
                      total, phase, budget(cfg, layout), tuple(notes), grads)


def autocast_dtype(layout: Layout) -> torch.dtype | None:
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(layout.mixed_precision)


def _optimizer_kind(layout: Layout) -> dict:
    """AdamW as the run makes it on the layout's device (`accelerator.prepare`): fused on a GPU without FSDP2,
    torch's default there otherwise (foreach: temporaries of every parameter at once), one tensor at a time on
    the CPU."""
    if layout.device != "cuda":
        return {}
    return {"fused": True} if layout.sharding != "fsdp2" else {"foreach": True}


def _prepared(model: nn.Module, cfg: TrainConfig) -> tuple[nn.Module, str]:
    """The model with padding masks tracked as `load_model` leaves it (a stock MoE class keeps its own), and its
    task."""
    from ...core.architectures import find_family
    from ...core.surgery import track_padding_masks
    from ...tasks.kind import model_task

    if find_family(model.config) is not None:
        track_padding_masks(model)
    return model, model_task(model, cfg.task)


def fake_model(cfg: TrainConfig, mode, dtype: torch.dtype | None = None) -> nn.Module:
    """The model of `cfg.model` built of `mode`'s fake tensors in the dtype it loads in, or `dtype`; no weight is
    read (an upcycle folder of configs alone, before its weights are written, plans in the dtype its config
    states)."""
    from ...checkpoint import upcycle_format
    from ...checkpoint.loading import MOE_CONFIG, auto_config, dense_config, resolve_dtype
    from ...checkpoint.reader import INDEX_FILE, SINGLE_FILE
    from ...checkpoint.skeleton import architecture_class, no_init
    from ...core.stock_moe import is_stock_moe

    folder = Path(cfg.model)
    with mode, no_init():
        if folder.is_dir() and (folder / MOE_CONFIG).exists():
            spec, config = upcycle_format.read_spec(folder)
            weights = (folder / SINGLE_FILE).is_file() or (folder / INDEX_FILE).is_file()
            stored = upcycle_format.saved_dtype(folder) if weights else getattr(torch, resolve_dtype("auto", config))
            model = upcycle_format.build(folder, spec, config, dtype or stored)
        elif folder.is_dir() and (folder / "config.json").is_file() and is_stock_moe(auto_config(cfg.model)):
            import transformers

            config = auto_config(cfg.model)
            loaded = getattr(torch, resolve_dtype("auto", config))
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype or loaded)
        else:
            _, config = dense_config(cfg.model, build=False)
            model = architecture_class(config)._from_config(config, dtype=dtype or torch.float32)
    return model


def task_loss(task: str, cfg: TrainConfig, micro: int):
    """The loss of one micro-batch of `task` on fake tensors (the largest a step has: every row full, with a padding
    mask, so the model takes its masked attention path), as a function of the model."""
    from ...tasks.causal_lm import causal_lm_loss

    seq = cfg.sequence_length

    def loss(model: nn.Module) -> torch.Tensor:
        if task == "causal_lm":
            ids = torch.zeros(micro, seq, dtype=torch.long)
            return causal_lm_loss(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
        if task == "contrastive":        # queries and documents, each up to the sequence length
            ids = torch.zeros(2 * micro, seq, dtype=torch.long)
            return model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state.float().mean()
        text, vision = model.config.text_config, model.config.vision_config
        ids = torch.zeros(micro, text.max_position_embeddings, dtype=torch.long)
        pixels = torch.zeros(micro, vision.num_channels, vision.image_size, vision.image_size)
        return model(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixels, return_loss=True).loss
    return loss


def _bytes(t: torch.Tensor, dtype: torch.dtype | None = None) -> int:
    return t.numel() * torch.empty((), dtype=dtype or t.dtype).element_size()


def _shard(t: torch.Tensor, processes: int, dtype: torch.dtype | None = None) -> int:
    """Bytes of one process's FSDP2 shard of `t` (dim 0 cut as torch.chunk cuts: ceil(rows / processes))."""
    if t.dim() == 0:
        return _bytes(t, dtype)
    rows = math.ceil(t.shape[0] / processes)
    return rows * (t.numel() // max(1, t.shape[0])) * torch.empty((), dtype=dtype or t.dtype).element_size()


def _unique_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter once (a tied one under its first name)."""
    seen, out = set(), {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in seen:
            seen.add(id(p))
            out[name] = p
    return out


def _gathered(model: nn.Module, layout: Layout, dtype: torch.dtype | None) -> int:
    """FSDP2 on top of the shards: the unsharded weights of two blocks (the one computing and the next, prefetched)
    and of the root (embeddings, final norm, head: FSDP2 keeps them unsharded from the forward to the backward), in
    the compute dtype; in the backward, a block's unsharded gradients and the float32 buffer they are
    reduce-scattered from."""
    n = layout.processes
    blocks = block_classes(model)
    units = [m for m in model.modules() if type(m).__name__ in blocks]
    in_units = {id(p) for m in units for p in m.parameters()}

    def unsharded(ps) -> int:
        return sum(_bytes(p, dtype) - _shard(p, n, dtype) for p in ps)

    largest = sorted((unsharded(m.parameters()) for m in units), reverse=True)[:2]
    grads = max((sum(_bytes(p, dtype) + _bytes(p, torch.float32) for p in m.parameters() if p.requires_grad)
                 for m in units), default=0)
    return sum(largest) + unsharded(p for p in _unique_parameters(model).values() if id(p) not in in_units) + grads


def gb(n: int) -> str:
    """Bytes as a person reads them: GB, or MB under one GB."""
    return f"{n / GB:,.2f} GB" if n >= GB else f"{n / 10**6:,.1f} MB"


PART_NAMES = {"parameters": "parameters", "gradients": "gradients", "optimizer": "optimizer state (AdamW)",
              "teacher": "EESD teacher", "ddp_buckets": "DDP gradient buckets", "gathered": "FSDP2 gathered",
              "activations": "activations and temporaries"}


def describe(plan: MemoryPlan, model: str) -> str:
    """The plan as a table for a person (`upcycle train --dry-run`)."""
    lay = plan.layout
    run = "1 process" if lay.processes == 1 else f"{lay.processes} processes, {lay.sharding.upper()}"
    device = f"{lay.device} ({lay.device_name})" if lay.device != "cpu" else f"cpu ({gb(lay.device_bytes)} of RAM)"
    lines = [f"memory plan for training {model} ({plan.task}): {run}, each on {device}",
             f"  micro-batch {plan.micro_batch} x {plan.sequence_length} tokens, mixed precision {lay.mixed_precision},"
             f" activation checkpointing {plan.checkpointing}",
             "  per device at the peak (in the " + plan.peak_at + "):"]
    for key, name in PART_NAMES.items():
        if key == "gradients":         # always said: a size other memory calculators list, known in advance
            lines.append(f"    {name:30s} {gb(plan.parts.get(key, 0)):>12s}   (all of them "
                         f"{gb(plan.gradient_bytes)}, held from the backward to the optimizer step)")
        elif plan.parts.get(key):
            lines.append(f"    {name:30s} {gb(plan.parts[key]):>12s}")
    verdict = "fits" if plan.fits else "does NOT fit"
    lines.append(f"    {'total':30s} {gb(plan.peak_bytes):>12s}   of {gb(plan.budget_bytes)}: {verdict}")
    if lay.device == "cpu":          # a CPU budget is the process's: say what the table leaves out
        lines.append(f"    (on the CPU these are the run's share; the process itself, torch and transformers "
                     f"imported, takes about {gb(PROCESS_BYTES)} more)")
    if plan.activations_by_mode:
        lines.append("  kept through the forward for the backward, by activation checkpointing mode: " +
                     ", ".join(f"{m} {gb(v)}" for m, v in plan.activations_by_mode.items()))
    lines += [f"  note: {note}" for note in plan.notes]
    return "\n".join(lines)


def alternatives(cfg: TrainConfig, plan: MemoryPlan) -> list[str]:
    """Runs like `cfg`'s that the plan says fit where it does not: activation checkpointing, a smaller micro-batch
    with more accumulation (the same global batch), or N processes with FSDP2 (GPUs), each with its peak."""
    found = []
    if cfg.activation_checkpointing != "full":
        other = plan_memory(dataclasses.replace(cfg, activation_checkpointing="full"), plan.layout, detail=False)
        if other.fits:
            found.append(f"activation_checkpointing: full ({gb(other.peak_bytes)})")
    micro, accum = plan.micro_batch, cfg.grad_accum
    while micro % 2 == 0 and micro > 1:
        micro, accum = micro // 2, accum * 2
        other = plan_memory(dataclasses.replace(cfg, grad_accum=accum), plan.layout, detail=False)
        if other.fits:
            found.append(f"grad_accum {accum} (micro-batches of {micro} rows, the same batch_size; "
                         f"{gb(other.peak_bytes)})")
            break
    if plan.layout.device == "cuda":
        for n in (2, 4, 8):
            if n <= plan.layout.processes or cfg.batch_size % (n * cfg.grad_accum):
                continue
            layout = dataclasses.replace(plan.layout, processes=n, sharding="fsdp2")
            other = plan_memory(cfg, layout, detail=False)
            if other.fits:
                found.append(f"{n} processes with FSDP2 ({gb(other.peak_bytes)} each; accelerate launch "
                             f"--use_fsdp --fsdp_version 2 --num_processes {n})")
                break
    return found


def check_fits(cfg: TrainConfig, layout: Layout | None = None, *, refuse: bool = True,
               detail: bool = False) -> MemoryPlan | None:
    """The run's memory plan on `layout` (default: this machine's); with `refuse`, a run whose plan does not fit
    its device is refused before any weight is read, with the numbers and what would fit. A model the plan cannot
    be made for (an architecture the fake tensors do not carry through) is said in one line and not refused."""
    try:
        plan = plan_memory(cfg, layout, detail=detail)
    except UpcycleError:
        raise
    except Exception as e:          # noqa: BLE001  (a plan is advice; its failure must not stop a run)
        print(f"[upcycle] no memory plan for this run ({type(e).__name__}: {str(e)[:200]}); it starts unchecked",
              file=sys.stderr)
        return None
    if plan.fits or not refuse:
        return plan
    lay = plan.layout
    found = alternatives(cfg, plan)
    device = f"{lay.device} device ({lay.device_name})" if lay.device != "cpu" else "process (CPU)"
    raise UpcycleError(f"this run needs {gb(plan.peak_bytes)} on each {device} at its "
                       f"peak (parameters {gb(plan.parts['parameters'])}, optimizer {gb(plan.parts['optimizer'])}, "
                       f"activations and temporaries {gb(plan.parts['activations'])}), and it has "
                       f"{gb(plan.budget_bytes)}" + (f" (memory_budget {cfg.memory_budget})"
                                                     if cfg.memory_budget != "auto" else "") +
                       ". " + ("What would fit: " + "; ".join(found) if found else
                               "Nothing tried fits (checkpointing, smaller micro-batches, FSDP2 on up to 8 GPUs)") +
                       ". `upcycle train MODEL OUT --dry-run` prints the whole plan")

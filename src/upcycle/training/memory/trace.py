"""What one training forward keeps for its backward pass, found without a byte of memory: the model's own code
runs on fake tensors (torch's FakeTensorMode: shapes, dtypes and devices, no data), and every tensor autograd
saves is counted once (by its storage) and attributed to the transformer block, and the MoE layer, it was saved
in.

The fake tensors are CPU tensors, so every decision the real code makes by device runs as on the CPU: autocast
(torch.autocast("cpu") with the run's dtype, whose matmul casts are CUDA's), the attention kernel (sdpa's flash
kernel, which keeps q, k, v, the output and the log-sum-exp, as CUDA's flash and memory-efficient kernels do).
Upcycle's MoE layer runs its grouped-matmul path, as on a GPU, whatever the batch (torch's fake grouped_mm takes
bfloat16 alone; a float32 stand-in here keeps what the real one keeps: both matrices and the offsets); its
per-expert loop, which the EMA teacher's inference takes, reads its slot counts and is a stand-in holding one
expert's working set. What the run keeps and a trace of
the CPU would not show, the plan adds (`memory_plan.py`): the EMA teacher's targets, a GPU's own kernels'
workspace.

Routing that reads its data (expert capacity) cannot run on shapes alone: traced dropless, an upper bound.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from unittest import mock

import torch
from torch import nn

from ...core.moe import MoELayer


@dataclass
class Part:
    """A transformer block or an MoE layer in the trace."""

    saved: int = 0            # bytes it saved for the backward pass (inside an MoE layer: counted there, not here)
    input: int = 0            # bytes of its input (what activation checkpointing keeps instead)


@dataclass
class Trace:
    blocks: dict[str, Part] = field(default_factory=dict)
    moe: dict[str, Part] = field(default_factory=dict)      # MoE layers, each inside a block
    outside: int = 0          # saved outside every block: embeddings, final norm, the loss, the router losses
    weight_copies: int = 0    # weights cast to the compute dtype (autocast) and kept for the backward pass
    block_of: dict[str, str] = field(default_factory=dict)  # MoE layer -> its block

    def saved(self, mode: str = "none") -> int:
        """Bytes kept through the forward under activation checkpointing `mode` (none, full, moe); a checkpointed
        part keeps its input."""
        inner = sum(p.saved for p in self.moe.values())
        blocks = sum(p.saved for p in self.blocks.values())
        if mode == "full":
            return self.outside + sum(p.input for p in self.blocks.values())
        if mode == "moe":
            return self.outside + blocks + sum(p.input for p in self.moe.values())
        return self.outside + blocks + inner


class _Attribution:
    """Which block and MoE layer the forward is in (module hooks keep a stack)."""

    def __init__(self, trace: Trace) -> None:
        self.trace, self.stack = trace, []

    def enter(self, kind: str, name: str, x) -> None:
        table = self.trace.blocks if kind == "block" else self.trace.moe
        part = table.setdefault(name, Part())
        if torch.is_tensor(x):
            part.input = x.untyped_storage().nbytes() if x.is_contiguous() else x.numel() * x.element_size()
        if kind == "moe":
            self.trace.block_of[name] = next((n for k, n in reversed(self.stack) if k == "block"), "")
        self.stack.append((kind, name))

    def leave(self) -> None:
        self.stack.pop()

    def add(self, nbytes: int) -> None:
        if not self.stack:
            self.trace.outside += nbytes
            return
        kind, name = self.stack[-1]
        (self.trace.blocks if kind == "block" else self.trace.moe)[name].saved += nbytes


class _GroupedMM(torch.autograd.Function):
    """A stand-in for torch's grouped_mm where its fake kernel refuses the dtype: the same output shape, the same
    tensors kept for the backward (the two matrices and the offsets)."""

    @staticmethod
    def forward(ctx, a, b, offs):
        ctx.save_for_backward(a, b, offs)
        return a.new_empty(a.shape[0], b.shape[-1])

    @staticmethod
    def backward(ctx, grad):       # the gradients the real backward makes: one of each input's shape
        a, b, _ = ctx.saved_tensors
        return a.new_empty(a.shape), b.new_empty(b.shape), None


def _grouped_mm(real):
    def grouped_mm(a, b, *, offs=None, **kwargs):
        if a.dtype == torch.bfloat16:
            return real(a, b, offs=offs, **kwargs)
        return _GroupedMM.apply(a, b, offs)
    return grouped_mm


def _dropless_route(self: MoELayer, x_TD: torch.Tensor, mask_T: torch.Tensor | None = None):
    return self.router.route(x_TD, self.selection_bias, mask_T, None)


def block_classes(model: nn.Module) -> set[str]:
    """The transformer block classes a model names (`_no_split_modules`: FSDP's and Accelerate's unit)."""
    return set(getattr(model, "_no_split_modules", None) or ())


@contextlib.contextmanager
def _hooks(model: nn.Module, attribution: _Attribution) -> Iterator[None]:
    blocks = block_classes(model)
    handles = []
    for name, module in model.named_modules():
        kind = "moe" if isinstance(module, MoELayer) else "block" if type(module).__name__ in blocks else None
        if kind is None:
            continue

        def pre(module, args, kwargs, kind=kind, name=name):
            attribution.enter(kind, name, args[0] if args else next(iter(kwargs.values()), None))

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(lambda *a: attribution.leave(), always_call=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def trace_forward(model: nn.Module, forward: Callable[[nn.Module], object], *,
                  autocast_dtype: torch.dtype | None = None) -> Trace:
    """Run `forward(model)` (the task's loss, say) on a model built in a `fake_mode()`, inside that mode, and account
    every tensor its autograd graph keeps (module docstring). `autocast_dtype`: the mixed-precision dtype, None for
    none."""
    trace = Trace()
    attribution = _Attribution(trace)
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    param_ids = {id(p) for p in model.parameters()}
    seen: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage._cdata
        # a parameter, or a view of one (a fake tensor's view need not show its base's storage object)
        is_param = key in params or id(t) in param_ids or (t._base is not None and id(t._base) in param_ids)
        if not is_param and key not in seen:
            seen.add(key)
            if _is_weight_copy(t):
                trace.weight_copies += storage.nbytes()
            else:
                attribution.add(storage.nbytes())
        return t

    autocast = torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype is not None else contextlib.nullcontext()
    with _hooks(model, attribution), shapes_only(), autocast, torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
        forward(model)
    return trace


def _loop(x_TD, slots, ffn, keep=None):
    """A stand-in for the per-expert loop without a gradient (which reads its slot counts): one expert's working
    set at a time, each expert taking an equal share of the slots, and the float32 output."""
    w_in, w_down = ffn.w_in, ffn.w_down
    experts = w_in.shape[0]
    rows = -(-slots.tokens_N.shape[0] // experts)
    dtype = x_TD.dtype
    pre = x_TD.new_empty(rows, w_in.shape[1], dtype=dtype)
    hidden = x_TD.new_empty(rows, w_down.shape[2], dtype=dtype)
    out = x_TD.new_empty(rows, w_down.shape[1], dtype=dtype)
    del pre, hidden, out
    return x_TD.new_zeros(x_TD.shape[0], w_down.shape[1], dtype=torch.float32)


def _equal_segments(counts, slots: int) -> list[tuple[int, slice]]:
    """Delta experts' slot segments without reading the counts: each expert an equal share of the slots (the
    factors' work and what they keep depend on the total alone)."""
    experts = len(counts)
    share = -(-slots // experts)
    return [(e, slice(s, min(s + share, slots))) for e, s in enumerate(range(0, slots, share))]


@contextlib.contextmanager
def shapes_only() -> Iterator[None]:
    """What the MoE layer reads of its data replaced by what needs none (module docstring): routing dropless, the
    grouped matmul for every dtype and every batch (the path a GPU takes), and the inference loop a stand-in."""
    from ...core import delta_experts, grouped_ffn

    with mock.patch.object(MoELayer, "route", _dropless_route), \
            mock.patch.object(delta_experts, "expert_segments", _equal_segments), \
            mock.patch.object(torch.nn.functional, "grouped_mm", _grouped_mm(torch.nn.functional.grouped_mm)), \
            mock.patch.object(grouped_ffn, "_run", _loop), grouped_ffn.forced_kernel_path("grouped_mm"):
        yield


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


VIEWS = ("TBackward0", "TransposeBackward0", "ViewBackward0", "PermuteBackward0", "ExpandBackward0",
         "UnsqueezeBackward0", "SliceBackward0", "SplitBackward0", "SelectBackward0")


def _is_weight_copy(t: torch.Tensor) -> bool:
    """A parameter cast to another dtype (autocast's, or the MoE experts' explicit cast), or a view of such a cast:
    the tensor's history is views of one cast of a leaf that needs a gradient."""
    node = t.grad_fn
    while node is not None and node.name() in VIEWS:
        node = node.next_functions[0][0]
    if node is None or node.name() != "ToCopyBackward0":
        return False
    leaf = node.next_functions[0][0]
    return leaf is not None and isinstance(getattr(leaf, "variable", None), nn.Parameter)


def fake_mode():
    """A FakeTensorMode: tensors made inside it are fake CPU tensors. Build the model and run its steps inside one
    and the same mode (fake tensors of two modes do not mix)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)

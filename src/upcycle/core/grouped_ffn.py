"""E stacked FFNs applied to routed token-slots, weighted and summed per token, with hand-written gradients.

    y[t] = sum over slots s of token t:  weight[s] * FFN_{expert(s)}(x[t])

Slots arrive sorted by expert (`counts[e]` consecutive slots for expert e) with their token index and
combine weight. Each expert gathers its tokens, runs its FFN and adds its weighted output into y: the
working set is one expert's slice at a time, never a [slots, D] copy of the batch (on CPU, fresh tensors of
that size cost more in page faults than their copies).

Why a hand-written backward: autograd through per-expert slices of a stacked [E, F, D] weight either indexes
it (`w[e]`: each expert's backward zero-fills a full [E, F, D] gradient) or unbinds it (backward then stacks
E separately allocated, transposed gradients, measured at a third of a CPU fwd+bwd at 512 tokens). Here each
expert's weight gradient is written by one matmul straight into its slice of one stacked gradient.

Shapes: T tokens, N slots, D model width, F intermediate width, E experts. The input projection is one
matrix per expert, `w_in` [E, I, D]:
  gated FFN: I = 2F, rows [0, F) are W_gate and [F, 2F) are W_up (one matmul for both, the fused gate_up
             layout of transformers' and vLLM's MoE experts):  a, u = split(x W_in^T + b_in);  h = act(a) * u
  plain FFN: I = F:                                          u = x W_in^T + b_in;            h = act(u)
  then FFN(x) = h W_down^T + b_down.
The activation's derivative comes from autograd on the (elementwise) activation alone, so every ACT2FN
activation works without a hand-written derivative.

Dtypes, stated rather than left to autocast: the expert matmuls run in the compute dtype (the autocast dtype
when autocast is on for the device, else the wider of the weights' and the input's dtype: bfloat16 weights given
float32 inputs compute in float32, as torch's type promotion would); each expert's output is multiplied by its
float32 combine weight into a float32 accumulator (a sum over k experts in bfloat16 would round each term again);
the result is returned in the input's dtype. Autocast is switched off inside, and the casts of x and the weights
to the compute dtype are ordinary autograd ops, so gradients reach float32 parameters in float32. Without a
gradient, the per-expert loop casts one expert's weights at a time (checking a bfloat16 layer of a large model in
float32 then never holds a float32 copy of all its experts: the streaming conversion's per-layer check), and an
inference batch whose weights need a cast takes the loop whatever its size (grouped_mm would cast the stack).

Which path runs (`kernel_path`, a function of the batch and the device's facts, `choose_path`): `grouped_mm` where
torch implements it for the device (CPU and CUDA) and the rows are 16-byte aligned, unless its working set
(`grouped_working_bytes`: the gathered inputs, projections and outputs of every slot, and their gradients) would
take more than GROUPED_MEMORY_SHARE of the device's memory; the per-expert loop then, whose working set is one
expert's slice. On the CPU the layer hands the experts token ranges whose working set stays under CPU_CHUNK_BYTES
(`tokens_per_call`); on a GPU the whole batch is one call. No batch-size threshold tuned on one machine: on
2-core CPUs the loop and one grouped call trade places between machines (on one 2-core VM the loop was 2x slower than
grouped_mm at 4,096 tokens; on another, up to 12% faster at 4,096 tokens and 30% at 16,384), grouped calls
of bounded size are within 12% of the loop on the second, and on a GPU the loop launches E small
matmuls from Python for every batch (benchmarks/speed/moe_layer.py; docs/gpu.md).

Host synchronisation: the grouped-matmul path takes the per-expert slot counts as a device tensor (group
offsets by cumsum, the counts by index_add rather than bincount), so a dropless forward and backward copy
nothing to the host (on CUDA that holds for torch's bf16 CUTLASS kernels on sm90/sm100; its fallback for other
dtypes and GPUs reads the offsets itself; tests/package/test_no_sync.py). The per-expert loop slices the slots of each
expert in Python and so reads the counts once (`.tolist()`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import NamedTuple

import torch

from .autocast import autocast_available, autocast_off
from .routing_context import ROUTING


def _hidden(act, pre_nI: torch.Tensor, gated: bool, grad_h: torch.Tensor | None = None):
    """h from the input projection; with `grad_h`, also d loss / d pre (laid out like pre)."""
    # split(), not slicing: under autograd (small-batch path) its backward is one cat, where each slice's
    # backward would zero-fill a full-size gradient
    a, up = pre_nI.split(pre_nI.shape[1] // 2, dim=1) if gated else (pre_nI, None)
    F_ = a.shape[1]
    if grad_h is None:
        h = act(a)
        if gated:   # in place into act's fresh output, except where autograd may need that output (sigmoid,
            #          tanh) or act returned its input ("linear")
            h = h * up if h.requires_grad or h is a else h.mul_(up)
        return h, None
    with torch.enable_grad():
        leaf = a.detach().requires_grad_(True)
        act_a = act(leaf)
    if not gated:
        (grad_pre,) = torch.autograd.grad(act_a, leaf, grad_h)
        return act_a.detach(), grad_pre
    grad_pre = torch.empty_like(pre_nI)
    (grad_pre[:, :F_],) = torch.autograd.grad(act_a, leaf, grad_h * up)
    act_a = act_a.detach()
    torch.mul(grad_h, act_a, out=grad_pre[:, F_:])
    return act_a * up, grad_pre


def segments(counts: list[int]):
    """(expert, slot slice) for every expert that received slots."""
    start = 0
    for e, n in enumerate(counts):
        if n:
            yield e, slice(start, start + n)
            start += n


def _expert_ffn(act, gated, x_nD, w_in, b_in, w_down, b_down):
    pre = torch.mm(x_nD, w_in.t())
    if b_in is not None:
        pre += b_in
    h, _ = _hidden(act, pre, gated)
    y = torch.mm(h, w_down.t())
    if b_down is not None:
        y += b_down
    return pre, y


ACCUMULATOR = torch.float32     # dtype the weighted expert outputs are summed in


class Slots(NamedTuple):
    """The routed token-slots, sorted by expert: each slot's token index [N] and combine weight [N], and the
    slots per expert [E] (a device tensor keeps the grouped path free of host syncs; the loop reads it once)."""

    tokens_N: torch.Tensor
    weights_N: torch.Tensor
    counts: torch.Tensor | list[int]


class ExpertFFN(NamedTuple):
    """The stacked experts as the kernels take them: the activation, whether it is gated, the input projection
    `w_in` [E, I, D] (I = 2F gated: gate rows then up rows), `w_down` [E, D, F] and the biases (or None)."""

    act: Callable
    gated: bool
    w_in: torch.Tensor
    b_in: torch.Tensor | None
    w_down: torch.Tensor
    b_down: torch.Tensor | None

    def cast(self, fn: Callable) -> ExpertFFN:
        """The same experts with `fn` applied to each weight (None stays None)."""
        return self._replace(**{k: None if t is None else fn(t) for k, t in
                                (("w_in", self.w_in), ("b_in", self.b_in), ("w_down", self.w_down),
                                 ("b_down", self.b_down))})


def _run(x_TD, slots: Slots, ffn: ExpertFFN, keep: list | None):
    """Per-expert loop: gather the expert's tokens, run its FFN, add the float32-weighted output. Weights in
    another dtype than x are cast one expert at a time (inference only: the autograd path casts beforehand)."""
    tokens_N, weights_N, counts = slots
    act, gated, w_in, b_in, w_down, b_down = ffn
    if torch.is_tensor(counts):
        counts = counts.tolist()        # the loop slices per expert on the host: its one sync
    y_TD = x_TD.new_zeros(x_TD.shape[0], w_down.shape[1], dtype=ACCUMULATOR)

    def of(t, e):
        return None if t is None else t[e].to(x_TD.dtype)

    for e, rows in segments(counts):
        idx = tokens_N[rows]
        pre, y = _expert_ffn(act, gated, x_TD[idx], of(w_in, e), of(b_in, e), of(w_down, e), of(b_down, e))
        weights = weights_N[rows, None]
        if keep is not None:
            keep.append((pre, y))       # per-expert tensors: small allocations the allocator can recycle
            y = y.to(ACCUMULATOR) * weights     # y itself is kept (unweighted) for the combine weights' gradient
        elif y.dtype == ACCUMULATOR:
            y.mul_(weights)
        else:
            y = y.to(ACCUMULATOR).mul_(weights)
        y_TD.index_add_(0, idx, y)
    return y_TD


class SegmentBias(torch.autograd.Function):
    """out[n] = x[n] + b[expert(n)] for slots sorted by expert; the bias gradient is each expert's sum over its
    own contiguous segment, computed as one matmul of the slots' one-hot expert matrix [E, N] with the gradient
    [N, I]. Autograd of `x + b[expert_N]` would instead run an index_put with accumulation in the backward (on
    CUDA a sort-based kernel over N slots that name only E distinct rows: the slowest op of a biased layer)."""

    @staticmethod
    def forward(ctx, x_NI, b_EI, expert_N):
        ctx.save_for_backward(expert_N)
        ctx.num_experts = b_EI.shape[0]
        return x_NI + b_EI.index_select(0, expert_N)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_NI):
        (expert_N,) = ctx.saved_tensors
        g_b = None
        if ctx.needs_input_grad[1]:
            experts_E = torch.arange(ctx.num_experts, device=expert_N.device)
            onehot_EN = (expert_N[None, :] == experts_E[:, None]).to(g_NI.dtype)
            g_b = torch.mm(onehot_EN, g_NI)
        return g_NI, g_b, None


def _add_segment_bias(x_NI: torch.Tensor, b_EI: torch.Tensor | None, expert_N: torch.Tensor) -> torch.Tensor:
    if b_EI is None:
        return x_NI
    if torch.is_grad_enabled() and (x_NI.requires_grad or b_EI.requires_grad):
        return SegmentBias.apply(x_NI, b_EI, expert_N)
    return x_NI.add_(b_EI.index_select(0, expert_N))


def _run_grouped_mm(x_TD, slots: Slots, ffn: ExpertFFN):
    """All experts at once with torch's grouped matmul; differentiable by autograd (small batches)."""
    tokens_N, weights_N, counts = slots
    act, gated, w_in, b_in, w_down, b_down = ffn
    offsets = counts.cumsum(0, dtype=torch.int32)
    expert_N = None
    if b_in is not None or b_down is not None:     # output_size given: no host read of the counts' sum
        expert_N = torch.repeat_interleave(torch.arange(counts.shape[0], device=x_TD.device), counts,
                                           output_size=tokens_N.shape[0])
    # index_select, not x_TD[tokens_N]: its backward is an index_add, where indexing's is an index_put
    pre = torch.nn.functional.grouped_mm(x_TD.index_select(0, tokens_N), w_in.transpose(-2, -1), offs=offsets)
    pre = _add_segment_bias(pre, b_in, expert_N)
    h, _ = _hidden(act, pre, gated)
    y = torch.nn.functional.grouped_mm(h, w_down.transpose(-2, -1), offs=offsets)
    y = _add_segment_bias(y, b_down, expert_N)
    y = y.to(ACCUMULATOR) * weights_N[:, None]
    return x_TD.new_zeros(x_TD.shape[0], w_down.shape[1], dtype=ACCUMULATOR).index_add_(0, tokens_N, y)


class GroupedFFN(torch.autograd.Function):
    """The per-expert loop with its hand-written backward. The tensors a gradient may reach are arguments of their
    own (autograd tracks each); the rest, `spec` = (counts, activation, gated), rides along."""

    @staticmethod
    def forward(ctx, x_TD, tokens_N, weights_N, w_in, b_in, w_down, b_down, spec):
        counts, act, gated = spec
        counts = counts.tolist()
        ctx.kept = []
        y_TD = _run(x_TD, Slots(tokens_N, weights_N, counts), ExpertFFN(act, gated, w_in, b_in, w_down, b_down),
                    ctx.kept)
        ctx.counts, ctx.act, ctx.gated = counts, act, gated
        ctx.has_bias = (b_in is not None, b_down is not None)
        ctx.save_for_backward(x_TD, tokens_N, weights_N, w_in, w_down)
        return y_TD

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy_TD):
        x_TD, tokens_N, weights_N, w_in, w_down = ctx.saved_tensors
        need_x, _, need_weights, need_w_in, need_b_in, need_w_down, need_b_down, _ = ctx.needs_input_grad
        gx_TD = torch.zeros_like(x_TD) if need_x else None
        g_weights = torch.empty_like(weights_N) if need_weights else None      # every slot is written
        # expert gradients: written in place per expert; experts that got no slot are zeroed below
        g_w_in = torch.empty_like(w_in) if need_w_in else None
        g_w_down = torch.empty_like(w_down) if need_w_down else None
        g_b_in = w_in.new_empty(w_in.shape[:2]) if ctx.has_bias[0] and need_b_in else None
        g_b_down = w_down.new_empty(w_down.shape[:2]) if ctx.has_bias[1] and need_b_down else None
        for (e, rows), (pre, y) in zip(segments(ctx.counts), ctx.kept, strict=True):
            idx = tokens_N[rows]
            gy = gy_TD[idx]
            if g_weights is not None:
                g_weights[rows] = (gy * y).sum(-1, dtype=torch.float32).to(g_weights.dtype)
            gy = (gy * weights_N[rows, None]).to(w_down.dtype)      # float32 accumulator -> compute dtype
            h, g_pre = _hidden(ctx.act, pre, ctx.gated, torch.mm(gy, w_down[e]))
            if g_w_down is not None:
                torch.mm(gy.t(), h, out=g_w_down[e])
            if g_b_down is not None:
                torch.sum(gy, 0, out=g_b_down[e])
            if g_w_in is not None:
                torch.mm(g_pre.t(), x_TD[idx], out=g_w_in[e])
            if g_b_in is not None:
                torch.sum(g_pre, 0, out=g_b_in[e])
            if gx_TD is not None:
                gx_TD.index_add_(0, idx, torch.mm(g_pre, w_in[e]))
        for e, n in enumerate(ctx.counts):
            if n == 0:
                for g in (g_w_in, g_b_in, g_w_down, g_b_down):
                    if g is not None:
                        g[e].zero_()
        ctx.kept = None
        return gx_TD, None, g_weights, g_w_in, g_b_in, g_w_down, g_b_down, None


def compute_dtype(device: torch.device, weights_dtype: torch.dtype, input_dtype: torch.dtype | None = None
                  ) -> torch.dtype:
    """The autocast dtype when autocast is on for this device, else the wider of the weights' and the input's
    dtype (torch's promotion: float32 inputs to bfloat16 weights compute in float32)."""
    if autocast_available(device.type) and torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return weights_dtype if input_dtype is None else torch.promote_types(weights_dtype, input_dtype)


def grouped_ffn(x_TD: torch.Tensor, slots: Slots, ffn: ExpertFFN) -> torch.Tensor:
    """y[t] = sum of weight * FFN_e(x[t]) over token t's slots; slots sorted by expert (module docstring)."""
    device = x_TD.device
    dtype = compute_dtype(device, ffn.w_in.dtype, x_TD.dtype)
    slots = slots._replace(counts=torch.as_tensor(slots.counts, device=device))
    off = autocast_off(device.type)
    path = kernel_path(slots.tokens_N.numel(), ffn.w_in.shape, ffn.w_down.shape, dtype, device)
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x_TD, slots.weights_N, ffn.w_in, ffn.b_in, ffn.w_down, ffn.b_down))
    if path == "grouped_mm" and not needs_grad and ffn.w_in.dtype != dtype:
        # grouped_mm would need every expert's weights cast at once (a copy of the whole stack) for one small
        # batch; the loop casts only the experts that got tokens, one at a time
        path = "loop"
    with off:
        # the inference loop casts each expert's weights as it runs them (`_run`); the other paths cast here
        if not (path == "loop" and not needs_grad):
            ffn = ffn.cast(lambda t: t.to(dtype))
        x = x_TD.to(dtype).contiguous()
        y_TD = _dispatch(x, slots._replace(weights_N=slots.weights_N.to(ACCUMULATOR)), ffn, path, needs_grad)
    return y_TD.to(x_TD.dtype)


# The device types torch implements grouped_mm on; on others (MPS, XPU) every batch takes the loop.
GROUPED_MM_DEVICES = frozenset({"cpu", "cuda"})
# The grouped path's working set may take up to this share of the device's memory; a batch whose working set is
# larger takes the per-expert loop, whose working set is one expert's slice (the rule and its measurements: the
# module docstring).
GROUPED_MEMORY_SHARE = 1 / 8

@contextlib.contextmanager
def forced_kernel_path(path: str | None):
    """Every MoE batch inside takes `path` ("grouped_mm" or "loop") where grouped_mm can run at all (benchmarks
    and tests compare the two); None restores the rule. Held in `ROUTING.kernel_path` (a plain attribute:
    torch.compile traces its read)."""
    if path not in (None, "grouped_mm", "loop"):
        raise ValueError(f"kernel path must be grouped_mm, loop or None, got {path!r}")
    with ROUTING.using(kernel_path=path):
        yield


def grouped_working_bytes(slots: int, w_in_shape, w_down_shape, dtype: torch.dtype) -> int:
    """Bytes the grouped path holds at once beyond the batch and the weights: per slot the gathered input, the
    input projection, the hidden state and the output in the compute dtype and the float32 weighted output (the
    forward), and about as much again for the backward's gradients."""
    _, rows, width = w_in_shape
    hidden = w_down_shape[2]
    size = torch.empty((), dtype=dtype).element_size()
    return 2 * slots * ((2 * width + rows + hidden) * size + width * 4)


def _ram() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 * 2**30


CPU_MEMORY = _ram()     # read once, at import: torch.compile cannot trace os.sysconf


def device_memory(device: torch.device) -> int:
    """The device's memory in bytes (a GPU's total, the machine's RAM for the CPU): a fact of the machine, so a
    batch takes the same path every time it comes (no dependence on what happens to be free)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device.index or 0).total_memory
    return CPU_MEMORY


def choose_path(slots: int, w_in_shape, w_down_shape, dtype: torch.dtype, *, device_type: str, memory: int,
                has_grouped_mm: bool = True) -> str:
    """The rule, a function of the batch and the device's facts: "grouped_mm" where torch has it for the device,
    the rows are 16-byte aligned (grouped_mm's requirement) and the working set fits in GROUPED_MEMORY_SHARE of
    the device's memory; else "loop"."""
    if not can_group(w_in_shape, w_down_shape, dtype, device_type, has_grouped_mm):
        return "loop"
    fits = grouped_working_bytes(slots, w_in_shape, w_down_shape, dtype) <= GROUPED_MEMORY_SHARE * memory
    return "grouped_mm" if fits else "loop"


def can_group(w_in_shape, w_down_shape, dtype: torch.dtype, device_type: str, has_grouped_mm: bool = True) -> bool:
    """Whether grouped_mm can run these experts at all: torch has it for the device, and every row stride is a
    multiple of 16 bytes."""
    if not has_grouped_mm or device_type not in GROUPED_MM_DEVICES:
        return False
    size = torch.empty((), dtype=dtype).element_size()
    return all(d * size % 16 == 0 for d in (w_in_shape[1], w_in_shape[2], w_down_shape[2]))


# On the CPU a batch runs as calls of at most this much working set each (`tokens_per_call`): fresh tensors of
# hundreds of MB cost more there in page faults than their matmuls. Measured on the 2-core VM (SmolLM2's FFN,
# 8 experts, top-2, fwd+bwd of 16,384 tokens, medians of 5, two runs): one grouped call 3.59 s, calls of 2,048 /
# 3,072 / 4,096 tokens 3.18-3.30 s, the per-expert loop 3.0 s. 400 MiB is about 4,096 such tokens, so batches up
# to that size stay one call (where one call is as fast as any split of it).
CPU_CHUNK_BYTES = 400 * 2**20


def tokens_per_call(tokens: int, slots_per_token: int, w_in_shape, w_down_shape, dtype: torch.dtype,
                    device: torch.device) -> int:
    """How many of a batch's tokens one expert call takes: every token on a GPU (one grouped_mm launch per
    projection), on the CPU as many as keep the call's working set under CPU_CHUNK_BYTES."""
    if device.type != "cpu":
        return tokens
    per_token = grouped_working_bytes(slots_per_token, w_in_shape, w_down_shape, dtype)
    return max(1, min(tokens, CPU_CHUNK_BYTES // max(per_token, 1)))


def kernel_path(slots: int, w_in_shape, w_down_shape, dtype: torch.dtype, device: torch.device | str) -> str:
    """The path a batch takes on `device`: `choose_path` with the device's facts, or the forced path where
    grouped_mm can run."""
    device = torch.device(device)
    has = hasattr(torch.nn.functional, "grouped_mm")
    forced = ROUTING.kernel_path
    if forced is not None and can_group(w_in_shape, w_down_shape, dtype, device.type, has):
        return forced
    if dtype != torch.bfloat16 and torch.compiler.is_compiling():
        return "loop"           # torch's grouped_mm has a compile-time (fake tensor) kernel for bfloat16 only
    memory = device_memory(device) if device.type in GROUPED_MM_DEVICES else 0
    return choose_path(slots, w_in_shape, w_down_shape, dtype, device_type=device.type, memory=memory,
                       has_grouped_mm=has)


def _dispatch(x_TD: torch.Tensor, slots: Slots, ffn: ExpertFFN, path: str, needs_grad: bool) -> torch.Tensor:
    """The path `kernel_path` picked; the loop as an autograd Function when a gradient is needed."""
    if path == "grouped_mm":
        return _run_grouped_mm(x_TD, slots, ffn)
    if needs_grad:
        return GroupedFFN.apply(x_TD, slots.tokens_N, slots.weights_N, ffn.w_in, ffn.b_in, ffn.w_down, ffn.b_down,
                                (slots.counts, ffn.act, ffn.gated))
    return _run(x_TD, slots, ffn, keep=None)     # inference: nothing kept for a backward

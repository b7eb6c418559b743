"""Experts stored as one shared base FFN plus a low-rank delta per expert (PESC, Wu et al. 2024; DeRS, CVPR 2025):
W_e = W_base + A_e B_e for each of the expert's matrices (gate, up, down), rank r.

Right after upcycling the experts are the dense FFN, and after training they stay close to it, so E full experts
store (and train) mostly the same numbers. Here a layer holds the dense FFN once and E deltas of 3·r·(D + F)
parameters each (gated; 2·r·(D + F) plain), instead of E·3·D·F.

It also computes less. The base's input projections run once per token, not once per selected expert, and since
the down projection is linear,
    Σ_e w_e (W_down + A_e B_e) h_e = W_down (Σ_e w_e h_e) + Σ_e w_e A_e (B_e h_e),
so the base's down projection runs once per token too: a top-k layer costs the dense FFN's 3·D·F multiply-adds per
token plus, per selected expert, 3·r·(D + F) for the deltas (and the activation of its own hidden state).

Shape suffixes as in `moe.py` (T tokens, D model width, F expert width, E experts, N token-slots sorted by expert),
and R the delta's rank. The deltas start at zero (B drawn, A zero, as LoRA starts), so a new layer computes its base
FFN exactly; `load_deltas` sets them from a method's perturbation.

This module is the expert kind on its own: its forward has the call signature of `moe.Experts.forward`, and
`weights()` materializes the E full experts (base + delta) for the checks, the analysis and exports.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .autocast import autocast_off
from .delta_split import split_experts
from .expert_shape import ExpertShape
from .expert_stack import ExpertStack
from .ffn import FFNWeights, activation_fn
from .grouped_ffn import ACCUMULATOR, can_group, compute_dtype, segments
from .routing_context import ROUTING


def _factor(*shape: int, dtype: torch.dtype | None, zero: bool) -> nn.Parameter:
    t = torch.zeros(*shape, dtype=dtype)
    if not zero:        # Kaiming-uniform as nn.Linear draws its weight, per expert, from the fan-in (the last dim)
        bound = 1.0 / math.sqrt(shape[-1])
        t.uniform_(-bound, bound)
    return nn.Parameter(t)


class GatheredLowRank(torch.autograd.Function):
    """out[s] = base_TF[tokens_N[s]] + A_e xb_N[s] for each slot s of expert e's segment: a base projection
    gathered per slot with each slot's rank-R correction added in place (one [N, F] buffer; a concatenation of
    per-expert corrections and a sum would write two more). Its backward is the gather's (an index_add) and, per
    segment, the two products of the correction."""

    @staticmethod
    def forward(ctx, base_TF: torch.Tensor, tokens_N: torch.Tensor, xb_NR: torch.Tensor, a_EFR: torch.Tensor,
                segments: list[tuple[int, slice]]) -> torch.Tensor:
        out_NF = base_TF.index_select(0, tokens_N)
        for e, rows in segments:
            torch.addmm(out_NF[rows], xb_NR[rows], a_EFR[e].t(), out=out_NF[rows])
        ctx.save_for_backward(tokens_N, xb_NR, a_EFR)
        ctx.segments, ctx.base_shape = segments, base_TF.shape
        return out_NF

    @staticmethod
    def backward(ctx, grad_NF: torch.Tensor):
        tokens_N, xb_NR, a_EFR = ctx.saved_tensors
        grad_base = grad_xb = grad_a = None
        if ctx.needs_input_grad[0]:
            grad_base = grad_NF.new_zeros(ctx.base_shape).index_add_(0, tokens_N, grad_NF)
        if ctx.needs_input_grad[2]:
            grad_xb = xb_NR.new_empty(xb_NR.shape)
            for e, rows in ctx.segments:
                torch.mm(grad_NF[rows], a_EFR[e], out=grad_xb[rows])
        if ctx.needs_input_grad[3]:
            grad_a = torch.zeros_like(a_EFR)
            for e, rows in ctx.segments:
                torch.mm(grad_NF[rows].t(), xb_NR[rows], out=grad_a[e])
        return grad_base, None, grad_xb, grad_a, None


class GatedHidden(torch.autograd.Function):
    """act(gate) * up, keeping only gate and up for the backward pass (act(gate) is made again there): one [N, F]
    tensor fewer than autograd would keep."""

    @staticmethod
    def forward(ctx, gate_NF: torch.Tensor, up_NF: torch.Tensor, act) -> torch.Tensor:
        ctx.save_for_backward(gate_NF, up_NF)
        ctx.act = act
        return act(gate_NF) * up_NF

    @staticmethod
    def backward(ctx, grad_NF: torch.Tensor):
        gate_NF, up_NF = ctx.saved_tensors
        with torch.enable_grad():
            gate = gate_NF.detach().requires_grad_()
            # the module's forward, not the module: hooks on a module call (a FLOP counter's module tracker) must not
            # see this inner graph, whose autograd.grad runs inside the outer backward
            a_NF = ctx.act.forward(gate)
            (grad_gate,) = torch.autograd.grad(a_NF, gate, grad_NF * up_NF)
        return grad_gate, grad_NF * a_NF.detach(), None


# every tensor a delta layer may hold (None where its FFN has no gate or no bias)
PARAMETERS = ("base_up", "base_gate", "base_down", "base_b_up", "base_b_gate", "base_b_down", "up_a", "up_b", "gate_a",
              "gate_b", "down_a", "down_b")


def low_rank_path(device: torch.device, dtype: torch.dtype, rank: int, hidden: int, width: int) -> str:
    """How a delta layer runs its experts' low-rank products: "grouped_mm" (one call per product for all experts,
    the slot counts never read on the host) on a GPU where torch's grouped_mm takes these shapes (rows 16-byte
    aligned), "loop" (per expert, in place; the faster on the CPU) elsewhere; a path forced for tests and
    benchmarks (`grouped_ffn.forced_kernel_path`) where it can run. Under torch.compile, grouped_mm's compile-time
    kernel takes bfloat16 alone."""
    can = can_group((1, rank, hidden), (1, hidden, width), dtype, device.type,
                    hasattr(torch.nn.functional, "grouped_mm"))
    if not can or (dtype != torch.bfloat16 and torch.compiler.is_compiling()):
        return "loop"
    forced = ROUTING.kernel_path
    if forced is not None:
        return forced
    return "grouped_mm" if device.type == "cuda" else "loop"


def expert_segments(counts: torch.Tensor | list[int], slots: int) -> list[tuple[int, slice]]:
    """(expert, its slice of the sorted slots) for every expert with slots: the counts read on the host (a memory
    plan's trace, which has no counts to read, replaces this with equal shares of the `slots`)."""
    return list(segments(counts.tolist() if torch.is_tensor(counts) else list(counts)))


class DeltaExperts(ExpertStack):
    """E experts as a base FFN (`base_*`: the dense FFN's matrices, [F, D] and [D, F]) plus, per matrix, rank-R
    factors: `gate_a` [E, F, R] and `gate_b` [E, R, D] (gated only), `up_a` / `up_b` alike, `down_a` [E, D, R] and
    `down_b` [E, R, F]. The base's biases are the experts' (no per-expert bias). `train_base=False` freezes the
    base: only the deltas train."""

    def __init__(self, num_experts: int, shape: ExpertShape, rank: int, *, dtype: torch.dtype | None = None,
                 train_base: bool = True) -> None:
        """E experts of `shape` (the dense FFN's structure, as `moe.Experts` takes it) with rank-`rank` deltas."""
        super().__init__()
        E, D, F_, R = num_experts, shape.hidden_size, shape.intermediate_size, rank
        if R < 1 or R > min(D, F_):
            raise ValueError(f"delta rank must be between 1 and min(D, F) = {min(D, F_)}, got {R}")
        gated, bias_in, bias_down = shape.gated, shape.bias_in, shape.bias_down
        self.activation, self.gated, self.intermediate_size, self.rank = shape.activation, gated, F_, R
        self.act = activation_fn(shape.activation)
        self.base_up = nn.Parameter(torch.zeros(F_, D, dtype=dtype))
        self.base_gate = nn.Parameter(torch.zeros(F_, D, dtype=dtype)) if gated else None
        self.base_down = nn.Parameter(torch.zeros(D, F_, dtype=dtype))
        self.base_b_up = nn.Parameter(torch.zeros(F_, dtype=dtype)) if bias_in else None
        self.base_b_gate = nn.Parameter(torch.zeros(F_, dtype=dtype)) if bias_in and gated else None
        self.base_b_down = nn.Parameter(torch.zeros(D, dtype=dtype)) if bias_down else None
        self.up_a, self.up_b = _factor(E, F_, R, dtype=dtype, zero=True), _factor(E, R, D, dtype=dtype, zero=False)
        self.gate_a = _factor(E, F_, R, dtype=dtype, zero=True) if gated else None
        self.gate_b = _factor(E, R, D, dtype=dtype, zero=False) if gated else None
        self.down_a, self.down_b = _factor(E, D, R, dtype=dtype, zero=True), _factor(E, R, F_, dtype=dtype, zero=False)
        self.train_base = train_base
        for p in self.base_parameters():
            p.requires_grad_(train_base)
        # what the last `load_weights` kept of the experts' differences from the base: matrix -> the smallest share
        # of an expert's residual energy kept (1.0: exact); not saved (a report reads it at conversion)
        self.energy_kept: dict[str, float] = {}

    @property
    def num_experts(self) -> int:
        return self.down_a.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.base_down.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.base_down.dtype

    @property
    def bias_in(self) -> bool:
        return self.base_b_up is not None

    @property
    def bias_down(self) -> bool:
        return self.base_b_down is not None

    @staticmethod
    def matrix_of(name: str) -> str:
        """Which matrix a parameter of this module belongs to: gate, up or down (`base_b_up` -> up, `down_a` ->
        down), for the freezing groups."""
        return name.removeprefix("base_").removeprefix("b_").split("_")[0]

    def shared_parameters(self) -> list[nn.Parameter]:
        return self.base_parameters()

    def base_parameters(self) -> list[nn.Parameter]:
        return [p for p in (self.base_up, self.base_gate, self.base_down, self.base_b_up, self.base_b_gate,
                            self.base_b_down) if p is not None]

    def _pairs(self) -> dict[str, tuple[nn.Parameter, nn.Parameter, nn.Parameter]]:
        """matrix -> (its base, A, B)."""
        pairs = {"w_up": (self.base_up, self.up_a, self.up_b), "w_down": (self.base_down, self.down_a, self.down_b)}
        if self.gated:
            pairs["w_gate"] = (self.base_gate, self.gate_a, self.gate_b)
        return pairs

    @torch.no_grad()
    def load_base(self, dense: FFNWeights) -> None:
        """The base FFN from one dense FFN (its matrices and biases; a missing input bias is zero)."""
        if dense.stacked or dense.gated != self.gated or dense.w_down.shape != self.base_down.shape:
            raise ValueError(f"a dense FFN of shape {tuple(dense.w_down.shape)} (gated={dense.gated}) does not fit "
                             f"{tuple(self.base_down.shape)} (gated={self.gated})")
        for name, (base, _, _) in self._pairs().items():
            base.copy_(getattr(dense, name))
        for ours, theirs in ((self.base_b_up, dense.b_up), (self.base_b_gate, dense.b_gate),
                             (self.base_b_down, dense.b_down)):
            if ours is not None:
                ours.copy_(theirs if theirs is not None else torch.zeros_like(ours))
            elif theirs is not None:
                raise ValueError("the dense FFN has a bias the layer does not")

    @torch.no_grad()
    def load_weights(self, weights: FFNWeights, base: FFNWeights | None = None) -> None:
        """Full stacked experts in, as `base` (the dense FFN they came from; default: their mean) plus each
        expert's difference from it cut to this layer's rank (`delta_split.split_experts`: exact when the
        differences have at most that rank, a copy's zero differences among them; else their best rank-R
        approximation, the share kept in `energy_kept`). A base bias is the experts' mean bias."""
        if weights.num_experts != self.num_experts:
            raise ValueError(f"{weights.num_experts} experts do not fit a layer of {self.num_experts}")
        split = split_experts(weights.map(lambda t: t.float()), self.rank,
                              None if base is None else base.map(lambda t: t.float()))
        self.load_base(split.base)
        self.load_deltas(split.deltas)
        self.energy_kept = {name: float(kept.min()) for name, kept in split.energy.items()}

    @torch.no_grad()
    def load_deltas(self, deltas: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Each matrix's factors (A [E, rows, R], B [E, R, cols]) for the matrices named (w_up, w_gate, w_down)."""
        pairs = self._pairs()
        for name, (a, b) in deltas.items():
            _, a_ours, b_ours = pairs[name]
            if a.shape != a_ours.shape or b.shape != b_ours.shape:
                raise ValueError(f"{name}: factors {tuple(a.shape)} x {tuple(b.shape)} do not fit "
                                 f"{tuple(a_ours.shape)} x {tuple(b_ours.shape)}")
            a_ours.copy_(a)
            b_ours.copy_(b)

    def weights(self, detach: bool = True) -> FFNWeights:
        """The E full experts, base + A B, stacked (canonical, unfused): what a full-expert layer would hold."""
        def full(name: str) -> torch.Tensor:
            base, a, b = self._pairs()[name]
            w = base.unsqueeze(0) + torch.bmm(a, b)
            return w.detach() if detach else w

        def bias(b: torch.Tensor | None) -> torch.Tensor | None:
            if b is None:
                return None
            b = b.unsqueeze(0).expand(self.num_experts, -1)
            return b.detach() if detach else b

        return FFNWeights(w_up=full("w_up"), w_down=full("w_down"), activation=self.activation,
                          w_gate=full("w_gate") if self.gated else None, b_up=bias(self.base_b_up),
                          b_gate=bias(self.base_b_gate), b_down=bias(self.base_b_down))

    def forward(self, x_TD: torch.Tensor, tokens_N: torch.Tensor, weights_N: torch.Tensor,
                counts: torch.Tensor | list[int]) -> torch.Tensor:
        """The layer's output in x's dtype, computed as the full experts compute theirs (`grouped_ffn.grouped_ffn`):
        in the autocast dtype when autocast is on (the parameters cast once per forward, autocast then off, so that
        every product of the layer takes one dtype), else in the wider of the parameters' and the input's."""
        dtype = compute_dtype(x_TD.device, self.dtype, x_TD.dtype)
        with autocast_off(x_TD.device.type):
            params = {name: None if t is None else t.to(dtype)
                      for name in PARAMETERS for t in [getattr(self, name)]}
            return self._forward(x_TD.to(dtype), tokens_N, weights_N, counts, params).to(x_TD.dtype)

    def _forward(self, x_TD: torch.Tensor, tokens_N: torch.Tensor, weights_N: torch.Tensor,
                 counts: torch.Tensor | list[int], p: dict) -> torch.Tensor:
        """y[t] = Σ over token t's slots s of weights_N[s] · expert_s(x[t]); slots sorted by expert, one per
        kept slot (as `moe.Experts.forward` takes them). The base runs once per token, each delta on its expert's
        slots: per expert in a loop (`expert_segments`: the counts read on the host), or all experts in one
        grouped_mm per product (on a GPU: nothing read on the host), as `low_rank_path` picks."""
        linear = torch.nn.functional.linear
        grouped = low_rank_path(x_TD.device, x_TD.dtype, self.rank, self.hidden_size, self.intermediate_size) \
            == "grouped_mm"
        if grouped:
            offsets = (counts if torch.is_tensor(counts) else torch.tensor(counts, device=x_TD.device)).cumsum(
                0, dtype=torch.int32)
            rows_of = None
        else:
            rows_of = expert_segments(counts, tokens_N.shape[0])
        # the base's input projections, once per token
        up_TF = linear(x_TD, p["base_up"], p["base_b_up"])
        gate_TF = linear(x_TD, p["base_gate"], p["base_b_gate"]) if self.gated else None
        x_ND = x_TD.index_select(0, tokens_N)
        # each expert's low-rank input corrections on its slots: B_e x for gate and up in one product (x read once),
        # then A_e (B_e x) added to the gathered base projections
        b_in = torch.cat([p["gate_b"], p["up_b"]], 1) if self.gated else p["up_b"]      # [E, 2R or R, D]
        R = self.rank
        if grouped:
            gm = torch.nn.functional.grouped_mm
            xb_NR = gm(x_ND, b_in.transpose(-2, -1), offs=offsets)
            up_NF = up_TF.index_select(0, tokens_N) + gm(xb_NR[:, -R:].contiguous(), p["up_a"].transpose(-2, -1),
                                                         offs=offsets)
            gate_NF = gate_TF.index_select(0, tokens_N) + gm(
                xb_NR[:, :R].contiguous(), p["gate_a"].transpose(-2, -1), offs=offsets) if self.gated else None
        else:
            experts, sizes = [e for e, _ in rows_of], [rows.stop - rows.start for _, rows in rows_of]
            # split, not sliced: split's backward is one concatenation, slicing's a zero [N, D] per expert
            xb_NR = torch.cat([linear(x, b_in[e]) for e, x in zip(experts, x_ND.split(sizes), strict=True)]) \
                if rows_of else x_ND.new_zeros(0, b_in.shape[1])
            up_NF = GatheredLowRank.apply(up_TF, tokens_N, xb_NR[:, -R:], p["up_a"], rows_of)
            gate_NF = GatheredLowRank.apply(gate_TF, tokens_N, xb_NR[:, :R], p["gate_a"], rows_of) \
                if self.gated else None
        del up_TF, gate_TF              # [T, F] each: gathered, not kept (the backward needs only the indices)
        if self.gated:
            h_NF = GatedHidden.apply(gate_NF, up_NF, self.act)     # keeps gate and up, not act(gate) too
        else:
            h_NF = self.act(up_NF)
        del up_NF, gate_NF              # kept by autograd where the backward needs them, and only there
        w_N1 = weights_N.unsqueeze(1).to(h_NF.dtype)
        # the base's down projection once per token, on the weighted sum of its slots' hidden states; sums in
        # float32 as the full experts' (`grouped_ffn.ACCUMULATOR`), so that a bfloat16 layer rounds each term once
        acc = torch.promote_types(h_NF.dtype, ACCUMULATOR)
        wh_TF = h_NF.new_zeros(x_TD.shape[0], h_NF.shape[1], dtype=acc).index_add(0, tokens_N, (h_NF * w_N1).to(acc))
        y_TD = linear(wh_TF.to(h_NF.dtype), p["base_down"]).to(acc)
        if p["base_b_down"] is not None:      # each slot adds the bias, weighted, as a full expert would
            y_TD = y_TD + x_TD.new_zeros(x_TD.shape[0], 1, dtype=acc).index_add(
                0, tokens_N, w_N1.to(acc)) * p["base_b_down"]
        # each expert's down delta, on its slots: A_e (w · B_e h), the weight applied to the rank-R product so that
        # the hidden states kept for the backward pass are h's own (no weighted copy of them)
        if grouped:
            hb_NR = gm(h_NF, p["down_b"].transpose(-2, -1), offs=offsets) * w_N1
            y_TD = y_TD.index_add(0, tokens_N, gm(hb_NR, p["down_a"].transpose(-2, -1), offs=offsets).to(acc))
        elif rows_of:
            downs = [linear(linear(h, p["down_b"][e]) * w, p["down_a"][e])
                     for e, h, w in zip(experts, h_NF.split(sizes), w_N1.split(sizes), strict=True)]
            y_TD = y_TD.index_add(0, tokens_N, torch.cat(downs).to(acc))
        return y_TD

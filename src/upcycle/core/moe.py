"""The Mixture-of-Experts layer that replaces a dense FFN (docs/methods.md §1).

Routing follows Switch/GShard top-k routing (Fedus et al. 2021; Lepikhin et al. 2020) with the choices the
upcycling papers need: renormalized or raw top-k weights (CLIP-UP eq. 4), optional shared experts, optional
expert capacity with first-come-first-serve dropping, and a selection-only bias (DeepSeek-V3 aux-loss-free
balancing, docs/methods.md §4.5) that changes which experts are chosen but never the combine weights.

Shape suffixes (torchtitan's legend):
  T tokens (batch x sequence flattened)   D model width      F expert intermediate width
  E routed experts                         K experts per token (top-k)   S shared experts
  N token-slots after dispatch (= T*K, minus dropped slots)

Dispatch sorts token-slots by expert; `grouped_ffn` then gathers each expert's tokens, runs its FFN and adds
the weighted output per token, and its backward writes each expert's weight gradient straight into one
stacked gradient (it never indexes the stacked parameter under autograd, which would zero-fill a full
[E, F, D] gradient per expert).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch
from torch import nn

from ..config import MoEConfig
from .delta_experts import DeltaExperts
from .expert_shape import STRUCTURE, ExpertShape
from .expert_stack import ExpertStack
from .ffn import FFNWeights, activation_fn
from .grouped_ffn import ExpertFFN, Slots, grouped_ffn
from .router import Router, RoutingRecord, count_ids
from .routing_context import ROUTING, recompute_contexts


@contextlib.contextmanager
def joined_records(model: nn.Module):
    """Several forwards (a batch run as length-bucketed chunks) as one routing record per MoE layer: on leaving
    the block each layer's `last_record` is the concatenation of the records its forwards made inside, in
    order, so the router losses, the statistics and the balancer read the whole batch as if it had been one
    forward. Nested use joins into the outermost block."""
    if ROUTING.joined is not None:
        yield
        return
    layers = moe_layers(model)
    collected = {id(layer): [] for layer in layers.values()}
    with ROUTING.using(joined=collected):
        yield
    for layer in layers.values():
        records = collected[id(layer)]
        if len(records) > 1:
            layer.last_record = RoutingRecord.cat(records)


# a saved spec's keys besides the expert's structure (`expert_shape.STRUCTURE`): the layer's own; then MoEConfig's
LAYER_KEYS = ("num_shared_experts", "shared_intermediate_size", "router_bias", "output_dropout")


class Experts(ExpertStack):
    """E FFNs with stacked weights, held as one input projection and one output projection per expert.

    Gated experts keep gate and up fused, `w_gate_up` [E, 2F, D] (gate rows first), so each expert needs one
    input matmul (the layout transformers' Mixtral/Qwen-MoE experts and vLLM use); plain experts keep
    `w_up` [E, F, D]. `w_down` is [E, D, F]. `weights()` gives the canonical unfused view.
    """

    def __init__(self, num_experts: int, shape: ExpertShape, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        E, D, F_, gated = num_experts, shape.hidden_size, shape.intermediate_size, shape.gated
        bias_in, bias_down = shape.bias_in, shape.bias_down
        self.activation, self.gated, self.intermediate_size = shape.activation, gated, F_
        self.act = activation_fn(shape.activation)
        in_rows = 2 * F_ if gated else F_
        self.in_name = "w_gate_up" if gated else "w_up"
        self.register_parameter(self.in_name, nn.Parameter(torch.zeros(E, in_rows, D, dtype=dtype)))
        self.register_parameter("b_" + self.in_name[2:],
                                nn.Parameter(torch.zeros(E, in_rows, dtype=dtype)) if bias_in else None)
        self.w_down = nn.Parameter(torch.zeros(E, D, F_, dtype=dtype))
        self.b_down = nn.Parameter(torch.zeros(E, D, dtype=dtype)) if bias_down else None

    @property
    def w_in(self) -> torch.Tensor:
        return getattr(self, self.in_name)

    @property
    def b_in(self) -> torch.Tensor | None:
        return getattr(self, "b_" + self.in_name[2:])

    @property
    def num_experts(self) -> int:
        return self.w_down.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w_down.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.w_down.dtype

    @property
    def bias_in(self) -> bool:
        return self.b_in is not None

    @property
    def bias_down(self) -> bool:
        return self.b_down is not None

    @torch.no_grad()
    def load_weights(self, weights: FFNWeights, base: FFNWeights | None = None) -> None:
        """Copy canonical (unfused) stacked weights in; a missing gate or up bias is a zero bias. (`base`: what
        delta experts split them against; whole experts hold them as they are.)"""
        if weights.gated != self.gated or weights.w_down.shape != self.w_down.shape:
            raise ValueError(f"experts of shape {tuple(weights.w_down.shape)} (gated={weights.gated}) do not fit "
                             f"{tuple(self.w_down.shape)} (gated={self.gated})")
        has_in_bias = any(b is not None for b in (weights.b_up, weights.b_gate))
        if has_in_bias != (self.b_in is not None) or (weights.b_down is not None) != (self.b_down is not None):
            raise ValueError("expert biases do not match the layer's")
        F_ = self.intermediate_size
        parts = [(weights.w_gate, weights.b_gate, slice(0, F_)), (weights.w_up, weights.b_up, slice(F_, 2 * F_))] \
            if self.gated else [(weights.w_up, weights.b_up, slice(0, F_))]
        for w, b, rows in parts:
            self.w_in[:, rows].copy_(w)
            if self.b_in is not None:
                self.b_in[:, rows].copy_(b if b is not None else torch.zeros_like(self.b_in[:, rows]))
        self.w_down.copy_(weights.w_down)
        if self.b_down is not None:
            self.b_down.copy_(weights.b_down)

    def weights(self, detach: bool = True) -> FFNWeights:
        """Canonical stacked weights (views, gate and up unfused) for methods, analysis and export."""
        def view(t):
            return None if t is None else t.detach() if detach else t

        F_, w_in, b_in, b_down = self.intermediate_size, view(self.w_in), view(self.b_in), view(self.b_down)
        if not self.gated:
            return FFNWeights(w_up=w_in, b_up=b_in, w_down=view(self.w_down), b_down=b_down,
                              activation=self.activation)
        return FFNWeights(w_gate=w_in[:, :F_], w_up=w_in[:, F_:], w_down=view(self.w_down), b_down=b_down,
                          b_gate=None if b_in is None else b_in[:, :F_], b_up=None if b_in is None else b_in[:, F_:],
                          activation=self.activation)

    def forward(self, x_TD: torch.Tensor, tokens_N: torch.Tensor, weights_N: torch.Tensor,
                counts: torch.Tensor | list[int]) -> torch.Tensor:
        """y[t] = sum of weights_N[s] * expert_s(x[t]) over token t's slots; slots sorted by expert."""
        return grouped_ffn(x_TD, Slots(tokens_N, weights_N, counts),
                           ExpertFFN(self.act, self.gated, self.w_in, self.b_in, self.w_down, self.b_down))


class MoELayer(nn.Module):
    """Router + stacked routed experts (+ optional shared experts), installed where a dense FFN was."""

    def __init__(self, shape: ExpertShape, config: MoEConfig, *, num_shared_experts: int = 0,
                 shared_intermediate_size: int | None = None, router_bias: bool = False,
                 output_dropout: float = 0.0, dtype: torch.dtype | None = None) -> None:
        """An expert's structure as `shape` (the routed and the shared experts share it but for the shared width),
        the routing options as `config`; `from_spec` reads the flat form a saved spec lists them in."""
        super().__init__()
        self.config = config
        self.num_experts, self.top_k = config.num_experts, config.top_k
        # The router stays float32 whatever the model's dtype (torchtitan, ST-MoE: routing is precision-sensitive).
        self.router = Router(shape.hidden_size, config, bias=router_bias)
        self.experts = (DeltaExperts(config.num_experts, shape, config.delta_rank, dtype=dtype,
                                     train_base=config.train_base)
                        if config.experts == "delta" else Experts(config.num_experts, shape, dtype=dtype))
        # shared experts have the routed experts' structure: both come from one dense FFN
        self.shared_experts = (
            Experts(num_shared_experts, shape.with_width(shared_intermediate_size or shape.intermediate_size),
                    dtype=dtype)
            if num_shared_experts else None)
        # Selection-only bias for aux-loss-free balancing; saved with the model (persistent buffer).
        self.register_buffer("selection_bias", torch.zeros(config.num_experts, dtype=torch.float32))
        self.dropout = nn.Dropout(output_dropout)
        self.record_routing = True
        self.recompute = False          # activation checkpointing of this layer alone (`training.recompute`)
        self.last_record: RoutingRecord | None = None

    @classmethod
    def from_spec(cls, spec: dict, dtype: torch.dtype | None = None) -> MoELayer:
        """The layer a saved spec describes (`spec()`: the structure and MoEConfig's keys, flat; files written
        before a key existed lack it and take its default); an unknown key is a TypeError naming it."""
        spec = dict(spec)
        structure = {k: spec.pop(k) for k in STRUCTURE if k in spec}
        layer = {k: spec.pop(k) for k in LAYER_KEYS if k in spec}
        try:
            config = MoEConfig(**spec)
        except TypeError as e:            # an unknown keyword: not a MoEConfig key either
            raise TypeError(f"MoELayer: {e}") from None
        return cls(ExpertShape(**structure), config, **layer, dtype=dtype)

    def spec(self) -> dict:
        """Constructor arguments that rebuild this layer (saved in upcycle_config.json): its structure, and its
        MoEConfig's keys, flat (files written before the config object hold the same keys, minus newer ones)."""
        e, s = self.experts, self.shared_experts
        return {"hidden_size": e.hidden_size, "intermediate_size": e.intermediate_size,
                "activation": e.activation, "gated": e.gated, "bias_in": e.bias_in, "bias_down": e.bias_down,
                "num_shared_experts": s.num_experts if s is not None else 0,
                "shared_intermediate_size": s.intermediate_size if s is not None else None,
                "router_bias": self.router.bias is not None, "output_dropout": self.dropout.p,
                **dataclasses.asdict(self.config)}

    @property
    def normalize_topk(self) -> bool:
        return self.config.normalize_topk

    @property
    def renormalize_after_drop(self) -> bool:
        return self.config.renormalize_after_drop

    @property
    def capacity_factor_train(self) -> float | None:
        return self.config.capacity_factor_train

    @property
    def capacity_factor_eval(self) -> float | None:
        return self.config.capacity_factor_eval

    def capacity(self, num_tokens: int) -> int | None:
        factor = self.capacity_factor_train if self.training else self.capacity_factor_eval
        if factor is None:
            return None
        return math.ceil(factor * num_tokens * self.top_k / self.num_experts)

    def route(self, x_TD: torch.Tensor, mask_T: torch.Tensor | None = None) -> RoutingRecord:
        capacity = self.capacity(int(mask_T.sum()) if mask_T is not None else x_TD.shape[0]) \
            if self.capacity_factor_train is not None or self.capacity_factor_eval is not None else None
        return self.router.route(x_TD, self.selection_bias, mask_T, capacity)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute and self.training and torch.is_grad_enabled():
            # activation checkpointing of this layer alone (`activation_checkpointing: moe`): its inputs are kept,
            # its routing and experts run again in the backward pass, counted once (`recompute_contexts`)
            from torch.utils.checkpoint import checkpoint

            return checkpoint(self._forward, x, use_reentrant=False, context_fn=recompute_contexts)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x_TD = x.reshape(-1, shape[-1])
        T = x_TD.shape[0]
        mask = ROUTING.mask
        if mask is not None and mask is ROUTING.known_mask and mask.numel() == T:
            # the real tokens' positions are known (`real_tokens`): padding is neither routed nor computed
            positions_R = ROUTING.known_positions
            y_RD = self._forward_tokens(x_TD.index_select(0, positions_R), None, positions_R)
            y_TD = x_TD.new_zeros(T, y_RD.shape[-1]).index_copy(0, positions_R, y_RD)
            return y_TD.view(shape)
        mask_T = mask.reshape(-1).bool() if mask is not None and mask.numel() == T else None
        return self._forward_tokens(x_TD, mask_T, None).view(shape)

    def _forward_tokens(self, x_TD: torch.Tensor, mask_T: torch.Tensor | None,
                        positions_T: torch.Tensor | None) -> torch.Tensor:
        """Route and run the tokens [T, D] (`positions_T`: where they sit in the padded batch, when only its
        real tokens are given); returns [T, D]."""
        T = x_TD.shape[0]
        record = self.route(x_TD, mask_T)
        record.positions_T = positions_T
        # the routing is the whole batch's (capacity is first come, first served over all of it); the experts run
        # on token ranges of `tokens_per_call` (all tokens in one call on a GPU)
        chunk = self.experts.tokens_per_call(x_TD, self.top_k)
        y_TD = torch.cat([self._experts(x_TD, record, s, s + chunk) for s in range(0, T, chunk)]) if chunk < T \
            else self._experts(x_TD, record, 0, T)
        if self.shared_experts is not None:
            y_TD = y_TD + self.shared_experts.forward_dense(x_TD)
        if self.record_routing and not ROUTING.recomputing:     # a recomputation repeats a forward already recorded
            self.last_record = record
            if ROUTING.joined is not None and id(self) in ROUTING.joined:
                ROUTING.joined[id(self)].append(record)
        return self.dropout(y_TD)

    def _experts(self, x_TD: torch.Tensor, record: RoutingRecord, start: int, end: int) -> torch.Tensor:
        """The routed experts' output for tokens [start, end) of the batch."""
        # Dispatch: sort token-slots by expert; dropped slots get id E so they sort last and are skipped.
        ids_N = record.topk_ids_TK[start:end].reshape(-1)
        if record.kept_TK is not None:
            ids_N = torch.where(record.kept_TK[start:end].reshape(-1), ids_N, self.num_experts)
        # Order within an expert's group does not matter mathematically, but the matmul's rounding depends on a
        # row's position: sorting as transformers' MoE experts do keeps exported stock models bit-identical.
        order_N = torch.sort(ids_N).indices
        counts_E = count_ids(ids_N, self.num_experts + 1)[: self.num_experts]
        # dropless: every slot runs, a size known on the host; with capacity the kept count is read (one sync)
        slots_N = order_N if record.kept_TK is None else order_N[: int(counts_E.sum())]
        # index_select: its backward is an index_add (plain indexing's is an index_put, sort-based on CUDA)
        weights_N = record.topk_weights_TK[start:end].reshape(-1).index_select(0, slots_N)
        return self.experts(x_TD[start:end], slots_N // self.top_k, weights_N, counts_E)

    @classmethod
    def from_init(cls, experts: FFNWeights, router_ED: torch.Tensor, *, config: MoEConfig | None = None,
                  shared: FFNWeights | None = None, router_bias_E: torch.Tensor | None = None,
                  dtype: torch.dtype | None = None, base: FFNWeights | None = None, **options) -> MoELayer:
        """Build a layer from a method's output (stacked experts, router rows, optional shared experts); the
        routing options as `config` or as its keys (num_experts defaults to the experts given). Delta experts
        (`config.experts: delta`) hold `base` (the dense FFN; default: the experts' mean) and each expert's
        difference from it, cut to `config.delta_rank`."""
        if config is None:
            config = MoEConfig(**{"num_experts": experts.num_experts, **options})
        elif options:
            raise TypeError(f"give the routing options as config or as keywords, not both ({sorted(options)})")
        if config.num_experts != experts.num_experts:
            raise ValueError(f"config.num_experts is {config.num_experts}, the method made {experts.num_experts}")
        layer = cls(ExpertShape.of(experts), config,
                    num_shared_experts=shared.num_experts if shared is not None else 0,
                    shared_intermediate_size=shared.intermediate_size if shared is not None else None,
                    router_bias=router_bias_E is not None,
                    dtype=dtype or experts.w_up.dtype)
        layer.experts.load_weights(experts, base)
        if shared is not None:
            layer.shared_experts.load_weights(shared)
        with torch.no_grad():
            layer.router.weight.copy_(router_ED)
            if router_bias_E is not None:
                layer.router.bias.copy_(router_bias_E)
        return layer


def moe_layers(model: nn.Module) -> dict[str, MoELayer]:
    """Every MoE layer of a model, by qualified name (discovery lives next to the layer it finds)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, MoELayer)}

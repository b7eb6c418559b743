"""Routing, a module of its own so a routing variant is a change in one place (docs/methods.md §1):

    scores -> top-k selection (optionally biased) -> combine weights -> capacity

Score functions:
  softmax  g = softmax(z); the k largest g_i (+ selection bias) are chosen; weights g_i, renormalized over the
           chosen ones when `normalize_topk` (Switch/GShard; CLIP-UP eq. 4 and Qwen-MoE's norm_topk_prob=False
           keep them raw)
  sigmoid  s = sigmoid(z) (DeepSeek-V3, arXiv 2412.19437 eqs. 15-16); the k largest s_i (+ selection bias) are
           chosen; weights s_i / sum_{j chosen} s_j, always normalized, times `route_scale`
Both run in float32 under any autocast. `route_scale` multiplies the combine weights of either (DeepSeek-V3's
routed scaling factor; 1 keeps a copy-upcycled layer exactly the dense FFN).

For the probability-based router losses (load balance, LIMoE) a sigmoid router's probabilities are its
normalized affinities s_i / sum_j s_j (DeepSeek-V3's balance loss, eqs. 18-20): the record's `balance_logits_TE`
is log s, whose softmax is exactly that; for softmax routers it is z itself. The z-loss reads the raw logits.

Capacity (optional): each expert takes at most ceil(C T k / E) slots, first come first served, top-1 choices
before top-2 (Switch/GShard); dropped slots weigh 0, and `renormalize_after_drop` rescales a token's survivors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import MoEConfig
from .autocast import autocast_off


def router_logits(router: nn.Module, x_TD: torch.Tensor) -> torch.Tensor:
    """float32 router logits [T, E] under any autocast (ST-MoE, torchtitan: routing is precision-sensitive).

    Autocast would run the linear in bfloat16 even on float32 inputs, so it is switched off around it; the
    .float() calls are no-ops on a float32 router and guard against a model-wide .to(bfloat16)."""
    device = x_TD.device.type
    off = autocast_off(device)
    with off:
        bias = None if router.bias is None else router.bias.float()
        return F.linear(x_TD.float(), router.weight.float(), bias)


@dataclass
class RoutingRecord:
    """What one forward of one MoE layer decided; read by the losses and the analysis."""

    logits_TE: torch.Tensor           # float32 router logits, still in the autograd graph
    topk_ids_TK: torch.Tensor         # selected experts, best first
    topk_weights_TK: torch.Tensor     # float32 combine weights as applied (0 for dropped slots)
    kept_TK: torch.Tensor | None      # False where capacity dropped the slot; None when dropless
    mask_T: torch.Tensor | None       # True for real tokens; None when the model has no padding mask
    score: str = "softmax"            # the router's score function (module docstring)
    positions_T: torch.Tensor | None = None   # where these tokens sit in the padded batch, when the layer was
    #                                           given the real tokens alone (`moe.real_tokens`); else None

    @classmethod
    def cat(cls, records: list[RoutingRecord]) -> RoutingRecord:
        """The records of several forwards as one (tokens in order): a mask where any had one (the others' tokens
        all real), kept slots where any had capacity; the positions, which refer to different batches, dropped."""
        def joined(name, fill):
            parts = [getattr(r, name) for r in records]
            if all(p is None for p in parts):
                return None
            return torch.cat([fill(r) if p is None else p for r, p in zip(records, parts, strict=True)])

        return cls(torch.cat([r.logits_TE for r in records]), torch.cat([r.topk_ids_TK for r in records]),
                   torch.cat([r.topk_weights_TK for r in records]),
                   joined("kept_TK", lambda r: torch.ones_like(r.topk_ids_TK, dtype=torch.bool)),
                   joined("mask_T", lambda r: torch.ones(r.logits_TE.shape[0], dtype=torch.bool,
                                                         device=r.logits_TE.device)),
                   records[0].score)

    @property
    def balance_logits_TE(self) -> torch.Tensor:
        """Logits whose softmax is the router's probabilities: z (softmax), log sigmoid(z) (sigmoid)."""
        return self.logits_TE if self.score == "softmax" else F.logsigmoid(self.logits_TE)

    @property
    def probs_TE(self) -> torch.Tensor:
        return self.balance_logits_TE.softmax(dim=-1)


def capacity_keep(ids_TK: torch.Tensor, num_experts: int, capacity: int,
                  mask_T: torch.Tensor | None = None) -> torch.Tensor:
    """First-come-first-serve slots (Switch/GShard): top-1 choices in token order, then top-2, ...

    Returns `kept_TK`, False where expert e already holds `capacity` slots. Padding slots are never kept
    and take no capacity.
    """
    T, K = ids_TK.shape
    ids_KT = ids_TK.t()
    # scatter, not F.one_hot: one_hot checks the ids' range, reading their min and max back to the host
    onehot_KTE = torch.zeros(K, T, num_experts, dtype=torch.long, device=ids_TK.device).scatter_(
        2, ids_KT.unsqueeze(-1), 1)
    if mask_T is not None:
        onehot_KTE = onehot_KTE * mask_T.view(1, T, 1).to(onehot_KTE.dtype)
    # position of each slot in its expert's queue, counting in (choice rank, token) order
    position_KT = (onehot_KTE.reshape(K * T, num_experts).cumsum(0).view(K, T, num_experts) * onehot_KTE).sum(-1)
    kept_KT = (position_KT >= 1) & (position_KT <= capacity)
    return kept_KT.t()


def token_entropy(probs_xE: torch.Tensor) -> torch.Tensor:
    """H(p) in nats over the last dimension (the losses, the routing statistics and the EESD teacher's
    uncertain-token choice all use this one); xlogy: 0 log 0 = 0, so a saturated softmax gives a finite entropy
    and gradient."""
    return -torch.special.xlogy(probs_xE, probs_xE).sum(-1)


def count_ids(ids: torch.Tensor, size: int, weights: torch.Tensor | None = None) -> torch.Tensor:
    """How often each id in [0, size) occurs in `ids` (int64; each occurrence counted `weights` times), without a
    host sync: torch.bincount reads the largest id back to the host to size its output, on a GPU a sync."""
    ids = ids.reshape(-1)
    ones = torch.ones_like(ids) if weights is None else weights.reshape(-1).to(ids.dtype)
    return torch.zeros(size, dtype=torch.int64, device=ids.device).index_add_(0, ids, ones)


def expert_counts(topk_ids_TK: torch.Tensor, num_experts: int, mask_T: torch.Tensor | None = None) -> torch.Tensor:
    """Token-slots per expert [E] over the real tokens (padding excluded): the load that the aux-free balancer
    and the routing statistics read."""
    weights = None if mask_T is None else mask_T.reshape(-1, 1).expand_as(topk_ids_TK)
    return count_ids(topk_ids_TK, num_experts, weights)


class Router(nn.Module):
    """The router: a float32 linear map to E scores (state dict `weight` [E, D] and optional `bias` [E], the names
    and initialization of an nn.Linear's), and the routing rule of the module docstring, with the options of a
    `MoEConfig` (validated there).

    Deliberately not an nn.Linear subclass: adapters that wrap every linear layer (peft's `all-linear` LoRA) would
    replace it with a module that has no `route`, and a low-rank update of the router would change the routing the
    model was converted with; as its own module type they leave it alone."""

    def __init__(self, hidden_size: int, config: MoEConfig, *, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = hidden_size, config.num_experts
        self.weight = nn.Parameter(torch.empty(config.num_experts, hidden_size, dtype=torch.float32))
        self.bias = nn.Parameter(torch.empty(config.num_experts, dtype=torch.float32)) if bias else None
        self.config = config        # frozen: the options are read from it, never copied
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's initialization, draw for draw (a seeded conversion makes the same random router as before)."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        """The float32 router logits [T, E] (`router_logits`), as an nn.Linear router's call gave them."""
        return router_logits(self, x_TD)

    @property
    def score(self) -> str:
        return self.config.score

    @property
    def route_scale(self) -> float:
        return self.config.route_scale

    def scores(self, logits_TE: torch.Tensor) -> torch.Tensor:
        return logits_TE.softmax(dim=-1) if self.score == "softmax" else logits_TE.sigmoid()

    def dense_weights(self, x_TD: torch.Tensor) -> torch.Tensor:
        """Weights [T, E] of every expert, for a dense all-expert ensemble (the EESD teacher): the full softmax,
        or the normalized sigmoid affinities, times route_scale."""
        probs_TE = self.scores(router_logits(self, x_TD))
        if self.score == "sigmoid":
            probs_TE = probs_TE / probs_TE.sum(-1, keepdim=True)
        return probs_TE * self.route_scale if self.route_scale != 1.0 else probs_TE

    def route(self, x_TD: torch.Tensor, selection_bias_E: torch.Tensor, mask_T: torch.Tensor | None = None,
              capacity: int | None = None) -> RoutingRecord:
        logits_TE = router_logits(self, x_TD)
        scores_TE = self.scores(logits_TE)
        # The selection bias is applied unconditionally: testing whether it is zero would copy a flag to the
        # host on every forward, and a zero bias selects exactly what topk(scores) selects.
        ids_TK = (scores_TE.detach() + selection_bias_E).topk(self.config.top_k, dim=-1).indices
        weights_TK = scores_TE.gather(-1, ids_TK)
        if self.config.normalize_topk:
            weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
        if self.route_scale != 1.0:
            weights_TK = weights_TK * self.route_scale
        kept_TK = None
        if capacity is not None:
            kept_TK = capacity_keep(ids_TK, self.config.num_experts, capacity, mask_T)
            weights_TK = weights_TK * kept_TK
            if self.config.renormalize_after_drop:
                weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True).clamp_min(1e-20) * self.route_scale
        return RoutingRecord(logits_TE, ids_TK, weights_TK, kept_TK, mask_T, self.score)

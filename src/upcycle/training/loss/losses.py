"""Router regularizers and the self-distillation loss (docs/methods.md §4), pure functions of one layer's routing.

  load_balance   Switch Transformer / CLIP-UP eq. 5: sum_e R_e P_e, R_e = E/(k T) #{top-k slots on e},
                 P_e = mean_t g_e(x_t). 1 under uniform routing, E/k when every token picks the same k experts
                 with equal probability. R counts the router's top-k choices before any capacity dropping.
  z_loss         ST-MoE / CLIP-UP eq. 6: mean_t (logsumexp_e z_te)^2.
  limoe_local    LIMoE / CLIP-UP eq. 8: mean_t H(g(x_t)) (minimizing makes each token's routing confident).
  limoe_global   LIMoE / CLIP-UP eqs. 9-10: max(0, log m - H(P)), P_e = mean_t g_e(x_t): zero once the tokens
                 use about m experts.
  dpsl           Dirichlet-Prior Shaping Loss (re-exported from `dpsl.py`).
  eesd           EESD (Cluster-aware Upcycling): (1/T) sum_t ||sg(y_teacher) - y_student||^2.

Every function takes `mask_T` (True = real token; padding excluded) and `groups_T` (a token group id: modality,
data source, task). With groups, the loss is computed within each group present and averaged over them
(CLIP-UP computes its router losses per modality). Coefficients live in the training config, not here.
Shape suffixes: T tokens, E experts, K top-k, D width.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ...core.router import token_entropy


def _per_group(fn: Callable[[torch.Tensor], torch.Tensor], T: int, device, mask_T: torch.Tensor | None,
               groups_T: torch.Tensor | None) -> torch.Tensor:
    """fn(token weights [T], 1.0 for the tokens taken, 0.0 otherwise) for all real tokens, or averaged over the
    groups present among them. Weights rather than a boolean index keep every shape independent of the data, so
    without groups nothing is read back to the host (on a GPU: no sync); the groups present are read once."""
    keep_T = torch.ones(T, device=device) if mask_T is None else mask_T.to(device).reshape(-1).float()
    if groups_T is None:
        return fn(keep_T)
    groups_T = groups_T.to(device).reshape(-1)
    losses = [fn(keep_T * (groups_T == g)) for g in torch.unique(groups_T[keep_T.bool()]).tolist()]
    return torch.stack(losses).mean()


def _mean(values_T: torch.Tensor, weights_T: torch.Tensor) -> torch.Tensor:
    """The weighted mean over tokens (0 when no token is taken)."""
    return (values_T * weights_T).sum() / weights_T.sum().clamp_min(1)


def load_balance(logits_TE: torch.Tensor, topk_ids_TK: torch.Tensor, *, mask_T: torch.Tensor | None = None,
                 groups_T: torch.Tensor | None = None) -> torch.Tensor:
    E, K = logits_TE.shape[1], topk_ids_TK.shape[1]
    probs_TE = logits_TE.float().softmax(-1)

    def loss(w_T):
        T = w_T.sum().clamp_min(1)
        counts_E = torch.zeros(E, device=logits_TE.device).index_add_(0, topk_ids_TK.reshape(-1),
                                                                      w_T.repeat_interleave(K))
        R_E = E / (K * T) * counts_E
        P_E = (probs_TE * w_T[:, None]).sum(0) / T
        return (R_E * P_E).sum()

    return _per_group(loss, logits_TE.shape[0], logits_TE.device, mask_T, groups_T)


def z_loss(logits_TE: torch.Tensor, *, mask_T: torch.Tensor | None = None,
           groups_T: torch.Tensor | None = None) -> torch.Tensor:
    lse_T = torch.logsumexp(logits_TE.float(), dim=-1)
    return _per_group(lambda w: _mean(lse_T ** 2, w), logits_TE.shape[0], logits_TE.device, mask_T, groups_T)


def limoe_local(logits_TE: torch.Tensor, *, mask_T: torch.Tensor | None = None,
                groups_T: torch.Tensor | None = None) -> torch.Tensor:
    probs_TE = logits_TE.float().softmax(-1)
    return _per_group(lambda w: _mean(token_entropy(probs_TE), w), logits_TE.shape[0], logits_TE.device,
                      mask_T, groups_T)


def limoe_global(logits_TE: torch.Tensor, *, m: float = 6.0, mask_T: torch.Tensor | None = None,
                 groups_T: torch.Tensor | None = None) -> torch.Tensor:
    if not 1 <= m <= logits_TE.shape[1]:
        raise ValueError(f"limoe_global: m must be in [1, E={logits_TE.shape[1]}], got {m}")
    probs_TE = logits_TE.float().softmax(-1)
    threshold = math.log(m)

    def loss(w_T):
        P_E = (probs_TE * w_T[:, None]).sum(0) / w_T.sum().clamp_min(1)
        return (threshold - token_entropy(P_E)).clamp_min(0)

    return _per_group(loss, logits_TE.shape[0], logits_TE.device, mask_T, groups_T)


def eesd(student_TD: torch.Tensor, teacher_TD: torch.Tensor, *,
         mask_T: torch.Tensor | None = None) -> torch.Tensor:
    """(1/T) sum over real tokens of ||sg(teacher) - student||^2 (squared L2 over the width, mean over tokens);
    the teacher is detached here, so no gradient reaches it whatever the caller passes."""
    diff_TD = student_TD.float() - teacher_TD.detach().float()
    sq_T = (diff_TD * diff_TD).sum(-1)
    weights_T = torch.ones_like(sq_T) if mask_T is None else mask_T.to(sq_T.device).reshape(-1).float()
    return _mean(sq_T, weights_T)

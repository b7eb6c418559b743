"""Router regularizers and the self-distillation loss (METHODS §4), pure functions of one layer's routing.

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

from ..core.router import token_entropy  # noqa: F401  (public name: upcycle.losses.token_entropy)
from .dpsl import dpsl  # noqa: F401  (public name: upcycle.losses.dpsl)


def _per_group(fn: Callable[[torch.Tensor], torch.Tensor], T: int, device, mask_T: torch.Tensor | None,
               groups_T: torch.Tensor | None) -> torch.Tensor:
    """fn(selected token indices) for all real tokens, or averaged over the groups present among them."""
    keep_T = torch.ones(T, dtype=torch.bool, device=device) if mask_T is None else mask_T.to(device).bool()
    if groups_T is None:
        return fn(keep_T)
    groups_T = groups_T.to(device).reshape(-1)
    losses = [fn(keep_T & (groups_T == g)) for g in torch.unique(groups_T[keep_T]).tolist()]
    return torch.stack(losses).mean()


def load_balance(logits_TE: torch.Tensor, topk_ids_TK: torch.Tensor, *, mask_T: torch.Tensor | None = None,
                 groups_T: torch.Tensor | None = None) -> torch.Tensor:
    E, K = logits_TE.shape[1], topk_ids_TK.shape[1]
    probs_TE = logits_TE.float().softmax(-1)

    def loss(sel_T):
        T = sel_T.sum().clamp_min(1)
        counts_E = torch.zeros(E, device=logits_TE.device).index_add_(
            0, topk_ids_TK[sel_T].reshape(-1), torch.ones(int(sel_T.sum()) * K, device=logits_TE.device))
        R_E = E / (K * T) * counts_E
        P_E = probs_TE[sel_T].sum(0) / T
        return (R_E * P_E).sum()

    return _per_group(loss, logits_TE.shape[0], logits_TE.device, mask_T, groups_T)


def z_loss(logits_TE: torch.Tensor, *, mask_T: torch.Tensor | None = None,
           groups_T: torch.Tensor | None = None) -> torch.Tensor:
    lse_T = torch.logsumexp(logits_TE.float(), dim=-1)
    return _per_group(lambda sel: (lse_T[sel] ** 2).mean(), logits_TE.shape[0], logits_TE.device, mask_T, groups_T)


def limoe_local(logits_TE: torch.Tensor, *, mask_T: torch.Tensor | None = None,
                groups_T: torch.Tensor | None = None) -> torch.Tensor:
    probs_TE = logits_TE.float().softmax(-1)
    return _per_group(lambda sel: token_entropy(probs_TE[sel]).mean(), logits_TE.shape[0], logits_TE.device,
                      mask_T, groups_T)


def limoe_global(logits_TE: torch.Tensor, *, m: float = 6.0, mask_T: torch.Tensor | None = None,
                 groups_T: torch.Tensor | None = None) -> torch.Tensor:
    if not 1 <= m <= logits_TE.shape[1]:
        raise ValueError(f"limoe_global: m must be in [1, E={logits_TE.shape[1]}], got {m}")
    probs_TE = logits_TE.float().softmax(-1)
    threshold = math.log(m)
    return _per_group(lambda sel: (threshold - token_entropy(probs_TE[sel].mean(0))).clamp_min(0),
                      logits_TE.shape[0], logits_TE.device, mask_T, groups_T)


def eesd(student_TD: torch.Tensor, teacher_TD: torch.Tensor, *,
         mask_T: torch.Tensor | None = None) -> torch.Tensor:
    """(1/T) sum over real tokens of ||sg(teacher) - student||^2 (squared L2 over the width, mean over tokens);
    the teacher is detached here, so no gradient reaches it whatever the caller passes."""
    diff_TD = student_TD.float() - teacher_TD.detach().float()
    sq_T = (diff_TD * diff_TD).sum(-1)
    if mask_T is not None:
        sq_T = sq_T[mask_T.to(sq_T.device).bool()]
    return sq_T.mean() if sq_T.numel() else sq_T.sum()

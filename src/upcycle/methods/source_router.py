"""Router rows for an MoE merged from several fine-tuned models of one base.

Branch-Train-MiX (Sukhbaatar et al. 2024, arXiv:2403.07816) makes one routed expert of each fine-tune's FFN and
learns the router from scratch; mergekit-moe's `gate_mode: hidden` instead starts each expert's router row from
the base model's hidden states on a few prompts written for that expert. Here, per MoE layer and per expert
(source s, its FFN inputs X_s, rows unit-normalized first so that no token's norm dominates):

  random   w_s ~ N(0, std^2)                                                    (Sparse Upcycling's router)
  prompts  w_s = unit( mean_t unit(x_t) over the prompts' tokens  -  the same over the negative prompts' )
           (mergekit's hidden mode, on the FFN's own input rather than the block's residual input)
  data     w_s = unit( mean_t unit(x_t) over the source's own calibration tokens )
           (Cluster-aware Upcycling's centroid router, with the clusters given by the sources, not found)

For unit rows, the top-1 expert of a token x is argmax_s <w_s, x>: the source whose (spherical) centroid is
closest in angle. Experts made from one source share its row. Shape suffixes: N tokens, D width, E experts.
"""

from __future__ import annotations

import torch

from ..errors import UpcycleError


def _unit(v: torch.Tensor) -> torch.Tensor:
    return v / torch.linalg.vector_norm(v, dim=-1, keepdim=True).clamp_min(1e-12)


def spherical_mean(x_ND: torch.Tensor) -> torch.Tensor:
    """mean_t unit(x_t) [D], in float64 (a sum over many tokens)."""
    if x_ND.dim() != 2 or x_ND.shape[0] == 0:
        raise UpcycleError(f"router rows need a non-empty [tokens, width] sample, got {tuple(x_ND.shape)}")
    return _unit(x_ND.double()).mean(0)


def centroid_row(x_ND: torch.Tensor, negative_ND: torch.Tensor | None = None) -> torch.Tensor:
    """unit(spherical_mean(x) - spherical_mean(negative)) [D] float32: the `data` row (no negative) and the
    `prompts` row (the negative prompts' tokens subtracted, as mergekit-moe subtracts them)."""
    row = spherical_mean(x_ND)
    if negative_ND is not None and negative_ND.shape[0] > 0:
        row = row - spherical_mean(negative_ND)
    if float(torch.linalg.vector_norm(row)) < 1e-9:
        raise UpcycleError("a router row is zero: the prompts and the negative prompts have the same mean")
    return _unit(row).float()


def source_router(rows_SD: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The [E, D] router of experts made `counts[s]` at a time from source s: source s's row repeated."""
    if rows_SD.shape[0] != len(counts) or min(counts) < 1:
        raise UpcycleError(f"{rows_SD.shape[0]} source rows for counts {counts}")
    return torch.cat([rows_SD[s:s + 1].expand(n, -1) for s, n in enumerate(counts)]).contiguous()


def expert_groups(counts: list[int]) -> torch.Tensor:
    """The source index of every expert [E] (experts are laid out source by source)."""
    return torch.cat([torch.full((n,), s, dtype=torch.long) for s, n in enumerate(counts)])


def source_agreement(topk_ids_TK: torch.Tensor, groups_E: torch.Tensor, source: int) -> float:
    """Fraction of a source's tokens whose top-1 expert was made from that source."""
    return float((groups_E.to(topk_ids_TK.device)[topk_ids_TK[:, 0]] == source).double().mean())

"""`spri`: SVD-Partitioned Residual Initialization (Shan et al., 2026; docs/methods.md §2.6).

Shared expert <- the dense FFN (always on). Routed experts: every projection is a dense copy except the
residual-carrying one (`placement`: down by default, or gate, or up) of weight W = U diag(s) V^T (rank r):

    G = E / k groups, expert i (1-based) in group g(i) = ceil(i / k); {1..r} split into G contiguous blocks I_g
    R_g = U[:, I_g] diag(s_{I_g}) V[:, I_g]^T,   alpha_g = rho ||W||_F / (||R_g||_F + delta)
    W_i = alpha_{g(i)} R_{g(i)} + eps_i

so at init the layer is the dense FFN plus a residual of relative size about rho (a plain MLP reads W1 as up,
W2 as down; `gate` is refused for it).

Choices where the paper is silent:
- Blocks: the first r mod G blocks get one index more (numpy.array_split); G > r is refused.
- eps_i ~ N(0, sigma^2) i.i.d. per entry, sigma = perturbation * rho * ||W||_F / sqrt(numel(W)), i.e. relative
  to the entry RMS of the residual (||alpha R_g||_F ~ rho ||W||_F). It scales with rho, so rho = 0 gives exactly
  zero routed residuals and the layer is exactly the dense FFN (with the shared expert), for any routing.
- Biases (the paper's Llama FFNs have none): with the shared expert, the routed experts' b_down and the
  residual-carrying projection's bias are zero (the shared expert already adds the dense biases; a copied
  bias would add a second, non-small copy); the other input biases are copied. This needs act(0) = 0 for
  gate/up placement, true of every usual FFN activation (gelu, silu, relu, ...).
- shared_expert=False: expert 1 is the exact dense copy (an ordinary routed expert), and every other routed
  expert i is a full dense FFN whose residual-carrying projection is W + alpha_{g(i)} R_{g(i)} + eps_i (biases
  copied). Every expert is then the dense FFN up to a relative O(rho) change, so with renormalized top-k the
  layer stays the dense FFN plus a residual of relative size about rho. Groups are still over all E experts.
- SVD in float64 on W's device; random draws from the CPU generator (eps for experts in order, then the router);
  results cast back to W's dtype. The router is `random_router` (N(0, router_std^2)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Annotated

import torch

from ..config import OneOf, Range
from ..core.ffn import FFNWeights
from ..errors import UpcycleError
from .registry import ExpertInit, LayerInputs, LayerLayout, random_router, register

PROJECTION = {"down": ("w_down", "b_down"), "gate": ("w_gate", "b_gate"), "up": ("w_up", "b_up")}


@dataclass(frozen=True)
class SpriArgs:
    """The arguments of `spri` (`--set method_args.NAME=VALUE`): their types, allowed values and defaults."""

    rho: Annotated[float, Range(0)] = 0.001
    delta: Annotated[float, Range(0)] = 1e-12
    placement: Annotated[str, OneOf(*PROJECTION)] = 'down'
    shared_expert: bool = True
    perturbation: Annotated[float, Range(0)] = 0.01
    router_std: float = 0.02


@register("spri", paper="Shan et al. 2026, SVD-Partitioned Residual Initialization (SPRI)",
          preserves_function=lambda args, normalize_topk, dropless: args["rho"] == 0 and args["shared_expert"],
          layout=lambda width, args: LayerLayout(width, width if args["shared_expert"] else None),
          no_deltas="its routed experts are disjoint SVD blocks of the dense FFN beside a shared expert: each differs "
                    "from the dense FFN by most of the FFN's rank, not by a low-rank change")
def spri(ffn: FFNWeights, layer: LayerInputs, args: SpriArgs) -> ExpertInit:
    """Shared dense expert + routed experts whose one projection is a scaled SVD block of the dense weight."""
    num_experts, top_k, generator = layer.num_experts, layer.top_k, layer.generator
    rho, delta, placement = args.rho, args.delta, args.placement
    shared_expert, perturbation, router_std = args.shared_expert, args.perturbation, args.router_std
    if placement == "gate" and not ffn.gated:
        raise UpcycleError("spri: placement 'gate' needs a gated FFN; this one is a plain MLP (use 'up' or 'down')")
    if num_experts % top_k:
        raise UpcycleError(f"spri: num_experts ({num_experts}) must be divisible by top_k ({top_k}): "
                           f"the experts form G = E / k groups")
    G = num_experts // top_k
    w_name, b_name = PROJECTION[placement]
    w = getattr(ffn, w_name)
    w64 = w.detach().to(torch.float64)
    U, s, Vh = torch.linalg.svd(w64, full_matrices=False)
    r = s.numel()
    if G > r:
        raise UpcycleError(f"spri: {G} groups cannot split a rank-{r} spectrum into non-empty blocks")
    norm = torch.linalg.matrix_norm(w64).item()
    residuals, alphas = [], []
    for block in torch.arange(r).tensor_split(G):
        R = (U[:, block] * s[block]) @ Vh[block]
        alpha = rho * norm / (torch.linalg.matrix_norm(R).item() + delta)
        residuals.append(alpha * R)
        alphas.append(alpha)
    sigma = perturbation * rho * norm / math.sqrt(w.numel())
    stack = []
    for i in range(num_experts):
        eps = torch.randn(w.shape, generator=generator, dtype=torch.float64).to(w.device) * sigma
        residual = residuals[i // top_k] + eps
        if shared_expert:
            stack.append(residual.to(w.dtype))
        else:
            stack.append(w.clone() if i == 0 else (w64 + residual).to(w.dtype))
    experts = replace(ffn.expand(num_experts), **{w_name: torch.stack(stack)})
    if shared_expert:
        present = [b for b in (b_name, "b_down") if getattr(experts, b) is not None]
        experts = replace(experts, **{b: torch.zeros_like(getattr(experts, b)) for b in present})
    router = random_router(num_experts, ffn.hidden_size, router_std, generator)
    return ExpertInit(experts=experts, router_ED=router, shared=ffn.repeat(1) if shared_expert else None,
                      info={"groups": G, "rank": r, "alpha": alphas, "placement": placement,
                            "shared_expert": shared_expert, "perturbation_std": sigma})

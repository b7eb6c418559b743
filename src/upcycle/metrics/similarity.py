"""How alike the experts of one layer are, per projection and in what they compute (docs/methods.md §5).

  weight_similarity   the E x E cosine matrix of the vectorized expert weights and its mean over the pairs i < j,
                      for each projection (gate, up, down) and for all of them together: one number over all the
                      weights hides which projection differs (SPRI keeps gate/up identical and splits down; the
                      cluster method moves all three)
  expert_outputs      y_ETD = E_e(x_t): every routed expert on every token, whatever the router chose
  output_similarity   mean over tokens of cos(E_i(x_t), E_j(x_t)): the E x E matrix and its mean over pairs i < j;
                      experts whose weights differ can still compute nearly the same function on real inputs

Shape suffixes: E experts, T tokens, D model width. Results are plain floats and nested lists (JSON as is).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core.ffn import FFNWeights, activation_fn

# the Gram matrix accumulated a block of columns at a time (no float64 copy of whole experts), and its cosines
from .experts import cosine_matrix, gram_matrix


def _summary(cos_EE: torch.Tensor) -> dict:
    """{'matrix': E x E, 'mean': mean over the pairs i < j (None for one expert)}."""
    E = cos_EE.shape[0]
    i, j = torch.triu_indices(E, E, offset=1)
    mean = float(cos_EE[i, j].mean()) if E > 1 else None
    return {"matrix": cos_EE.tolist(), "mean": mean}


def weight_similarity(experts: FFNWeights) -> dict:
    """{'gate'|'up'|'down'|'all': {'matrix', 'mean'}}; 'gate' is absent for ungated experts; biases excluded."""
    parts = {"gate": experts.w_gate, "up": experts.w_up, "down": experts.w_down}
    grams = {name: gram_matrix([t]) for name, t in parts.items() if t is not None}
    out = {name: _summary(cosine_matrix(gram)) for name, gram in grams.items()}
    # the inner products of the concatenated vectors are the sums of the per-projection ones
    out["all"] = _summary(cosine_matrix(sum(grams.values())))
    return out


@torch.no_grad()
def expert_outputs(experts: FFNWeights, x_TD: torch.Tensor) -> torch.Tensor:
    """[E, T, D] float32: each expert's output on each token (biases included), computed in the experts' dtype."""
    act = activation_fn(experts.activation)
    x = x_TD.to(experts.w_up.dtype)
    out = []
    for e in range(experts.num_experts):
        one = experts.expert(e)
        h = F.linear(x, one.w_up, one.b_up)
        h = act(F.linear(x, one.w_gate, one.b_gate)) * h if one.gated else act(h)
        out.append(F.linear(h, one.w_down, one.b_down).float())
    return torch.stack(out)


def output_similarity(y_ETD: torch.Tensor) -> dict:
    """{'matrix', 'mean'} of mean_t cos(y_i(x_t), y_j(x_t)) (a token where an expert outputs zero counts 0)."""
    unit = F.normalize(y_ETD.double(), dim=-1)
    cos_EE = torch.einsum("itd,jtd->ij", unit, unit) / y_ETD.shape[1]
    return _summary(cos_EE)

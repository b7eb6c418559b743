"""What every kind of stacked routed experts offers besides its own forward (`moe.Experts`: E whole FFNs;
`delta_experts.DeltaExperts`: one base FFN plus a low-rank change per expert): the dense all-expert ensemble, and
how many tokens one call takes on the CPU. Both kinds take the same forward arguments (slots sorted by expert), so
these are written once, against that forward."""

from __future__ import annotations

import torch
from torch import nn

from .grouped_ffn import compute_dtype, tokens_per_call


class ExpertStack(nn.Module):
    """The shared part of the expert kinds; a kind defines `forward(x_TD, tokens_N, weights_N, counts)`,
    `num_experts`, `hidden_size`, `intermediate_size`, `gated` and `dtype`."""

    def parameters_per_expert(self) -> int:
        """Parameters that belong to one routed expert alone (an unrouted token does not use them)."""
        shared = sum(p.numel() for p in self.shared_parameters())
        return (sum(p.numel() for p in self.parameters()) - shared) // self.num_experts

    def shared_parameters(self) -> list:
        """Parameters every expert uses (a delta layer's base); none for whole experts."""
        return []

    def tokens_per_call(self, x_TD: torch.Tensor, slots_per_token: int) -> int:
        """How many tokens of `x_TD` one call takes (`grouped_ffn.tokens_per_call`: all of them on a GPU; on the
        CPU as many as keep the working set of a call, the hidden states of its slots, under a bound)."""
        E, D, F_ = self.num_experts, self.hidden_size, self.intermediate_size
        dtype = compute_dtype(x_TD.device, self.dtype, x_TD.dtype)
        return tokens_per_call(x_TD.shape[0], slots_per_token, (E, 2 * F_ if self.gated else F_, D), (E, D, F_),
                               dtype, x_TD.device)

    def forward_dense(self, x_TD: torch.Tensor, weights_TE: torch.Tensor | None = None) -> torch.Tensor:
        """Every expert on every token, summed with `weights_TE` (1 when None): shared experts, and the dense
        all-expert ensemble a distillation teacher computes."""
        E, T = self.num_experts, x_TD.shape[0]
        chunk = self.tokens_per_call(x_TD, E)
        if chunk < T:
            return torch.cat([self.forward_dense(x_TD[s:s + chunk], None if weights_TE is None else
                                                 weights_TE[s:s + chunk]) for s in range(0, T, chunk)])
        tokens_N = torch.arange(T, device=x_TD.device).repeat(E)
        weights_N = (torch.ones(E * T, device=x_TD.device) if weights_TE is None
                     else weights_TE.t().reshape(-1))
        return self(x_TD, tokens_N, weights_N, torch.full((E,), T, device=x_TD.device))
